"""The README's Python examples run, so that they cannot rot.

Every fenced block opened with ```python in README.md runs, in the order of the file,
in one namespace: a block may use what an earlier one defined (the synchronous
scheduler's example reuses the async host's ``config``). A block that cannot run here
(it needs vLLM, a GPU, a real bucket) opts out with an HTML comment on the line just
before its fence, saying why::

    <!-- not run: needs vLLM -->
    ```python

What an example takes as given (the host's prompt and GPU blocks) is defined in
:func:`given`; an example that names something new adds it
there. The examples' production-sized values are swapped for small ones by
:data:`SUBSTITUTIONS`, each of which must still occur in the README, so that a changed
example fails here rather than running with its production sizes.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier import make_offload_key

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!--\s*not run:.+-->\s*$")

#: Text of the examples -> what it becomes here: {engine_id}, {root} are filled in.
SUBSTITUTIONS = {
    '"engine-0"': '"{engine_id}"',  # one region name per test run: /dev/shm is shared
    "num_layers=30": "num_layers=2",  # 48 KiB blocks instead of 720 KiB
    "cpu_tokens=200_000": "cpu_tokens=512",  # a primary tier of 8 chunks
    "num_blocks=4096": "num_blocks=64",
    '"/mnt/nvme/kvcache"': '"{root}"',
}


def python_blocks() -> list[tuple[int, str]]:
    """(first line, code) of each ```python block of the README that is not opted out."""
    lines = README.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        if not (i > 0 and SKIP.search(lines[i - 1])):
            blocks.append((start + 1, "".join(f"{line}\n" for line in lines[start:end])))
        i = end + 1
    return blocks


def given(root: Path) -> dict[str, Any]:
    """The names the examples take as given, as a host would have them."""
    return {
        # A prompt of three full 64-token chunks and a few tokens more.
        "prompt_ids": [(7 * i) % 49_000 for i in range(200)],
        # The request's GPU blocks: 4 blocks of 16 tokens per 64-token chunk.
        "gpu_block_ids": list(range(16, 32)),
        # The synchronous scheduler's request: a chunk the async host did not store.
        "key": make_offload_key(bytes([9]) * 32),
    }


def run_block(code: str, name: str, namespace: dict[str, Any]) -> None:
    compiled = compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)  # a block with top-level await gives a coroutine
    if inspect.iscoroutine(result):
        asyncio.run(result)


def test_the_readme_has_examples_to_run():
    assert len(python_blocks()) >= 2


def test_every_substitution_still_matches_an_example():
    code = "\n".join(block for _, block in python_blocks())
    for original in SUBSTITUTIONS:
        assert original in code, f"no README example holds {original} any more"


def test_the_readme_examples_run_as_written(tmp_path, engine_id):
    root = tmp_path / "kvcache"
    namespace = given(root)
    for line, code in python_blocks():
        for original, replacement in SUBSTITUTIONS.items():
            code = code.replace(original, replacement.format(engine_id=engine_id, root=root))
        run_block(code, f"README.md:{line}", namespace)
    # The async host's chunks and the scheduler's one all cascaded to the fs tier.
    assert len(namespace["keys"]) == 3
    assert len(list(root.rglob("*.kvt"))) == len(namespace["keys"]) + 1
    # The chunk format section's reader finds each of them sound, the scheduler's among them.
    found = dict(namespace["read_chunks"](root))
    assert len(found) == len(namespace["keys"]) + 1
    assert namespace["key"] in found


@pytest.mark.slow
def test_the_tier_contract_example_runs_under_pytest_as_written(tmp_path):
    [code] = [code for _, code in python_blocks() if "TierContract" in code]
    module = tmp_path / "test_my_tier.py"
    module.write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The example tier has no damage, stall or capacity hooks: those tests skip.
    assert re.search(r"\b5 passed, 5 skipped\b", result.stdout), result.stdout


def test_an_opted_out_block_is_not_run(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n<!-- not run: needs vLLM -->\n```python\nraise SystemExit\n```\n\n"
        "```python\nran = True\n```\n"
    )
    monkeypatch.setitem(globals(), "README", readme)
    [(line, code)] = python_blocks()
    assert (line, code) == (9, "ran = True\n")
