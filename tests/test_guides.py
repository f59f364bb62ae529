"""The guides' sample outputs are what their examples print.

A ```python block of docs/guides/*.md followed by a line "It prints:" and a ```text
block runs as pasted (a fresh process in a fresh directory, nothing injected), and
prints exactly that text. Running every block as pasted, whatever it prints, is
tests/test_docs.py's part; this file holds the guides' words to the program's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
#: A block's text: anything up to its closing fence, never past it.
INSIDE = r"(?:(?!^```).)*"
SAMPLE = re.compile(
    rf"^```python\n(?P<code>{INSIDE})^```\n\nIt prints:\n\n```text\n(?P<output>{INSIDE})^```\n",
    re.DOTALL | re.MULTILINE,
)


def samples() -> list[tuple[str, str, str]]:
    """(page:line, code, output) of every example whose output a guide shows."""
    found = []
    for page in sorted(GUIDES.glob("*.md")):
        text = page.read_text()
        for match in SAMPLE.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match["code"], match["output"]))
    return found


def test_the_guides_show_outputs_to_check():
    pages = {where.split(":")[0] for where, _, _ in samples()}
    assert {"docs/guides/async-host.md", "docs/guides/sync-scheduler.md"} <= pages


@pytest.mark.parametrize(
    ("where", "code", "output"), [pytest.param(*sample, id=sample[0]) for sample in samples()]
)
def test_an_example_prints_what_its_guide_shows(where, code, output, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{where}\n{result.stderr}"
    assert result.stdout == output, f"{where} printed:\n{result.stdout}"
