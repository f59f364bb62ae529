"""The executable contract of a secondary tier: one pytest suite every tier runs.

Every tier must hold the same promises: bytes come back exactly as stored or not at
all, a damaged chunk is a counted miss that does not come back, a job that outlives
its time-out never writes into (or reads from) a slot that another chunk took
meanwhile, closing is idempotent, stores are reported as events. :class:`TierContract`
checks them through the public :class:`~kvtier.KVTier` facade, with CPU tensors
standing in for the GPU, so the framework (job runner, time-outs, slot bookkeeping)
is in the loop exactly as in production.

A tier author subclasses it in a test module and provides hooks; the subclass
inherits the tests (this module needs ``pytest``; ``import kvtier`` never imports it)::

    from kvtier.testing import TierContract

    class TestMyTierContract(TierContract):
        async def tier_config(self):
            return {"type": "MyTier", "module_path": "my_pkg.tiers", "endpoint": "..."}

Hooks, all optional but :meth:`~TierContract.tier_config`; a test whose hook a tier
does not provide is skipped, saying which hook (a hook a tier cannot support says why
with ``pytest.skip(reason)``):

- :meth:`~TierContract.tier_config`: the tier's mapping for ``secondary_tiers``.
- :meth:`~TierContract.reader_tier_config`: a second node that reads what the first
  stored (an fs tier on the same ``root_dir``, an s3 tier on the same bucket, a p2p
  node whose ``peers`` list the first); None (the default) reads back through the
  writing node itself, its primary tier emptied first.
- :meth:`~TierContract.corrupt` / :meth:`~TierContract.truncate`: damage a stored
  chunk as a disk or a server would.
- :meth:`~TierContract.stored_chunk`: the bytes stored under a key, read past the
  tier's own verification.
- :meth:`~TierContract.stall_loads` / :meth:`~TierContract.stall_stores`: hold the
  tier's next load / store in its real I/O until the context exits, reporting through
  a :class:`Stall` where it is.
- :meth:`~TierContract.capacity_config`: parameters that bound the tier to a number
  of chunks.

Hooks may put what they open (a server, a proxy) on :attr:`TierContract.resources`,
closed after the test's nodes.
"""

from kvtier.testing._contract import TierContract
from kvtier.testing._metrics import LATE_COMPLETIONS, QUARANTINED_SLOTS, metric_value
from kvtier.testing._stall import Stall

__all__ = ["LATE_COMPLETIONS", "QUARANTINED_SLOTS", "Stall", "TierContract", "metric_value"]
