"""The guides' sample outputs are what their examples print.

A ```python block of docs/guides/*.md followed by a line "It prints:" and a ```text
block runs as pasted (a fresh process in a fresh directory, nothing injected), and
prints exactly that text; a `kvtier plan` output shown after its configuration and
command holds lines the command prints for it, in order. Running every block as pasted,
whatever it prints, is tests/test_docs.py's part; this file holds the guides' words to
the program's output.
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


def user_env() -> dict[str, str]:
    """A user's environment, with this checkout's kvtier first on the path."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


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
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{where}\n{result.stderr}"
    assert result.stdout == output, f"{where} printed:\n{result.stdout}"


# --------------------------------------------------------------- kvtier plan's samples

#: A `kvtier plan` sample: the configuration (a json block), the command that reads it
#: (in the prose or a bash block after it) and its output (a text block marked as a
#: sample), in that order on the page.
PLAN_SAMPLE = re.compile(
    rf"^```json\n(?P<config>{INSIDE})^```\n"
    rf"(?:(?!^```json).)*?(?P<command>kvtier plan [^`\n]*--config extra\.json)"
    rf"(?:(?!^```json).)*?<!-- docs-test: skip \(output sample[^\n]*-->\n"
    rf"```text\n(?P<output>{INSIDE})^```\n",
    re.DOTALL | re.MULTILINE,
)


def plan_samples() -> list[tuple[str, str, str, str]]:
    """(page:line, config, command, output) of every `kvtier plan` output a guide shows."""
    found = []
    for page in sorted(GUIDES.glob("*.md")):
        text = page.read_text()
        for match in PLAN_SAMPLE.finditer(text):
            line = text.count("\n", 0, match.start("output")) + 1
            where = f"{page.relative_to(ROOT)}:{line}"
            found.append((where, match["config"], match["command"], match["output"]))
    return found


def test_the_vllm_guide_shows_plan_outputs_to_check():
    assert len([s for s in plan_samples() if s[0].startswith("docs/guides/vllm.md")]) == 2


@pytest.mark.parametrize(
    ("where", "config", "command", "output"),
    [pytest.param(*sample, id=sample[0]) for sample in plan_samples()],
)
def test_a_plan_sample_is_what_kvtier_plan_prints(where, config, command, output, tmp_path):
    """Every line of the sample (abbreviated: some lines, in order) is a line the
    command prints for the configuration shown before it."""
    (tmp_path / "extra.json").write_text(config)
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", *command.split()[1:]],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{where}\n{result.stderr}"
    printed = iter(result.stdout.splitlines())
    for line in output.splitlines():
        assert any(shown == line for shown in printed), (
            f"{where}: {line!r} not printed in order\n{result.stdout}"
        )
