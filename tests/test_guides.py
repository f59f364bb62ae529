"""The guides' abbreviated `kvtier plan` outputs are what the plan prints.

A guide shows a configuration (a json block), the `kvtier plan ... --config extra.json`
command that reads it, and the lines of its output that matter (a text block marked as
an output sample): each of those lines is one the command prints for that configuration,
in order. Whole outputs shown under the block that prints them ("output of the example
above") are tests/test_docs.py's part.
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


def user_env() -> dict[str, str]:
    """A user's environment, with this checkout's kvtier first on the path."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


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
