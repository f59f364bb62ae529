"""The ``kvtier`` command line.

``kvtier plan`` checks a configuration the way the engine will read it and prints how
the primary region will be laid out, so a user can size ``cpu_bytes_to_use`` and
``block_size`` before starting a server.

Every error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtier import __version__
from kvtier.config import ChunkGeometry, OffloadingConfig
from kvtier.errors import KVTierError
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtier: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="Multi-tier KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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


def _fail(message: str) -> NoReturn:
    print(f"kvtier: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _load_extra_config(path: Path | None, overrides: Sequence[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = json.loads(path.read_text())
        except OSError as exc:
            _fail(f"cannot read {path}: {exc.strerror}")
        except json.JSONDecodeError as exc:
            _fail(f"{path} is not valid JSON: {exc}")
        if not isinstance(loaded, dict):
            _fail(f"{path} must hold a JSON object (the extra_config mapping)")
        extra.update(loaded)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--set expects KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def _plan(args: argparse.Namespace) -> int:
    extra = _load_extra_config(args.config, args.overrides)
    try:
        config = OffloadingConfig(
            engine_id=args.engine_id,
            kv_bytes_per_block=args.kv_bytes_per_block,
            tokens_per_block=args.tokens_per_block,
            world_size=args.world_size,
            extra_config=extra,
        )
        spec_class = OffloadingSpecFactory.get_spec_class(config)
        spec = spec_class(config)
    except KVTierError as exc:
        _fail(str(exc))
    if not isinstance(spec, CPUOffloadingSpec):
        _fail(f"{spec_class.__name__} is valid, but kvtier plan only describes CPU-based specs")
    geometry: ChunkGeometry = spec.geometry
    plan = {
        "spec": spec_class.__name__,
        "tokens_per_chunk": geometry.tokens_per_chunk,
        "blocks_per_chunk": geometry.blocks_per_chunk,
        "world_size": geometry.world_size,
        "column_bytes": geometry.column_bytes,
        "chunk_bytes": geometry.chunk_bytes,
        "num_chunks": geometry.num_chunks,
        "region_bytes": geometry.region_bytes,
        "unused_bytes": spec.cpu_bytes_to_use - geometry.region_bytes,
        "eviction_policy": spec.eviction_policy,
        "tokens_cached": geometry.num_chunks * geometry.tokens_per_chunk,
    }
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        width = max(len(key) for key in plan)
        for key, value in plan.items():
            shown = f"{value:,}" if isinstance(value, int) else str(value)
            print(f"{key:<{width}}  {shown}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse enforces choices


if __name__ == "__main__":
    sys.exit(main())
