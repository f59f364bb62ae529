"""vLLM's real scheduler and connectors driving kvtier, on CPU tensors.

Everything here needs vLLM (``nox -s vllm``); without it the whole directory is
skipped. :class:`Engine` runs vLLM's ``Scheduler`` (whose ``OffloadingConnector`` holds
the scheduler-side spec) and plays vLLM's executor for its worker ranks: one
:class:`~vllm_procs.ModelRunner` in this process, or with ``world_size`` > 1 one per
rank in processes of their own, their outputs aggregated as vLLM's executor does. Each
rank writes every computed token's KV as bytes derived from its whole prefix, its
KV-cache group and the rank, so any block that holds other bytes is caught. With
``sliding_window`` the model is hybrid: a full-attention group and a sliding-window
group whose layers overlay the first group's tensors, as vLLM's hybrid allocator
places them. ``shape`` says how the ranks' bytes relate (:mod:`vllm_procs`): their
own, the model's heads split among them, or an MLA model's latent that all hold alike.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The module, not the name alone: a directory called vllm on sys.path would do for that.
pytest.importorskip("vllm.v1.kv_offload.base")

import torch
import vllm_procs
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm_offline import (
    ModelConfig,
    OffloadingConnector,
    Request,
    SamplingParams,
    block_hasher,
    end_step_without_copies,
    engine_config,
    scheduler,
)
from vllm_offline import model_config as offline_model_config
from vllm_procs import TOKENS_PER_BLOCK, ModelRunner, RemoteRunner

# One intra-op thread: the KV written per token is tiny, and torch's spinning worker
# threads would take the small test machine's cores from kvtier's tier threads.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def model_config() -> ModelConfig:
    # vLLM inspects the architecture in a subprocess once per cache root; nox points
    # VLLM_CACHE_ROOT at a fresh directory, so this is slow only once per session.
    assert os.environ.get("HF_HUB_OFFLINE") == "1", "run through nox -s vllm (offline)"
    return offline_model_config()


class Engine:
    """vLLM's scheduler plus its worker ranks, stepped by hand like vLLM's engine core."""

    def __init__(
        self,
        model_config: ModelConfig,
        extra_config: dict[str, Any],
        *,
        events: bool = False,
        num_blocks: int = 64,
        max_num_batched_tokens: int = 2048,
        sliding_window: int | None = None,
        copies: bool = True,
        workers: list[RemoteRunner] | None = None,
        shape: str = "salted",
        world_size: int | None = None,
    ) -> None:
        self.tokens_per_block = TOKENS_PER_BLOCK
        self.engine_id = f"test-vllm-{uuid.uuid4().hex[:10]}"
        self.config = engine_config(
            model_config,
            extra_config,
            engine_id=self.engine_id,
            block_size=TOKENS_PER_BLOCK,
            num_blocks=num_blocks,
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            events=events,
        )
        # Tensor-parallel ranks, as vLLM's engine core sees them: the scheduler side
        # (rank 0's config) waits for world_size workers to report each job.
        # Without copies, the scheduler side alone may stand for world_size ranks.
        assert world_size is None or not copies, "ranks that copy are worker processes"
        world_size = len(workers) if workers else world_size or 1
        self.world_size = world_size
        self.config.parallel_config.tensor_parallel_size = world_size
        self.config.parallel_config.world_size = world_size
        # vLLM's multiprocessing executor, on one node, and the KV layout its
        # FlashAttention backend resolves: what its canonical and replicated layouts ask.
        self.config.parallel_config.distributed_executor_backend = "mp"
        self.config.cache_config.kv_cache_layout = "LBNHC"
        if shape == "mamba":  # the mode in which vLLM caches Mamba states by prefix
            self.config.cache_config.mamba_cache_mode = "align"
        self.runners: list[ModelRunner] = []
        self.remotes: list[RemoteRunner] = []
        if workers is None:
            self.runners.append(
                ModelRunner(self.config, num_blocks, sliding_window, copies=copies, shape=shape)
            )
            self.kv_cache_config = self.runners[0].kv_cache_config
        else:
            assert copies, "worker processes always copy"
            self.kv_cache_config, _ = vllm_procs.kv_cache_config(
                num_blocks, sliding_window, shape, world_size
            )
            for rank, remote in enumerate(workers):
                remote.send("open", (self.config, num_blocks, sliding_window, rank, shape))
                self.remotes.append(remote)
            for remote in self.remotes:
                assert remote.receive("open") == "opened"
        self.aggregator = KVOutputAggregator(world_size)
        self.hasher = block_hasher(TOKENS_PER_BLOCK)
        self.scheduler = scheduler(self.config, self.kv_cache_config)
        self.published: list[Any] = []
        if self.scheduler.kv_event_publisher is not None:
            self.scheduler.kv_event_publisher.publish = self.published.append  # type: ignore[method-assign]
        self.tokens: dict[str, list[int]] = {}
        #: Tokens each request found computed (GPU prefix cache plus kvtier) when it
        #: was first scheduled, all verified byte for byte on every rank.
        self.cached_at_start: dict[str, int] = {}
        self.preempted: set[str] = set()
        #: The offloading stats payloads the scheduler sent with its outputs.
        self.connector_stats: list[dict[str, Any]] = []
        self.finished: set[str] = set()
        self.closed = False

    @property
    def worker(self) -> Any:
        """The worker connector of the rank in this process (None without copies)."""
        return self.runners[0].worker if self.runners else None

    @property
    def connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def manager(self) -> Any:
        return self.connector.connector_scheduler.manager  # type: ignore[union-attr]

    def add(
        self,
        req_id: str,
        tokens: list[int],
        max_tokens: int = 2,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request; ``kv_transfer_params`` reach the connectors as a client's
        would (through the sampling parameters' extra arguments)."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, extra_args=extra
            ),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(request)

    def step(self) -> Any:
        return self.finish_step(self.scheduler.schedule())

    def finish_step(self, out: Any) -> Any:
        """The workers' half of a step that ``scheduler.schedule()`` began."""
        self.preempted |= set(out.preempted_req_ids or ())
        sampled: dict[str, list[int]] = {}
        tokens = {req_id: self.tokens[req_id] for req_id in out.num_scheduled_tokens}
        for req_id, count in out.num_scheduled_tokens.items():
            if _computed(req_id, out) + count >= len(self.tokens[req_id]):
                token = 3 + (len(self.tokens[req_id]) * 7919 + hash(req_id)) % 1000
                sampled[req_id] = [token]
        for remote in self.remotes:
            remote.send("step", (out, tokens, sampled))
        results = [runner.step(out, tokens, sampled) for runner in self.runners]
        results += [remote.receive("step") for remote in self.remotes]
        for _, first in results:
            self.cached_at_start.update(first)
        outputs = [output for output, _ in results]
        if outputs[0] is None:
            output = end_step_without_copies(out, sampled, self.world_size)
        else:
            # Only once every rank reported a job does vLLM count it done.
            output = self.aggregator.aggregate(outputs)
        engine_outputs = self.scheduler.update_from_output(out, output)
        for outputs_of_client in engine_outputs.values():
            stats = outputs_of_client.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for request_output in outputs_of_client.outputs:
                self.tokens[request_output.request_id].extend(request_output.new_token_ids)
                if request_output.finished:
                    self.finished.add(request_output.request_id)
        return out

    def published_events(self) -> list[Any]:
        """Every KV-cache event vLLM published, in order."""
        return [event for batch in self.published for event in batch.events]

    @property
    def verified_blocks(self) -> int:
        """Blocks checked byte for byte by the rank in this process."""
        return sum(runner.verified_blocks for runner in self.runners)

    def run(self, *, max_steps: int = 200, idle_steps: int = 3) -> None:
        """Step until no request is left, then a few more so stores and cascades land."""
        steps = 0
        while self.scheduler.has_requests() or self._busy():
            self.step()
            steps += 1
            # Copies (on the worker's copy threads) or kvtier's tiers (lookups,
            # promotions, cascades) are at work: give them the CPU for a moment instead
            # of spinning through empty steps.
            jobs = self.connector.connector_scheduler._jobs  # type: ignore[union-attr]
            if jobs and self.worker is not None:
                self.worker.connector_worker.worker.kvtier.wait(set(jobs), 0.02)
            if not hasattr(self.manager, "kvtier"):
                # vLLM's own managers: their lookup and tier threads need the time, and
                # a finished request waits on them without the manager being busy.
                time.sleep(0.01)
            elif self.manager.has_pending_work():
                self.manager.kvtier.host.wait_for_completions_blocking(0.02)
            assert steps < max_steps, (
                "the engine did not settle: requests "
                f"{self.scheduler.has_requests()}, connector jobs "
                f"{self.connector.connector_scheduler._jobs}, kvtier busy "  # type: ignore[union-attr]
                f"{self.manager.has_pending_work()}, finished {self.finished}"
            )
        for _ in range(idle_steps):
            self.step()

    def _busy(self) -> bool:
        connector_scheduler = self.connector.connector_scheduler
        assert connector_scheduler is not None
        return bool(connector_scheduler._jobs) or self.manager.has_pending_work()

    def drain_tiers(self) -> None:
        """Wait until the cascades to secondary tiers are done (kvtier's, or those of
        vLLM's own tiering manager)."""
        kvtier_manager = getattr(self.manager, "kvtier", None)
        for _ in range(1000):
            self.step()
            if not self.manager.has_pending_work():
                return
            if kvtier_manager is not None:
                kvtier_manager.host.wait_for_completions_blocking(0.05)
            else:
                time.sleep(0.02)
        raise AssertionError("the tiers did not settle")

    def wipe_gpu(self) -> None:
        """Empty vLLM's GPU prefix cache and zero the KV tensors, so only loads refill them."""
        assert self.scheduler.reset_prefix_cache()
        for runner in self.runners:
            runner.wipe()
        for remote in self.remotes:
            remote.send("wipe")
        for remote in self.remotes:
            assert remote.receive("wipe") == "wiped"

    def close(self) -> None:
        """Close the workers and the scheduler; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        for runner in self.runners:
            runner.close()
        for remote in self.remotes:
            remote.send("close")
        for remote in self.remotes:
            assert remote.receive("close") == "closed"
        self.scheduler.shutdown()


@pytest.fixture(scope="module")
def worker_processes(model_config: ModelConfig) -> Iterator[list[RemoteRunner]]:
    """Two worker processes (tensor-parallel ranks 0 and 1), shared by a module's
    engines: each process imports vLLM once."""
    ctx = multiprocessing.get_context("spawn")
    remotes = []
    for rank in range(2):
        conn, child = ctx.Pipe()
        process = ctx.Process(target=vllm_procs.worker, args=(child,), name=f"vllm-rank-{rank}")
        process.start()
        remotes.append(RemoteRunner(conn, process))
    yield remotes
    for remote in remotes:
        remote.send("exit")
    for remote in remotes:
        assert remote.receive("exit") == "exited"
        remote.process.join(vllm_procs.TIMEOUT_S)
        assert remote.process.exitcode == 0


@pytest.fixture(scope="session")
def vllm_tiering() -> dict[str, Any]:
    """The extra_config keys naming vLLM's own TieringOffloadingSpec, as a reference.

    vLLM's fs tier decides at import whether it runs its C extension; the extension is
    made importable first, as ``benchmarks/vs_vllm.py`` does, so that it takes the same
    I/O path whichever test imports it first.
    """
    import vs_vllm

    vs_vllm.load_fs_io_extension()
    return {"spec_name": "TieringOffloadingSpec"}


@pytest.fixture(scope="session")
def mla_model_config() -> ModelConfig:
    return offline_model_config(mla=True)


@pytest.fixture
def make_engine(model_config: ModelConfig, request: pytest.FixtureRequest) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(extra_config: dict[str, Any], **kwargs: Any) -> Engine:
        model = model_config
        if kwargs.get("shape") == "mla":
            model = request.getfixturevalue("mla_model_config")
        engine = Engine(model, extra_config, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
        leftovers = list(Path("/dev/shm").glob(f"kvtier_{engine.engine_id}*"))
        assert not leftovers, f"the engine left {leftovers} behind"


def _computed(req_id: str, out: Any) -> int:
    for new in out.scheduled_new_reqs:
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = out.scheduled_cached_reqs
    return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])
