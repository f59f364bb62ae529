"""One bench run: start its tiers, replay the workload, report against the hardware.

The steps, each in its own module: the tiers named by ``--tiers`` are started from
their :mod:`bench tier entries <kvtier.bench.registry>`, the simulated
:mod:`engine <kvtier.bench.engine>` is opened on them, the workload is
:mod:`replayed <kvtier.bench.replay>`, the :mod:`report <kvtier.bench.report>` is
built, and each tier's :mod:`physical limit <kvtier.bench.limits>` is measured last,
on the same disk, server or network, once the engine is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.bench.engine import Engine, copy_engine, device, kv_caches
from kvtier.bench.limits import measure_limits
from kvtier.bench.registry import BenchTierRegistry, LocalTier, TierTraffic
from kvtier.bench.replay import Progress, replay
from kvtier.bench.report import PRIMARY, build_report, tier_problems
from kvtier.bench.settings import BenchSettings, bench_config
from kvtier.bench.tiers import BENCH_TIERS
from kvtier.bench.workloads import WorkloadSize, build_workload
from kvtier.facade import KVTier
from kvtier.tiers import SecondaryTier

__all__ = ["cannot_create_in", "check_root", "run_bench"]

# How long the engine waits for its tiers to be ready (a p2p tier to hear of a spawned
# peer's chunks) before it starts anyway.
_READY_TIMEOUT_S = 60.0
_READY_POLL_S = 0.05


async def run_bench(
    settings: BenchSettings,
    *,
    progress: Progress | None = None,
    registry: CollectorRegistry | None = None,
    tiers: BenchTierRegistry = BENCH_TIERS,
    phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``settings.workload`` and return the report (see ``kvtier bench --json``).

    ``tiers`` are the bench tiers ``settings.tiers`` names; ``registry`` receives the
    engine's metrics; ``phase`` hears what the run is doing each time that changes.
    """
    say = phase if phase is not None else _silent
    workload = build_workload(
        settings.workload,
        WorkloadSize(settings.working_set_chunks, settings.max_prompt_chunks, settings.seed),
    )
    metrics = registry if registry is not None else CollectorRegistry()
    # A secondary_tiers list of the user's own replaces what --tiers would start.
    names = () if "secondary_tiers" in settings.extra_config else settings.tiers
    with _workspace(settings.root_dir, settings.reuse_root) as root, _tier_problems() as problems:
        say(f"starting {_spoken(names)}" if names else "starting the tiers of --config")
        async with _start_tiers(names, settings, root, tiers) as local:
            config = bench_config(settings, [tier.config for tier in local])
            gpu_blocks = settings.max_prompt_chunks * (settings.concurrency + 1)
            caches = kv_caches(settings, gpu_blocks)
            async with KVTier(config, caches, metrics, engine=copy_engine()) as kv:
                await _until_ready(local, kv.manager.tiers)
                engine = Engine(kv, caches, gpu_blocks, settings.lookup_timeout_s)
                say(f"replaying {workload.requests:,} requests")
                try:
                    run = await replay(kv, engine, workload, settings, progress)
                finally:
                    await engine.aclose()
                labels = [PRIMARY, *kv.manager.diagnostics.tier_labels]
                counts = kv.manager.diagnostics.tier_stats()
                promotions = kv.manager.diagnostics.promotion_latencies()
                built = dict(zip(kv.manager.diagnostics.tier_labels, kv.manager.tiers, strict=True))
                recompute_s = kv.manager.host.recompute_s_per_chunk
            report = build_report(settings, workload, run, counts, labels, promotions, device())
            report["settings"]["recompute_s_per_chunk"] = recompute_s
            report["duration_s"] = round(run.elapsed_s, 3)
            report["errors"], report["warnings"] = tier_problems(report["tiers"], problems.reasons)
            traffic = {entry["name"]: _traffic(entry) for entry in report["tiers"]}
            report["physical"], report["ratios"], report["ratio_notes"] = await measure_limits(
                {label: (tier, traffic[label]) for label, tier in built.items()},
                tiers,
                chunk_bytes=settings.chunk_bytes,
                workspace=root,
                phase=say,
            )
    return report


def _silent(text: str) -> None:
    pass


