"""``kvtier bench``: serving workloads replayed through the whole stack."""

from kvtier.bench.run import run_bench
from kvtier.bench.settings import BenchSettings
from kvtier.bench.workloads import WORKLOADS, WorkloadSize, build_workload

__all__ = ["WORKLOADS", "BenchSettings", "WorkloadSize", "build_workload", "run_bench"]
