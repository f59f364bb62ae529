"""vLLM's real scheduler and connectors driving kvtier, on CPU tensors.

Everything here needs vLLM (``nox -s vllm``); without it the whole directory is
skipped. :class:`Engine` plays the model runner: it runs vLLM's ``Scheduler`` (whose
``OffloadingConnector`` holds the scheduler-side spec) and a worker-role
``OffloadingConnector`` over CPU KV tensors, writing each computed token's KV as bytes
derived from its whole prefix and its KV-cache group, so any block that holds other
bytes (another prefix's, another group's) is caught. With ``sliding_window`` the model
is hybrid: a full-attention group and a sliding-window group whose layers overlay the
first group's tensors, as vLLM's hybrid allocator places them.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The module, not the name alone: a directory called vllm on sys.path would do for that.
pytest.importorskip("vllm.v1.kv_offload.base")

import torch
from vllm_offline import (
    FullAttentionSpec,
    ModelConfig,
    OffloadingConnector,
    Request,
    SamplingParams,
    SlidingWindowSpec,
    begin_step,
    block_hasher,
    end_step,
    end_step_without_copies,
    engine_config,
    one_group_kv_cache,
    overlaid_kv_cache,
    scheduler,
    worker_connector,
)
from vllm_offline import model_config as offline_model_config

# One intra-op thread: the KV written per token is tiny, and torch's spinning worker
# threads would take the small test machine's cores from kvtier's tier threads.
torch.set_num_threads(1)

TOKENS_PER_BLOCK = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
#: A hybrid model's sliding-window layers (group 1), beside LAYERS (group 0).
WINDOW_LAYERS = ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")


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


def token_kv(tokens: list[int], position: int, group: int = 0, rank: int = 0) -> torch.Tensor:
    """The KV of the token at ``position`` in a layer of KV-cache group ``group`` on
    worker ``rank``: bytes that depend on every token up to it, the group and the rank."""
    salt = f"{group}/{rank}:" if group or rank else ""
    digest = hashlib.blake2b((salt + repr(tokens[: position + 1])).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "big") & ((1 << 63) - 1))
    return torch.randn((2, NUM_KV_HEADS, HEAD_SIZE), generator=gen).to(torch.float16)


class Engine:
    """vLLM's scheduler plus a worker connector, stepped by hand like a model runner."""

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
    ) -> None:
        self.tokens_per_block = TOKENS_PER_BLOCK
        self.sliding_window = sliding_window
        #: False: no worker; every transfer job completes at once and no byte is
        #: checked (the scheduler side of a spec whose worker needs a GPU).
        self.copies = copies
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
        attention = FullAttentionSpec(
            block_size=TOKENS_PER_BLOCK,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        # (num_blocks, K/V, tokens, heads, head size): the first dimension is the block.
        shape = (num_blocks, 2, TOKENS_PER_BLOCK, NUM_KV_HEADS, HEAD_SIZE)
        if sliding_window is None:
            self.groups: tuple[tuple[str, ...], ...] = (LAYERS,)
            self.kv_cache_config = one_group_kv_cache(num_blocks, LAYERS, attention)
            self.caches = {name: torch.zeros(shape, dtype=torch.float16) for name in LAYERS}
        else:
            window = SlidingWindowSpec(
                block_size=TOKENS_PER_BLOCK,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float16,
                sliding_window=sliding_window,
            )
            self.groups = (LAYERS, WINDOW_LAYERS)
            self.kv_cache_config = overlaid_kv_cache(
                num_blocks, [(LAYERS, attention), (WINDOW_LAYERS, window)]
            )
            # Layer i of each group is the same tensor: the groups overlay each other.
            shared = [torch.zeros(shape, dtype=torch.float16) for _ in LAYERS]
            self.caches = {
                name: shared[i] for layers in self.groups for i, name in enumerate(layers)
            }
        self.hasher = block_hasher(TOKENS_PER_BLOCK)
        self.scheduler = scheduler(self.config, self.kv_cache_config)
        self.published: list[Any] = []
        if self.scheduler.kv_event_publisher is not None:
            self.scheduler.kv_event_publisher.publish = self.published.append  # type: ignore[method-assign]
        self.worker = (
            worker_connector(self.config, self.kv_cache_config, self.caches) if copies else None
        )
        self.tokens: dict[str, list[int]] = {}
        #: Each request's GPU blocks, one list per KV-cache group (0: vLLM's null block).
        self.blocks: dict[str, list[list[int]]] = {}
        #: Tokens each request found computed (GPU prefix cache plus kvtier) when it
        #: was first scheduled, all verified byte for byte.
        self.cached_at_start: dict[str, int] = {}
        self.preempted: set[str] = set()
        #: The offloading stats payloads the scheduler sent with its outputs.
        self.connector_stats: list[dict[str, Any]] = []
        self.finished: set[str] = set()
        self.verified_blocks = 0

    @property
    def connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def manager(self) -> Any:
        return self.connector.connector_scheduler.manager  # type: ignore[union-attr]

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(request)

    def step(self) -> Any:
        return self.finish_step(self.scheduler.schedule())

    def finish_step(self, out: Any) -> Any:
        """The model runner's half of a step that ``scheduler.schedule()`` began."""
        if self.worker is not None:
            begin_step(self.worker, out)
        self.preempted |= set(out.preempted_req_ids or ())
        sampled: dict[str, list[int]] = {}
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self._first_scheduled(new.req_id, new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = (
                    [list(ids) for ids in new_ids] if new_ids else [[] for _ in self.groups]
                )
                self._first_scheduled(req_id, cached.num_computed_tokens[i])
            elif new_ids:
                for blocks, ids in zip(self.blocks[req_id], new_ids, strict=True):
                    blocks.extend(ids)
        for req_id, count in out.num_scheduled_tokens.items():
            start = self._computed(req_id, out)
            self._compute(req_id, start, start + count)
            if start + count >= len(self.tokens[req_id]):
                token = 3 + (len(self.tokens[req_id]) * 7919 + hash(req_id)) % 1000
                sampled[req_id] = [token]
        output = (
            end_step_without_copies(out, sampled)
            if self.worker is None
            else end_step(self.worker, out, sampled)
        )
        engine_outputs = self.scheduler.update_from_output(out, output)
        for outputs in engine_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for request_output in outputs.outputs:
                self.tokens[request_output.request_id].extend(request_output.new_token_ids)
                if request_output.finished:
                    self.finished.add(request_output.request_id)
        return out

    def published_events(self) -> list[Any]:
        """Every KV-cache event vLLM published, in order."""
        return [event for batch in self.published for event in batch.events]

    def _computed(self, req_id: str, out: Any) -> int:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])

    def _first_scheduled(self, req_id: str, num_computed: int) -> None:
        self.cached_at_start[req_id] = num_computed
        if self.copies:
            self.verify(req_id, num_computed)

    def verify(self, req_id: str, num_tokens: int) -> None:
        """Every one of the first ``num_tokens`` tokens holds exactly its KV, in every
        group; a sliding-window group only in its window, which must be there whole."""
        tokens = self.tokens[req_id]
        for group, (layers, blocks) in enumerate(
            zip(self.groups, self.blocks[req_id], strict=True)
        ):
            window_start = 0
            if group and self.sliding_window is not None:
                window_start = max(0, num_tokens - self.sliding_window + 1)
            for position in range(num_tokens):
                block = blocks[position // TOKENS_PER_BLOCK]
                if block == 0:  # vLLM's null block: a window's tokens passed by
                    assert position < window_start, (
                        f"{req_id}: token {position} of group {group} has no GPU block"
                    )
                    continue
                offset = position % TOKENS_PER_BLOCK
                expected = token_kv(tokens, position, group)
                for name in layers:
                    got = self.caches[name][block, :, offset]
                    assert torch.equal(got, expected), (
                        f"{req_id}: token {position} in GPU block {block} of {name} holds "
                        "other bytes than were computed for it"
                    )
        self.verified_blocks += num_tokens // TOKENS_PER_BLOCK

    def _compute(self, req_id: str, start: int, end: int) -> None:
        tokens = self.tokens[req_id]
        for group, (layers, blocks) in enumerate(
            zip(self.groups, self.blocks[req_id], strict=True)
        ):
            for position in range(start, min(end, len(tokens))):
                block = blocks[position // TOKENS_PER_BLOCK]
                if block == 0:  # a window's token passed by within this step
                    continue
                kv = token_kv(tokens, position, group)
                for name in layers:
                    self.caches[name][block, :, position % TOKENS_PER_BLOCK] = kv

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
                self.worker.connector_worker.worker.kvtier.wait(set(jobs), 0.02)  # type: ignore[union-attr]
            if self.manager.has_pending_work() and hasattr(self.manager, "kvtier"):
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
        """Wait until kvtier's cascades to secondary tiers are done."""
        kvtier_manager = self.manager.kvtier
        for _ in range(1000):
            self.step()
            if not kvtier_manager.has_pending_work():
                return
            kvtier_manager.host.wait_for_completions_blocking(0.05)
        raise AssertionError("kvtier's tiers did not settle")

    def wipe_gpu(self) -> None:
        """Empty vLLM's GPU prefix cache and zero the KV tensors, so only loads refill them."""
        assert self.scheduler.reset_prefix_cache()
        for tensor in self.caches.values():
            tensor.zero_()  # a shared tensor twice: harmless

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def make_engine(model_config: ModelConfig) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(extra_config: dict[str, Any], **kwargs: Any) -> Engine:
        engine = Engine(model_config, extra_config, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
        leftovers = list(Path("/dev/shm").glob(f"kvtier_{engine.engine_id}*"))
        assert not leftovers, f"the engine left {leftovers} behind"