def _spoken(names: Sequence[str]) -> str:
    words = list(names)
    listed = " and ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else words[0]
    return f"the {listed} tier{'s' if len(words) > 1 else ''}"


@contextlib.asynccontextmanager
async def _start_tiers(
    names: Sequence[str], settings: BenchSettings, root: Path, tiers: BenchTierRegistry
) -> AsyncIterator[list[LocalTier]]:
    """Start what the bench tiers ``names`` need, in order; stop it all on exit."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(tiers.get(name).start(settings, root)) for name in names
        ]


async def _until_ready(local: Sequence[LocalTier], built: Sequence[SecondaryTier]) -> None:
    """Wait (a while) until each started tier says the tier built from it is ready."""
    if not local:
        return  # the tiers came from --config: nothing of ours to wait for
    waiting = [
        (tier.ready, instance)
        for tier, instance in zip(local, built, strict=True)
        if tier.ready is not None
    ]
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not all(ready(instance) for ready, instance in waiting):
        if time.monotonic() > deadline:
            return  # the run shows what the tier knew by then: fewer hits there
        await asyncio.sleep(_READY_POLL_S)


class _FirstProblems(logging.Handler):
    """The first warning each tier logs during a run, by label: why it failed.

    The tiers' runners log each kind of failure as ``tier <label>: <what happened>``.
    """

    _PREFIX = re.compile(r"tier (\d+:[^:]+): (.+)", re.S)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = self._PREFIX.fullmatch(record.getMessage())
        if found is None or found.group(1) in self.reasons:
            return
        # The first line: kvtier logs a failure as text, its traceback after it.
        self.reasons[found.group(1)] = found.group(2).splitlines()[0]


@contextlib.contextmanager
def _tier_problems() -> Iterator[_FirstProblems]:
    handler = _FirstProblems()
    library = logging.getLogger("kvtier")
    library.addHandler(handler)
    try:
        yield handler
    finally:
        library.removeHandler(handler)


def _traffic(entry: dict[str, Any]) -> TierTraffic:
    return TierTraffic(
        entry["bytes_written"], entry["bytes_read"], entry["write_gbps"], entry["read_gbps"]
    )


@contextlib.contextmanager
def _workspace(root_dir: Path | None, reuse: bool) -> Iterator[Path]:
    if root_dir is None:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as directory:
            yield Path(directory)
        return
    check_root(root_dir, reuse)
    root_dir.mkdir(exist_ok=True)
    yield root_dir


def check_root(root_dir: Path, reuse: bool) -> None:
    """Refuse a ``--root`` that would mix this run with what is there already.

    A directory holding anything would hand this run an earlier run's cache (its hit
    rate measuring that run, not this one) unless ``reuse`` says that is the point. A
    missing ``root_dir`` is created, but never its parents: a mistyped path must not
    leave gigabytes somewhere nobody looks.

    Raises:
        ValueError: ``root_dir`` is a file, is not empty (and ``reuse`` is false), or
            cannot be written; its parent does not exist, or nothing can be created in it.
    """
    if root_dir.is_dir():
        if not reuse and any(root_dir.iterdir()):
            raise ValueError(
                f"--root {root_dir} is not empty: this run would measure what an earlier "
                "one left there; name a new or empty directory, or pass --reuse-root to "
                "start from that cache on purpose"
            )
        problem = cannot_create_in(root_dir)
        if problem is not None:
            raise ValueError(f"--root {root_dir}: cannot write in it: {problem}")
        return
    if root_dir.exists():
        raise ValueError(f"--root {root_dir} is not a directory")
    parent = root_dir.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(
            f"--root {root_dir}: {parent} {what} (kvtier bench creates --root itself, "
            "never its parents)"
        )
    problem = cannot_create_in(parent)
    if problem is not None:
        raise ValueError(f"--root {root_dir}: cannot create it in {parent}: {problem}")


def cannot_create_in(directory: Path) -> str | None:
    """Why nothing can be created in ``directory`` (its ``strerror``), or None if it can.

    Found by creating a directory there and removing it: permission bits do not tell
    (root ignores them, a read-only mount or a full disk does not show in them).
    """
    try:
        probe = tempfile.mkdtemp(prefix=".kvtier-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.rmdir(probe)
    return None
