"""A vLLM model runner on CPU tensors, in the test process or in a worker process.

The vLLM tests (``tests/integrations/vllm``) run vLLM's scheduler in the test process
and one :class:`ModelRunner` per worker rank: with one rank in the same process, with
several each in a process of its own (:func:`worker`, started with multiprocessing's
spawn), as vLLM runs tensor-parallel workers. A runner holds the rank's KV tensors and
its worker-role ``OffloadingConnector``; for each step it writes the KV of the tokens
scheduled, bytes derived from the token's whole prefix, its KV-cache group and the
rank, so any block that holds other bytes (another prefix's, group's or rank's) fails
the check made when a request is first scheduled.

A runner's ``shape`` says how the ranks' bytes relate, as in the models people run:

- ``"salted"``: each rank's KV is its own (salted by the rank), two heads per rank.
- ``"sharded"``: the ranks split the model's KV heads evenly, as tensor parallelism
  does: each holds its heads of the one KV the model computes, whatever the ranks.
- ``"mla"``: an MLA model's latent KV, the same on every rank.
- ``"mamba"``: a hybrid of attention layers (each rank's own bytes) and Mamba layers,
  whose state for a prefix lives in the block of its last token; the Mamba group's
  layers overlay the attention group's tensors, as vLLM's hybrid allocator places them.
"""

from __future__ import annotations

import hashlib
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
from vllm_offline import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelRunnerOutput,
    OffloadingConnector,
    SchedulerOutput,
    SlidingWindowSpec,
    VllmConfig,
    begin_step,
    end_step,
    one_group_kv_cache,
    overlaid_kv_cache,
    worker_connector,
)

TOKENS_PER_BLOCK = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 16
#: The tiny Llama's KV heads (config.json), which "sharded" ranks split among them.
TOTAL_KV_HEADS = 2
#: The tiny DeepSeek-V2's latent per token: kv_lora_rank + qk_rope_head_dim.
MLA_HEAD_SIZE = 24
SHAPES = ("salted", "sharded", "mla", "mamba")
#: A Mamba hybrid's state layers (group 1), beside LAYERS (group 0).
MAMBA_LAYERS = ("model.layers.2.mixer", "model.layers.3.mixer")
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
#: A hybrid model's sliding-window layers (group 1), beside LAYERS (group 0).
WINDOW_LAYERS = ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")
TIMEOUT_S = 60


def token_kv(
    tokens: list[int],
    position: int,
    group: int = 0,
    rank: int = 0,
    *,
    shape: str = "salted",
    world_size: int = 1,
) -> torch.Tensor:
    """The KV of the token at ``position`` in a layer of KV-cache group ``group`` on
    worker ``rank`` of ``world_size``: bytes that depend on every token up to it and the
    group, and for the ``"salted"`` and ``"mamba"`` shapes on the rank (see the
    module's shapes)."""
    own = rank if shape in ("salted", "mamba") else 0  # the rank whose bytes these are
    salt = f"{group}/{own}:" if group or own else ""
    digest = hashlib.blake2b((salt + repr(tokens[: position + 1])).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "big") & ((1 << 63) - 1))
    if shape == "mla":
        return torch.randn((MLA_HEAD_SIZE,), generator=gen).to(torch.float16)
    if shape != "sharded":
        return torch.randn((2, NUM_KV_HEADS, HEAD_SIZE), generator=gen).to(torch.float16)
    whole = torch.randn((2, TOTAL_KV_HEADS, HEAD_SIZE), generator=gen).to(torch.float16)
    heads = TOTAL_KV_HEADS // world_size
    return whole[:, rank * heads : (rank + 1) * heads]


def kv_heads(shape: str, world_size: int) -> int:
    """KV heads a rank holds."""
    return TOTAL_KV_HEADS // world_size if shape == "sharded" else NUM_KV_HEADS


