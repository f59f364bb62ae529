"""How the nox sessions install torch, and what Getting started tells a user about it.

The test environment need not have nox, so noxfile.py's constants and plain functions
are run on their own: every top-level statement that does not name ``nox`` (the
sessions, the options and the import are left out).
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOXFILE = ROOT / "noxfile.py"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def names_nox(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "nox" for n in ast.walk(node)) or (
        isinstance(node, ast.Import) and any(alias.name == "nox" for alias in node.names)
    )


@pytest.fixture(scope="module")
def noxfile() -> dict[str, Any]:
    tree = ast.parse(NOXFILE.read_text())
    plain = ast.Module([node for node in tree.body if not names_nox(node)], type_ignores=[])
    namespace: dict[str, Any] = {}
    exec(compile(plain, str(NOXFILE), "exec"), namespace)
    return namespace


def test_without_the_variables_the_sessions_install_the_pinned_torch_as_before(noxfile):
    assert noxfile["torch_install_args"]({}) == ["torch==2.13.0"]


def test_an_index_url_makes_the_sessions_take_torch_from_that_index(noxfile):
    args = noxfile["torch_install_args"]({"KVTIER_TORCH_INDEX_URL": CPU_INDEX})
    assert args == ["torch==2.13.0", "--index-url", CPU_INDEX]
    assert noxfile["TORCH_CPU_INDEX"] == CPU_INDEX


def test_kvtier_torch_replaces_the_requirement(noxfile):
    args = noxfile["torch_install_args"](
        {"KVTIER_TORCH": "torch==2.13.0+cpu", "KVTIER_TORCH_INDEX_URL": CPU_INDEX}
    )
    assert args == ["torch==2.13.0+cpu", "--index-url", CPU_INDEX]


def test_every_session_that_installs_torch_installs_it_through_the_variables():
    tree = ast.parse(NOXFILE.read_text())
    sessions = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.decorator_list
    ]
    [engines] = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "install_without_requirements"
    ]
    assert "torch_install_args(os.environ)" in ast.unparse(engines)
    through = ("torch_install_args", "install_without_requirements")
    torch_sessions = [s.name for s in sessions if any(n in ast.unparse(s) for n in through)]
    assert torch_sessions == ["tests", "model", "typecheck", "docs", "vllm", "sglang", "lmcache"]
    for session in [*sessions, engines]:
        assert "TORCH_CPU" not in ast.unparse(session), session.name


def bash_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [line for block in blocks for line in block.splitlines()]


def test_getting_started_tells_a_user_elsewhere_how_to_get_the_cpu_build(noxfile):
    lines = bash_lines(GETTING_STARTED.read_text())
    pip = [line for line in lines if line.startswith("pip install torch==")]
    # As written for the project's machines first, then with PyTorch's CPU index.
    assert pip[0].split("#")[0].split() == ["pip", "install", noxfile["TORCH_CPU"]]
    assert any(f"--index-url {CPU_INDEX}" in line for line in pip)
    [nox_line] = [line for line in lines if "nox -s tests" in line and "=" in line]
    words = shlex.split(nox_line)
    environ = dict(word.split("=", 1) for word in words[: words.index("nox")])
    assert noxfile["torch_install_args"](environ) == [
        noxfile["TORCH_CPU"],
        "--index-url",
        CPU_INDEX,
    ]
