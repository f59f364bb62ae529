"""LMCache's storage adapters beside kvtier's fs tier (benchmarks/vs_lmcache.py).

Everything here needs LMCache 0.5.6 (``nox -s lmcache``); without it the whole directory
is skipped.
"""

from __future__ import annotations

import os

import pytest

# Before LMCache loads: it reports usage to its developers' server unless told not to.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

# The module, not the name alone: a directory called lmcache on sys.path would do for that.
pytest.importorskip("lmcache.v1.distributed.l2_adapters")
