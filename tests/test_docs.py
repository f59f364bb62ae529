"""Every code block of README.md and the documentation site (docs/**/*.md) works as
pasted, and every relative link between them resolves.

One test case per block, named by its file and first line. What a block's fence says
decides what is checked:

- ```python runs exactly as written, alone, in a fresh ``python`` process whose working
  directory is a fresh temporary directory, within :data:`LIMIT_S`, with the kvtier under
  test importable and nothing injected. It must exit 0 and leave no region file of its
  own in ``/dev/shm``.
- ```json parses as JSON.
- ```bash, ```console, ```sh and ```shell are shown, not run.

An HTML comment on the line just before a fence changes that:

    <!-- docs-test: syntax (needs vLLM) -->   a python block is only compiled
    <!-- docs-test: skip (output sample) -->  the block is not checked at all
    <!-- docs-test: run -->                   a shell block runs (bash -e) in a fresh
                                              temporary directory with kvtier on PATH

A block skipped as ``(output of the example above)`` or ``(output of the command
above)`` is what the block before it prints: that block's output (a shell block's
stdout and stderr together) must equal it, so that a sample cannot drift from the
program.

``syntax`` and ``skip`` must give their reason in parentheses; a comment that starts
``<!-- docs-test`` and is none of these, or that no fence follows, fails the page.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

import kvtier

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHM_DIR = Path("/dev/shm")
#: How long one block may run, as the conventions promise a reader.
LIMIT_S = 60
#: Blocks that take more than 5 s here ("path:line" of their first code line). Each must
#: still name a python block that runs, so that a stale entry fails.
SLOW: set[str] = set()

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "console", "sh", "shell"}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>[a-z]+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})\s*(?P<info>[^`]*)$")


def pages() -> list[Path]:
    """README.md and every Markdown page of the site, in a stable order."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def name_of(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str
    marker: str | None  # "syntax", "skip", "run" or None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{name_of(self.path)}:{self.line}"


class PageError(ValueError):
    """A page's fences or docs-test markers are malformed."""


def blocks_of(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of one page, with the docs-test marker on the line before each.

    A fence may be indented (inside a list item or an admonition); its code is dedented
    by the fence's indent. A block closes at a fence of at least as many backticks.
    """
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        stripped = lines[i].strip()
        if stripped.startswith("<!--") and "docs-test" in stripped:
            if not MARKER.match(stripped):
                raise PageError(f"{name_of_any(path)}:{i + 1}: malformed marker {stripped!r}")
            if not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                raise PageError(f"{name_of_any(path)}:{i + 1}: no fence follows {stripped!r}")
        if not fence:
            i += 1
            continue
        indent, ticks = len(fence["indent"]), fence["ticks"]
        lang = fence["info"].split()[0].lower() if fence["info"].strip() else ""
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{ticks}`*\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise PageError(f"{name_of_any(path)}:{i + 1}: the fence never closes")
        code = "".join(
            f"{line[indent:] if not line[:indent].strip() else line.lstrip()}\n"
            for line in lines[i + 1 : end]
        )
        marker = reason = None
        if i > 0 and (found := MARKER.match(lines[i - 1].strip())):
            marker, reason = found["kind"], found["reason"]
        blocks.append(Block(path, i + 2, lang, code, marker, reason))
        i = end + 1
    return blocks


def name_of_any(path: Path) -> str:
    try:
        return name_of(path)
    except ValueError:
        return str(path)


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks_of(path)]


def kvtier_root() -> Path:
    """The directory the kvtier under test imports from (a checkout or site-packages)."""
    return Path(kvtier.__file__).resolve().parents[1]


def user_env() -> dict[str, str]:
    """A user's environment with the kvtier under test installed: its directory first on
    PYTHONPATH and this interpreter's scripts (``kvtier``) first on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(kvtier_root()), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def shm_regions() -> set[str]:
    return {p.name for p in SHM_DIR.glob("kvtier_*")} if SHM_DIR.is_dir() else set()


def mapped_by_a_live_process(name: str) -> bool:
    """Whether any process still maps or holds open /dev/shm/NAME (another test's
    region, running beside this one, rather than one a finished block left)."""
    target = str(SHM_DIR / name)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if target in (proc / "maps").read_text():
                return True
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                return True
        except OSError:
            continue
    return False


def run_python(code: str, name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run CODE as a file pasted from the page would run: ``python example.py`` in a
    fresh working directory."""
    script = tmp_path / "example.py"
    script.write_text(code)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )


def shell_commands(block: Block) -> str:
    """The commands of a shell block: a console block's ``$ `` lines, else all of it."""
    if block.lang == "console":
        return "".join(line[2:] + "\n" for line in block.code.splitlines() if line.startswith("$ "))
    return block.code


BLOCKS = all_blocks()
OUTPUT = re.compile(r"^output of the (example|command) above$")


def samples(blocks: list[Block]) -> dict[str, Block]:
    """Block id -> the block after it that shows its output (see the module's doc)."""
    found = {}
    for before, after in itertools.pairwise(blocks):
        if after.marker == "skip" and OUTPUT.match(after.reason or ""):
            runs = (before.lang in PYTHON and before.marker is None) or before.marker == "run"
            assert runs and before.path == after.path, f"{after.id}: no block above it runs"
            found[before.id] = after
    return found


SAMPLES = samples(BLOCKS)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(block, id=block.id, marks=[pytest.mark.slow] if block.id in SLOW else [])
        for block in BLOCKS
    ],
)
def test_the_block_works_as_pasted(block: Block, tmp_path: Path) -> None:
    if block.marker in ("syntax", "skip"):
        assert block.reason and block.reason.strip(), (
            f"{block.id}: a {block.marker} marker needs a reason"
        )
    if block.marker == "skip":
        return
    if block.marker == "syntax":
        assert block.lang in PYTHON, f"{block.id}: a syntax marker is for python blocks"
        compile(block.code, block.id, "exec")
        return
    if block.marker == "run":
        assert block.lang in SHELL, f"{block.id}: a run marker is for shell blocks"
        commands = shell_commands(block)
        assert commands.strip(), f"{block.id}: nothing to run"
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", commands],
            cwd=tmp_path,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=LIMIT_S,
        )
        assert result.returncode == 0, f"{block.id}\n{result.stdout}"
        check_sample(block, result.stdout)
        return
    assert block.marker is None, f"{block.id}: unknown marker {block.marker!r}"
    if block.lang == "json":
        json.loads(block.code)
    elif block.lang in PYTHON:
        compile(block.code, block.id, "exec")  # a SyntaxError names the page and line
        before = shm_regions()
        result = run_python(block.code, block.id, tmp_path)
        assert result.returncode == 0, f"{block.id} exited {result.returncode}\n{result.stderr}"
        left = sorted(name for name in shm_regions() - before if not mapped_by_a_live_process(name))
        for name in left:
            (SHM_DIR / name).unlink(missing_ok=True)
        assert not left, f"{block.id} left {left} in {SHM_DIR}"
        check_sample(block, result.stdout)


