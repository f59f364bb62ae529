"""``kvtier inspect``: what an fs tier's ``root_dir`` holds, and with ``--verify``
whether every chunk file is intact."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kvtier.cli._args import fail

__all__ = ["inspect_command"]


def inspect_command(args: argparse.Namespace) -> int:
    from kvtier.cache_inspect import hint, inspect_root

    try:
        reports = inspect_root(args.root_dir, verify=args.verify)
    except (FileNotFoundError, NotADirectoryError) as exc:
        fail(str(exc))
    if not reports:
        # An error, not an empty listing: a script must be able to tell a wrong path
        # from an empty cache (a started tier has a namespace, even with no chunk).
        fail(f"{args.root_dir}: no kvtier cache (no */namespace.json); {hint(args.root_dir)}")
    if args.json:
        print(json.dumps([asdict(report) for report in reports], indent=2))
    else:
        for report in reports:
            print(f"{report.directory}")
            print(f"  namespace  {report.namespace}")
            print(f"  chunks     {report.chunks:,} ({report.bytes / 1e9:.3f} GB)")
            if report.temporary_files:
                left = report.temporary_files
                print(f"  temporary  {left} (left by writers that died; removed at next start)")
            if report.verified is not None and report.bad is not None:
                print(f"  verified   {report.verified:,} good, {len(report.bad):,} bad")
                for name, problem in sorted(report.bad.items()):
                    print(f"    {name}: {problem}")
            else:
                print("  verified   not checked (--verify reads every chunk)")
    return 1 if any(report.bad for report in reports) else 0
