"""The README's Python examples run, so that they cannot rot.

Every fenced block opened with ```python in README.md runs, in the order of the file,
in one namespace: a block may use what an earlier one defined (the synchronous
scheduler's example reuses the async host's ``config``). Each is compiled as a file
pasted from it would be: an ``await`` outside a coroutine is a SyntaxError here too. A
block that cannot run here (it needs vLLM, a GPU, a real bucket) opts out with an HTML
comment on the line just before its fence, saying why::

    <!-- not run: needs vLLM -->
    ```python

What an example takes as given (the host's prompt and GPU blocks) is defined in
:func:`given`; an example that names something new adds it
there. The examples' production-sized values are swapped for small ones by
:data:`SUBSTITUTIONS`, each of which must still occur in the README, so that a changed
example fails here rather than running with its production sizes.
"""

from __future__ import annotations

import inspect
import json
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
    exec(compile(code, name, "exec"), namespace)


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
    # The async host's chunks and the scheduler's one all cascaded to the fs tier; the
    # keys section's keys, salted as it advises, are the ones the async host stored.
    keys = namespace["keys"]
    assert len(keys) == 3 and namespace["hits"] == 0
    assert len(list(root.rglob("*.kvt"))) == len(keys) + 1
    # The chunk format section's reader finds each of them sound, the scheduler's among them.
    found = dict(namespace["read_chunks"](root))
    assert set(found) == {*keys, namespace["key"]}


def test_the_readme_salts_keys_one_way_the_way_prefix_cache_does():
    from kvtier.integrations import transformers

    text = README.read_text()
    advice = 'f"{model_name}\\0{kv_dtype}"'
    assert advice in inspect.getsource(transformers.PrefixCache).replace("kv.config.", "")
    # The keys section and the server's checklist give the same salt, in those words.
    assert text.count(f"`{advice}`") == 2
    # Every example that computes keys salts them so.
    calls = [line for _, block in python_blocks() for line in block.splitlines()]
    salts = [line for line in calls if line.lstrip().startswith("salt =")]
    assert salts and all("\\0{" in line and "kv_dtype}" in line for line in salts)
    assert all("salt=salt" in line for line in calls if "prefix_keys(prompt" in line)


def test_a_block_is_compiled_as_a_file_pasted_from_it_would_be():
    with pytest.raises(SyntaxError):
        run_block("await something()\n", "README.md:1", {})


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
    assert re.search(r"\b6 passed, 5 skipped\b", result.stdout), result.stdout


def test_an_opted_out_block_is_not_run(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n<!-- not run: needs vLLM -->\n```python\nraise SystemExit\n```\n\n"
        "```python\nran = True\n```\n"
    )
    monkeypatch.setitem(globals(), "README", readme)
    [(line, code)] = python_blocks()
    assert (line, code) == (9, "ran = True\n")


def readme_section(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_every_key_of_the_vllm_example_is_in_the_configuration_reference():
    transfer = re.search(r"--kv-transfer-config '(\{.*?\})'", README.read_text(), re.DOTALL)
    assert transfer, "the README's vllm serve example is gone"
    extra = json.loads(transfer.group(1))["kv_connector_extra_config"]
    used = set(extra) | {key for tier in extra["secondary_tiers"] for key in tier}
    rows = [
        line.split("|")[1]
        for line in readme_section("Configuration reference").splitlines()
        if line.startswith("| `")
    ]
    documented = {name for cell in rows for name in re.findall(r"`(\w+)`", cell)}
    assert used - documented == set()


def test_the_server_example_sends_a_prompt_longer_than_a_chunk_twice_before_its_grep():
    """What `grep chunk_hits` shows after the server's example requests: hits, since the
    second request repeats a prompt of whole chunks (the model test sends it, too)."""
    root = README.parent
    lines = readme_section("Embedding kvtier in an async server").splitlines()
    requests = [i for i, line in enumerate(lines) if line.startswith("curl") and "-d @" in line]
    grep = next(i for i, line in enumerate(lines) if "| grep chunk_hits" in line)
    assert len(requests) == 2 and lines[requests[0]] == lines[requests[1]]
    assert requests[1] < grep
    request = lines[requests[0]]
    body = json.loads((root / request.split("-d @")[1].split()[0]).read_text())
    # SmolLM2's tokenizer splits at spaces, so every word is a token or more: the prompt
    # holds at least two whole chunks of the server's, whatever the chat template adds.
    words = sum(len(message["content"].split()) for message in body["messages"])
    chunk_tokens = int(
        re.search(r"^CHUNK_TOKENS = (\d+)", (root / "examples/serve.py").read_text(), re.M).group(1)
    )
    assert words >= 2 * chunk_tokens


def test_the_first_section_says_what_its_two_blocks_do():
    first = readme_section("Set up and run the main job; run the tests")
    blocks = re.findall(r"```bash\n(.*?)```", first, re.DOTALL)
    assert "kvtier bench" in blocks[0] and "pip install ." in blocks[0]
    assert "nox -s tests" in blocks[1]


def test_extras_are_installed_from_the_checkout_as_the_readme_says():
    text = README.read_text()
    assert "'kvtier[" not in text  # kvtier installs from its checkout, not by name
    extras = re.findall(r"pip\s+install\s+[^`]*?'\.\[(\w+)\]'", text)
    assert {"bench", "plot", "hf"} <= set(extras)
    pyproject = (README.parent / "pyproject.toml").read_text()
    for extra in set(extras):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