def check_sample(block: Block, output: str) -> None:
    """The sample shown under BLOCK, if any, is what it printed."""
    if block.id in SAMPLES:
        sample = SAMPLES[block.id]
        assert output.rstrip() == sample.code.rstrip(), (
            f"{sample.id} is not what {block.id} prints:\n{output}"
        )


def test_the_pages_have_blocks_of_every_kind_checked():
    kinds = {(block.lang, block.marker) for block in BLOCKS}
    assert ("python", None) in kinds
    assert ("json", None) in kinds


def test_every_slow_entry_names_a_python_block_that_runs():
    runs = {block.id for block in BLOCKS if block.lang in PYTHON and block.marker is None}
    assert runs >= SLOW, SLOW - runs


# ----------------------------------------------------------- the block reader itself


def test_a_marker_applies_to_the_fence_right_after_it(tmp_path):
    page = tmp_path / "page.md"
    text = (
        "# x\n\n<!-- docs-test: syntax (needs vLLM) -->\n```python\nimport vllm\n```\n\n"
        '```python\nran = True\n```\n\n- item\n\n    ```json\n    {"a": 1}\n    ```\n'
    )
    first, second, third = blocks_of(page, text)
    assert (first.line, first.marker, first.reason, first.code) == (
        5,
        "syntax",
        "needs vLLM",
        "import vllm\n",
    )
    assert (second.line, second.marker, second.code) == (9, None, "ran = True\n")
    assert (third.lang, third.code) == ("json", '{"a": 1}\n')


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: syn tax (typo) -->\n```python\nx = 1\n```\n",
        "<!-- docs-test: skip (no fence follows) -->\n\ntext\n",
        "```python\nx = 1\n",
    ],
    ids=["malformed", "no-fence", "unclosed"],
)
def test_a_malformed_page_is_an_error_that_names_its_line(tmp_path, text):
    with pytest.raises(PageError, match=r"page\.md:1:"):
        blocks_of(tmp_path / "page.md", text)


def test_a_block_is_compiled_as_a_file_pasted_from_it_would_be():
    with pytest.raises(SyntaxError):
        compile("await something()\n", "page.md:1", "exec")


def test_a_block_that_fails_fails_its_case(tmp_path):
    result = run_python("import sys\nsys.exit(3)\n", "page.md:1", tmp_path)
    assert result.returncode == 3


