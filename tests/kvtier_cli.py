"""Running the installed ``kvtier`` command the way a user does: a process of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# The console script installed next to this interpreter: the real entry point.
KVTIER = shutil.which("kvtier", path=str(Path(sys.executable).parent)) or "kvtier"

#: The smallest bench the options allow to mean anything: 16 MiB primary tier, 48 MiB
#: working set, 1/4 MiB chunks; a second or two per workload.
SMALL_BENCH = [
    "--chunk-mib", "0.25", "--primary-mib", "16", "--working-set-mib", "48",
    "--max-prompt-chunks", "16", "--concurrency", "2",
]  # fmt: skip


def kvtier(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 110,
) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier ARGS`` without a terminal; stdout and stderr captured apart."""
    environment = {**os.environ, **(env or {})}
    environment.pop("FORCE_COLOR", None)
    return subprocess.run(
        [KVTIER, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
