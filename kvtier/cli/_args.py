"""The ``kvtier`` command's arguments: its parser, and a bad argument or file refused
in one line on stderr with exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtier import __version__

__all__ = ["MIB", "build_parser", "fail", "read_json_object"]

MIB = 1 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtier: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _spoken_list(words: Sequence[str]) -> str:
    """``a, b and c``."""
    return " and ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else "".join(words)


def build_parser() -> argparse.ArgumentParser:
    from kvtier.bench import BENCH_TIERS, WORKLOADS

    parser = _Parser(prog="kvtier", description="Multi-tier KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    bench = commands.add_parser(
        "bench",
        help="replay a serving workload through the tiers and report hit rates and throughput",
        description="Replay a serving workload through KVTier (primary tier + secondary tiers) "
        "the way an async serving engine would, then report per-tier hit rates, GB/s, "
        "latency percentiles and event-loop lag against the disk and memory bandwidth "
        "measured in the same run. Without a GPU, CPU tensors stand in for it.",
    )
    bench.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="multi-round-qa",
        help="which workload to replay (default: multi-round-qa)",
    )
    bench.add_argument(
        "--tiers",
        default="fs",
        help="comma-separated secondary tiers, in lookup order, from "
        f"{_spoken_list(BENCH_TIERS.names())} "
        "(default: fs); s3 starts a local S3 server, p2p a peer engine on loopback",
    )
    bench.add_argument(
        "--config",
        type=Path,
        help="JSON file of extra_config keys to apply; a secondary_tiers list there "
        "replaces --tiers (to benchmark real endpoints and peers)",
    )
    bench.add_argument(
        "--chunk-mib", type=_positive_float, default=1.0, help="bytes per chunk, MiB (1)"
    )
    bench.add_argument(
        "--primary-mib", type=_positive_int, default=1024, help="primary tier, MiB (1024)"
    )
    bench.add_argument(
        "--working-set-mib", type=_positive_int, default=3072, help="distinct data, MiB (3072)"
    )
    bench.add_argument(
        "--max-prompt-chunks", type=_positive_int, default=64, help="longest prompt (64)"
    )
    bench.add_argument(
        "--concurrency", type=_positive_int, default=4, help="requests in flight (4)"
    )
    bench.add_argument(
        "--duration", type=_positive_float, default=180.0, help="stop after this many seconds (180)"
    )
    bench.add_argument(
        "--root",
        type=Path,
        help="working directory: the fs tier (ROOT/fs), the local S3 server's data "
        "(ROOT/s3); new or empty unless --reuse-root; created if missing, its parent "
        "never (default: a temporary one, removed after the run)",
    )
    bench.add_argument(
        "--reuse-root",
        action="store_true",
        help="start from the cache an earlier run left in --root (a warm start: more hits)",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--json", dest="json_path", type=Path, help="also write the report as JSON here"
    )
    bench.add_argument(
        "--plot", type=Path, help="draw hit rate and throughput over time (needs matplotlib)"
    )
    bench.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT"
    )
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")

    inspect = commands.add_parser(
        "inspect",
        help="list what an fs tier's root_dir holds; --verify checks every chunk",
        description="List the namespaces, chunk counts and bytes under an fs tier's root_dir. "
        "With --verify, read every chunk file and check its header and checksum.",
    )
    inspect.add_argument("root_dir", type=Path)
    inspect.add_argument("--verify", action="store_true", help="check every file's checksum")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")

    plan = commands.add_parser(
        "plan",
        help="check a configuration and show the primary region it describes",
        description="Validate an extra_config the way the engine reads it and print the "
        "chunk geometry and region size it yields.",
    )
    plan.add_argument(
        "--config",
        type=Path,
        help="JSON file holding the extra_config (kv_connector_extra_config) mapping",
    )
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set one extra_config key (value parsed as JSON, else taken as a string)",
    )
    plan.add_argument(
        "--kv-bytes-per-block", type=int, required=True, help="bytes one worker holds per GPU block"
    )
    plan.add_argument("--tokens-per-block", type=int, default=16)
    plan.add_argument("--world-size", type=int, default=1)
    plan.add_argument("--engine-id", default="plan")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def fail(message: str) -> NoReturn:
    print(f"kvtier: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        fail(f"{path} is not valid JSON: {exc}")
    if not isinstance(loaded, dict):
        fail(f"{path} must hold a JSON object (the extra_config mapping)")
    return loaded