def test_a_block_runs_alone_in_a_fresh_directory_with_this_kvtier(tmp_path):
    code = "import os, kvtier\nprint(os.listdir('.'), kvtier.__file__, 'given' in dir())\n"
    result = run_python(code, "page.md:1", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", kvtier.__file__, "False"]


def test_a_console_block_runs_its_prompt_lines_only():
    block = Block(
        Path("x.md"), 1, "console", "$ kvtier --help\nusage: kvtier\n$ echo hi\n", "run", None
    )
    assert shell_commands(block) == "kvtier --help\necho hi\n"


# ------------------------------------------------------------------------- links

LINK = re.compile(
    r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)"
)


def anchors_of(path: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs (Python-Markdown's toc) makes them."""
    anchors = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence or not (heading := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        title = re.sub(r"`([^`]*)`", r"\1", heading[1])
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\s-]", "", title.lower()).strip()
        anchors.add(re.sub(r"[\s-]+", "-", slug))
    return anchors


def links_of(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link or image outside code blocks."""
    found = []
    in_fence = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        found.extend((number, m["target"] or m["image"]) for m in LINK.finditer(prose))
    return found


def relative_links() -> list[tuple[Path, int, str]]:
    return [
        (path, line, target)
        for path in pages()
        for line, target in links_of(path)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("//")
    ]


def test_every_relative_link_resolves_to_a_file_and_its_anchor():
    broken = []
    for path, line, target in relative_links():
        file, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file)).resolve() if file else path
        where = f"{name_of(path)}:{line}: {target}"
        if not resolved.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{where} (no heading #{anchor})")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{where} (outside the repository)")
    assert not broken, "\n".join(broken)


def test_the_pages_link_to_each_other():
    assert len(relative_links()) > 10


def test_a_heading_anchor_is_the_one_mkdocs_makes(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# The `fs` tier: files\n\n```python\n# not a heading\n```\n## Back-pressure & limits\n"
    )
    assert anchors_of(page) == {"the-fs-tier-files", "back-pressure-limits"}


# ------------------------------------------- what the pages say, against the code


def text_of_all_pages() -> str:
    return "\n".join(path.read_text() for path in pages())


def table_names(*paths: Path) -> set[str]:
    """Every `name` in the first column of the pages' tables."""
    lines = [line for path in paths for line in path.read_text().splitlines()]
    rows = [line.split("|")[1] for line in lines if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`(\w+)`", cell)}


def vllm_serve_configs() -> list[dict]:
    """The --kv-transfer-config of every `vllm serve` example, as written."""
    found = re.findall(r"--kv-transfer-config '(\{.*?\})'", text_of_all_pages(), re.DOTALL)
    return [json.loads(config) for config in found]


def test_every_key_of_the_vllm_examples_is_in_the_configuration_reference():
    configs = vllm_serve_configs()
    assert configs, "no page shows `vllm serve --kv-transfer-config` any more"
    reference = [DOCS / "reference" / "configuration.md", *sorted((DOCS / "tiers").glob("*.md"))]
    documented = table_names(*[path for path in reference if "|" in path.read_text()])
    for config in configs:
        extra = config["kv_connector_extra_config"]
        used = set(extra) | {key for tier in extra.get("secondary_tiers", []) for key in tier}
        assert used - documented == set()


def python_code() -> list[str]:
    return [block.code for block in BLOCKS if block.lang in PYTHON and block.marker != "skip"]


def test_every_example_that_computes_keys_salts_them_as_prefix_cache_does():
    import inspect

    from kvtier.integrations import transformers

    advice = 'f"{model_name}\\0{kv_dtype}"'
    assert advice in inspect.getsource(transformers.PrefixCache).replace("kv.config.", "")
    lines = [line for code in python_code() for line in code.splitlines()]
    salts = [line for line in lines if line.lstrip().startswith("salt =")]
    assert salts and all("\\0{" in line and "kv_dtype}" in line for line in salts)
    calls = [line for line in lines if "prefix_keys(" in line and "import" not in line]
    assert calls and all("salt=" in line for line in calls), calls


@pytest.mark.slow
def test_the_tier_contract_example_runs_under_pytest_as_written(tmp_path):
    page = DOCS / "tiers" / "writing-a-tier.md"
    [code] = [b.code for b in blocks_of(page) if b.marker is None and "(TierContract)" in b.code]
    module = tmp_path / "test_my_tier.py"
    module.write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The example tier has no damage, stall or capacity hooks: those tests skip.
    assert re.search(r"\b6 passed, 5 skipped\b", result.stdout), result.stdout


def first_two_shell_blocks(path: Path, heading: str) -> list[str]:
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    return re.findall(r"```bash\n(.*?)```", section, re.DOTALL)[:2]


@pytest.mark.parametrize(
    ("page", "headings"),
    [
        ("README.md", ["Set up and run `kvtier bench`; run the tests"]),
        ("docs/getting-started.md", ["Set up and run `kvtier bench`", "Run the tests"]),
    ],
)
def test_the_two_commands_set_up_and_bench_then_test(page, headings):
    path = ROOT / page
    blocks = [block for heading in headings for block in first_two_shell_blocks(path, heading)]
    setup = blocks[0]
    tests = next(block for block in blocks[1:] if "nox -s tests" in block)
    assert "pip install ." in setup and "kvtier bench" in setup
    assert setup.index("pip install torch==") < setup.index("pip install .")
    assert "pip install nox" in tests


def test_extras_are_installed_from_the_checkout_as_the_pages_say():
    text = text_of_all_pages()
    assert "'kvtier[" not in text  # kvtier installs from its checkout, not by name
    extras = set(re.findall(r"pip\s+install\s+[^`\n]*?'\.\[(\w+)\]'", text))
    assert {"bench", "plot", "hf", "docs"} <= extras
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra


def test_the_server_walkthrough_sends_a_prompt_longer_than_a_chunk_twice_before_its_grep():
    """What `grep chunk_hits` shows after the example server's requests: hits, since the
    second request repeats a prompt of whole chunks (the model test sends it, too)."""
    holding = [path for path in pages() if "| grep chunk_hits" in path.read_text()]
    if not holding:
        pytest.skip("no page walks through examples/serve.py's requests yet")
    for path in holding:
        lines = path.read_text().splitlines()
        requests = [i for i, line in enumerate(lines) if line.startswith("curl") and "-d @" in line]
        grep = next(i for i, line in enumerate(lines) if "| grep chunk_hits" in line)
        assert len(requests) >= 2 and lines[requests[0]] == lines[requests[1]]
        assert requests[1] < grep
        body = json.loads((ROOT / lines[requests[0]].split("-d @")[1].split()[0]).read_text())
        # SmolLM2's tokenizer splits at spaces, so every word is a token or more: the
        # prompt holds at least two whole chunks of the server's.
        words = sum(len(message["content"].split()) for message in body["messages"])
        serve = (ROOT / "examples" / "serve.py").read_text()
        chunk_tokens = int(re.search(r"^CHUNK_TOKENS = (\d+)", serve, re.M).group(1))
        assert words >= 2 * chunk_tokens


def configurations() -> list[tuple[str, dict]]:
    """(where, extra_config) of every example that configures kvtier: a JSON block
    holding a vLLM --kv-transfer-config, an extra_config, or one tier's mapping (put
    under a primary tier of 1 GiB), and every `vllm serve` example's
    ``--kv-transfer-config``. Blocks that name a module of the reader's own
    (``my_pkg``) are left out: nothing of that name exists here."""
    found = []
    for block in BLOCKS:
        if block.lang != "json" or block.marker is not None or "my_pkg" in block.code:
            continue
        value = json.loads(block.code)
        if "kv_connector_extra_config" in value:
            found.append((block.id, value["kv_connector_extra_config"]))
        elif "type" in value:
            found.append((block.id, {"cpu_bytes_to_use": 2**30, "secondary_tiers": [value]}))
        elif "cpu_bytes_to_use" in value:
            found.append((block.id, value))
    for n, config in enumerate(vllm_serve_configs()):
        found.append((f"vllm-serve-{n}", config["kv_connector_extra_config"]))
    return found


CONFIGURATIONS = configurations()


def test_the_pages_show_configurations_to_check():
    assert len(CONFIGURATIONS) >= 10


@pytest.mark.parametrize(("where", "extra"), CONFIGURATIONS, ids=[i for i, _ in CONFIGURATIONS])
def test_a_configuration_example_is_one_the_engine_accepts(where, extra):
    """Read as the engine reads it (vLLM's keys as kvtier's adapter translates them),
    every tier's parameters checked, connecting to nothing."""
    from kvtier import OffloadingConfig, OffloadingSpecFactory
    from kvtier.integrations.vllm_config import adapter_extra_config, names_adapter
    from kvtier.specs.factory import with_spec_name

    if names_adapter(extra):
        extra = adapter_extra_config(extra, 16)
    config = OffloadingConfig(
        engine_id="docs-config-check",
        kv_bytes_per_block=131072,
        extra_config=with_spec_name(extra),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    spec.close()
    assert len(spec.settings.tiers) == len(extra.get("secondary_tiers", []))


def test_the_readme_is_a_door_to_every_guide():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 150
    linked = {target.partition("#")[0] for _, target in links_of(readme)}
    guides = {f"docs/guides/{path.name}" for path in (DOCS / "guides").glob("*.md")}
    assert guides and guides <= linked, guides - linked
    assert "docs/getting-started.md" in linked and "docs/benchmarks/index.md" in linked