def kv_cache_config(
    num_blocks: int, sliding_window: int | None, shape: str = "salted", world_size: int = 1
) -> tuple[KVCacheConfig, tuple[tuple[str, ...], ...]]:
    """vLLM's KV cache config of one rank, and the layers of each of its groups: one
    full-attention group (of MLA layers for the ``"mla"`` shape), or (``sliding_window``
    set) a hybrid model's full-attention and sliding-window groups overlaying each
    other."""
    assert shape in SHAPES, shape
    if shape == "mla":
        assert sliding_window is None, "the MLA model here has no sliding window"
        latent = MLAAttentionSpec(
            block_size=TOKENS_PER_BLOCK,
            num_kv_heads=1,
            head_size=MLA_HEAD_SIZE,
            dtype=torch.float16,
        )
        config = one_group_kv_cache(num_blocks, LAYERS, latent)
        # vLLM's planner counts the ranks holding each latent alike.
        config.kv_tp_replicas = world_size
        return config, (LAYERS,)
    heads = kv_heads(shape, world_size)
    attention = FullAttentionSpec(
        block_size=TOKENS_PER_BLOCK, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16
    )
    if shape == "mamba":
        assert sliding_window is None, "the Mamba hybrid here has no sliding window"
        # A state of one attention page, so that the groups overlay page for page;
        # prefix caching keeps a Mamba state per block in vLLM's "align" mode.
        state = MambaSpec(
            block_size=TOKENS_PER_BLOCK,
            shapes=((attention.page_size_bytes // 2,),),
            dtypes=(torch.float16,),
            mamba_cache_mode="align",
        )
        groups = [(LAYERS, attention), (MAMBA_LAYERS, state)]
        return overlaid_kv_cache(num_blocks, groups), (LAYERS, MAMBA_LAYERS)
    if sliding_window is None:
        return one_group_kv_cache(num_blocks, LAYERS, attention), (LAYERS,)
    window = SlidingWindowSpec(
        block_size=TOKENS_PER_BLOCK,
        num_kv_heads=heads,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=sliding_window,
    )
    groups = [(LAYERS, attention), (WINDOW_LAYERS, window)]
    return overlaid_kv_cache(num_blocks, groups), (LAYERS, WINDOW_LAYERS)


class ModelRunner:
    """One worker rank: its KV tensors, its connector, and each request's blocks."""

    def __init__(
        self,
        config: VllmConfig,
        num_blocks: int,
        sliding_window: int | None,
        *,
        rank: int = 0,
        copies: bool = True,
        shape: str = "salted",
    ) -> None:
        self.rank = rank
        self.shape = shape
        self.world_size = config.parallel_config.world_size
        self.sliding_window = sliding_window
        self.kv_cache_config, self.groups = kv_cache_config(
            num_blocks, sliding_window, shape, self.world_size
        )
        # (num_blocks, K/V, tokens, heads, head size): the first dimension is the block;
        # an MLA layer's (num_blocks, tokens, latent).
        # Layer i of each group is the same tensor: the groups overlay each other.
        dims = (
            (num_blocks, TOKENS_PER_BLOCK, MLA_HEAD_SIZE)
            if shape == "mla"
            else (num_blocks, 2, TOKENS_PER_BLOCK, kv_heads(shape, self.world_size), HEAD_SIZE)
        )
        shared = [torch.zeros(dims, dtype=torch.float16) for _ in LAYERS]
        self.caches = {name: shared[i] for layers in self.groups for i, name in enumerate(layers)}
        #: None: every transfer job completes at once, no byte is checked (the scheduler
        #: side of a spec whose worker needs a GPU).
        self.worker: OffloadingConnector | None = (
            worker_connector(config, self.kv_cache_config, self.caches) if copies else None
        )
        #: Each request's GPU blocks, one list per KV-cache group (0: vLLM's null block).
        self.blocks: dict[str, list[list[int]]] = {}
        self.verified_blocks = 0

    def step(
        self, out: SchedulerOutput, tokens: dict[str, list[int]], sampled: dict[str, list[int]]
    ) -> tuple[ModelRunnerOutput | None, dict[str, int]]:
        """Run one step: loads, the KV of the scheduled tokens, stores. Returns the
        runner's output (None without copies) and the tokens each request first
        scheduled this step found computed, all verified byte for byte."""
        if self.worker is not None:
            begin_step(self.worker, out)
        first: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            first[new.req_id] = int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = (
                    [list(ids) for ids in new_ids] if new_ids else [[] for _ in self.groups]
                )
                first[req_id] = int(cached.num_computed_tokens[i])
            elif new_ids:
                for blocks, ids in zip(self.blocks[req_id], new_ids, strict=True):
                    blocks.extend(ids)
        if self.worker is None:
            return None, first
        for req_id, num_computed in first.items():
            self.verify(req_id, tokens[req_id], num_computed)
        for req_id, count in out.num_scheduled_tokens.items():
            start = _computed(req_id, out)
            self._compute(req_id, tokens[req_id], start, start + count)
        return end_step(self.worker, out, sampled), first

    def verify(self, req_id: str, tokens: list[int], num_tokens: int) -> None:
        """Every one of the first ``num_tokens`` tokens holds exactly its KV, in every
        group; a sliding-window group only in its window, which must be there whole, and
        a Mamba group only in the block of the last token, where its state is."""
        for group, (layers, blocks) in enumerate(
            zip(self.groups, self.blocks[req_id], strict=True)
        ):
            window_start = 0
            if group and self.sliding_window is not None:
                window_start = max(0, num_tokens - self.sliding_window + 1)
            elif group and self.shape == "mamba":
                window_start = max(0, num_tokens - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
            for position in range(num_tokens):
                block = blocks[position // TOKENS_PER_BLOCK]
                if block == 0:  # vLLM's null block: a window's tokens passed by
                    assert position < window_start, (
                        f"{req_id}: token {position} of group {group} has no GPU block"
                    )
                    continue
                offset = position % TOKENS_PER_BLOCK
                expected = self._kv(tokens, position, group)
                for name in layers:
                    got = self._token(name, block, offset)
                    assert torch.equal(got, expected), (
                        f"{req_id}: token {position} in GPU block {block} of {name} on rank "
                        f"{self.rank} holds other bytes than were computed for it"
                    )
        self.verified_blocks += num_tokens // TOKENS_PER_BLOCK

    def _compute(self, req_id: str, tokens: list[int], start: int, end: int) -> None:
        for group, (layers, blocks) in enumerate(
            zip(self.groups, self.blocks[req_id], strict=True)
        ):
            for position in range(start, min(end, len(tokens))):
                block = blocks[position // TOKENS_PER_BLOCK]
                if block == 0:  # a window's token passed by within this step
                    continue
                kv = self._kv(tokens, position, group)
                for name in layers:
                    self._token(name, block, position % TOKENS_PER_BLOCK)[...] = kv

    def _kv(self, tokens: list[int], position: int, group: int) -> torch.Tensor:
        return token_kv(
            tokens, position, group, self.rank, shape=self.shape, world_size=self.world_size
        )

    def _token(self, layer: str, block: int, offset: int) -> torch.Tensor:
        """A token's KV in a layer's block, as a view."""
        cache = self.caches[layer]
        return cache[block, offset] if self.shape == "mla" else cache[block, :, offset]

    def wipe(self) -> None:
        """Zero the KV tensors, so only loads refill them."""
        for tensor in self.caches.values():
            tensor.zero_()  # a shared tensor twice: harmless

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _computed(req_id: str, out: SchedulerOutput) -> int:
    for new in out.scheduled_new_reqs:
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = out.scheduled_cached_reqs
    return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])


def worker(conn: Connection) -> None:
    """A worker process: one rank's runner at a time, for one engine after another
    (starting a process that imports vLLM takes seconds, an engine's runner does not).

    Answers each message: ``("open", (config, num_blocks, sliding_window, rank, shape))``
    with ``"opened"``, ``("step", (out, tokens, sampled))`` with the step's result,
    ``("wipe", None)`` with ``"wiped"``, ``("close", None)`` (the runner) with
    ``"closed"``, ``("exit", None)`` with ``"exited"``; a failure with ``("error",
    traceback)``.
    """
    torch.set_num_threads(1)
    runner: ModelRunner | None = None
    while conn.poll(TIMEOUT_S * 10):
        kind, payload = conn.recv()
        try:
            if kind == "open":
                config, num_blocks, sliding_window, rank, shape = payload
                config.parallel_config.rank = rank
                runner = ModelRunner(config, num_blocks, sliding_window, rank=rank, shape=shape)
                conn.send("opened")
            elif kind == "exit":
                break
            else:
                assert runner is not None, f"{kind} before open"
                if kind == "step":
                    conn.send(runner.step(*payload))
                elif kind == "wipe":
                    runner.wipe()
                    conn.send("wiped")
                else:
                    runner, closing = None, runner
                    closing.close()
                    conn.send("closed")
        except BaseException:  # the engine reports it; this process carries on
            conn.send(("error", traceback.format_exc()))
    if runner is not None:
        runner.close()
    conn.send("exited")


class RemoteRunner:
    """The engine's end of a worker process."""

    def __init__(self, conn: Connection, process: Any) -> None:
        self.conn = conn
        self.process = process

    def send(self, kind: str, payload: Any = None) -> None:
        self.conn.send((kind, payload))

    def receive(self, what: str) -> Any:
        assert self.conn.poll(TIMEOUT_S), f"worker {self.process.name} sent no {what}"
        answer = self.conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise AssertionError(f"worker {self.process.name} failed:\n{answer[1]}")
        return answer
