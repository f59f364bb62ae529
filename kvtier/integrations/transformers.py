"""Prefix reuse for Hugging Face ``transformers`` models (the ``hf`` extra).

A :class:`PrefixCache` sits between a :class:`~kvtier.KVTier` and a causal language
model that keeps its attention state in a ``transformers`` ``DynamicCache``. For a
prompt's token ids it restores the longest prefix kvtier holds (whole chunks, always
leaving at least one token for the model to compute, as the model needs one to produce
logits), hands the model a ``DynamicCache`` already holding those tokens, and afterwards
stores the prompt's new full chunks back::

    prefix = PrefixCache(kv, layout, kv_caches, model_config=model.config)
    async with prefix.request(token_ids) as hit:
        out = model.generate(**hit.generate_inputs(model), max_new_tokens=32, do_sample=False)
        await hit.store()

``kv_caches`` is the block pool the :class:`~kvtier.KVTier` was opened on
(``layout.allocate(num_blocks)``); the adapter uses it as the staging area between the
``DynamicCache`` layout ``(1, kv_heads, tokens, head_dim)`` per layer and kvtier's
blocks, taking blocks from it per request and giving them back when the copy is done.
A prefix longer than the primary tier (or the pool) is restored and stored in windows
of at most :attr:`PrefixCache.window_chunks` chunks, because a lookup keeps every hit
it found pinned in the primary tier until it is loaded.

The model's forward pass is the caller's: run it where it does not stall the event
loop (a worker thread for a CPU model). The adapter's own copies between the pool and
the ``DynamicCache`` run on a small thread limiter for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
from transformers import DynamicCache

from kvtier import prefix_keys
from kvtier.facade import KVTier
from kvtier.integrations._transformers_cache import (
    cache_keyword,
    cache_layers,
    fill_layer,
    paged_layout,
)
from kvtier.integrations._transformers_gguf import MODEL_CACHE_ENV, load_gguf, model_cache_dir
from kvtier.keys import OffloadKey
from kvtier.paged import PagedKVLayout

__all__ = [
    "MODEL_CACHE_ENV",
    "PrefixCache",
    "PrefixRequest",
    "Restored",
    "cache_keyword",
    "load_gguf",
    "model_cache_dir",
    "paged_layout",
]

#: A lookup that waits longer than this gives up and the model computes the rest: a
#: whole window promoted from a local disk takes well under a second here (79 MB in
#: ~170 ms), so 5 s only cuts off a stuck remote tier, never a working one.
DEFAULT_LOOKUP_TIMEOUT_S = 5.0

#: Copies between the pool and a DynamicCache are memory-bound (~40 ms for 1.8k tokens
#: of a 30-layer model here): two threads keep two requests moving without letting
#: copies crowd out the model's own threads on a small machine.
COPY_THREADS = 2

#: Weight of the newest prefill in the recompute cost's moving average: about the
#: last five prompts count, so a machine that gets busier is followed within a few
#: requests while one odd prefill (a page fault storm, a GC pause) moves it little.
_PREFILL_ALPHA = 0.3


@dataclass
class Restored:
    """What :meth:`PrefixCache.restore` brought back, and what it cost."""

    #: A DynamicCache holding the first :attr:`tokens` tokens of the prompt.
    cache: Any
    tokens: int
    chunks: int
    #: Seconds in kvtier's lookups (promotions from secondary tiers included).
    lookup_s: float = 0.0
    #: Seconds in kvtier's loads (primary tier -> pool).
    load_s: float = 0.0
    #: Seconds copying from the pool into the DynamicCache layout.
    gather_s: float = 0.0

    @property
    def kvtier_s(self) -> float:
        """kvtier's whole share of the time to first token."""
        return self.lookup_s + self.load_s + self.gather_s


class PrefixCache:
    """Restore and store prompt prefixes of one model through one :class:`KVTier`.

    Args:
        kv: an open facade whose ``kv_caches`` are ``kv_caches``.
        layout: the block layout of ``kv_caches``, matching the model's attention.
        kv_caches: the block pool, one tensor per layer as ``layout.allocate`` makes it.
        salt: the cache identity mixed into every key; by default the config's
            ``model_name`` and ``kv_dtype``, which must then say everything that
            changes the KV bytes of the same tokens: the model and its revision, the
            weights' quantization, the dtype the KV is computed in.
        model_config: the model's config; when given, the restored ``DynamicCache`` is
            built from it and its geometry is checked against ``layout``.
        lookup_timeout_s: how long a lookup waits for promotions (``None``: no limit);
            once the recompute cost is known (:meth:`observe_prefill`), the facade
            waits no longer than computing the chunks looked up would take.
        window_chunks: most chunks restored or stored in one step; by default a
            quarter of the primary tier, at most what the pool holds.

    Raises:
        ValueError: ``kv_caches`` or ``model_config`` do not match ``layout``, the
            layout's block size is not the facade's, or there is no salt and the
            config has no ``model_name``.
    """

    def __init__(
        self,
        kv: KVTier,
        layout: PagedKVLayout,
        kv_caches: Sequence[torch.Tensor],
        *,
        salt: bytes | str | None = None,
        model_config: Any = None,
        lookup_timeout_s: float | None = DEFAULT_LOOKUP_TIMEOUT_S,
        window_chunks: int | None = None,
    ) -> None:
        self.kv = kv
        self.layout = layout
        self.kv_caches = list(kv_caches)
        if salt is None:
            if not kv.config.model_name:
                raise ValueError(
                    "pass a salt, or set model_name (and kv_dtype) in the KVTier's config: "
                    "the cache identity must name the model, its quantization and the KV dtype"
                )
            salt = f"{kv.config.model_name}\0{kv.config.kv_dtype}"
        self.salt = salt
        self.model_config = model_config
        self.lookup_timeout_s = lookup_timeout_s
        if layout.tokens_per_block != kv.config.tokens_per_block:
            raise ValueError(
                f"the layout has {layout.tokens_per_block} tokens per block, the KVTier "
                f"{kv.config.tokens_per_block}"
            )
        self._check_pool()
        if model_config is not None:
            self._check_model(model_config)
        self.blocks_per_chunk = kv.blocks_per_chunk
        self.chunk_tokens = self.blocks_per_chunk * layout.tokens_per_block
        pool_chunks = self.kv_caches[0].shape[0] // self.blocks_per_chunk
        if pool_chunks < 1:
            raise ValueError(
                f"the pool holds {self.kv_caches[0].shape[0]} blocks, fewer than one chunk "
                f"({self.blocks_per_chunk} blocks)"
            )
        if window_chunks is None:
            # A quarter leaves the rest of the primary tier to other requests' pins.
            window_chunks = max(1, kv.num_chunks // 4)
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        self.window_chunks = min(window_chunks, pool_chunks)
        self._free = list(range(self.kv_caches[0].shape[0]))
        self._returned = asyncio.Condition()
        self._copy_limiter = anyio.CapacityLimiter(COPY_THREADS)
        self._measured_s_per_chunk: float | None = None

    def _check_pool(self) -> None:
        layout = self.layout
        if len(self.kv_caches) != layout.num_layers:
            raise ValueError(
                f"kv_caches has {len(self.kv_caches)} tensors, the layout "
                f"{layout.num_layers} layers"
            )
        expected = (2, layout.tokens_per_block, layout.num_kv_heads, layout.head_dim)
        for i, tensor in enumerate(self.kv_caches):
            if tuple(tensor.shape[1:]) != expected or tensor.dtype != layout.dtype:
                raise ValueError(
                    f"kv_caches[{i}] is {tuple(tensor.shape)} {tensor.dtype}; the layout wants "
                    f"(num_blocks, *{expected}) {layout.dtype}"
                )
            if tensor.shape[0] != self.kv_caches[0].shape[0]:
                raise ValueError("every tensor of kv_caches must hold the same number of blocks")

    def _check_model(self, model_config: Any) -> None:
        expected = paged_layout(model_config, self.layout.dtype, self.layout.tokens_per_block)
        ours = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
        theirs = (expected.num_layers, expected.num_kv_heads, expected.head_dim)
        if ours != theirs:
            raise ValueError(
                f"the layout has (layers, kv heads, head dim) = {ours}, the model {theirs}"
            )

    # ------------------------------------------------------------------ keys

    def keys(self, token_ids: Sequence[int]) -> list[OffloadKey]:
        """The keys of the full chunks of ``token_ids``."""
        return prefix_keys(list(token_ids), self.chunk_tokens, salt=self.salt)

    @staticmethod
    def new_req_id() -> str:
        """A request id no other request of any process uses."""
        return f"hf-{uuid.uuid4().hex}"

    # -------------------------------------------------------- recompute cost

    @property
    def recompute_s_per_chunk(self) -> float | None:
        """What recomputing one chunk costs the model, as measured so far (None before
        the first :meth:`observe_prefill`, or the configured value)."""
        return self.kv.recompute_s_per_chunk

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Tell kvtier that the model computed ``tokens`` prompt tokens in ``seconds``.

        kvtier weighs every promotion from a secondary tier against this (load or
        recompute): a chunk that would arrive later than the model could compute it
        is a miss, and the model computes it. A moving average of seconds per chunk
        follows the model as it warms up or the machine gets busier. A prefill
        shorter than one chunk says little about a chunk's cost (fixed per-call
        overheads dominate it) and is ignored.

        Raises:
            ValueError: ``tokens`` is negative or ``seconds`` not positive.
        """
        if tokens < 0 or not seconds > 0:
            raise ValueError(
                f"a prefill takes tokens >= 0 and seconds > 0, got {tokens} and {seconds}"
            )
        if tokens < self.chunk_tokens or self.kv.closed:
            return
        sample = seconds * self.chunk_tokens / tokens
        current = self._measured_s_per_chunk
        self._measured_s_per_chunk = (
            sample if current is None else current + _PREFILL_ALPHA * (sample - current)
        )
        self.kv.recompute_s_per_chunk = self._measured_s_per_chunk

    # -------------------------------------------------------------- requests

    @contextlib.asynccontextmanager
    async def request(
        self, token_ids: Sequence[int], *, req_id: str | None = None, claim: bool = False
    ) -> AsyncIterator[PrefixRequest]:
        """Restore the cached prefix of ``token_ids`` for one request; finish it on exit.

        With ``claim``, see :meth:`restore`.
        """
        req_id = req_id or self.new_req_id()
        try:
            restored = await self.restore(token_ids, req_id, claim=claim)
            yield PrefixRequest(self, list(token_ids), req_id, restored)
        finally:
            if not self.kv.closed:
                self.kv.finish(req_id)

    async def restore(
        self, token_ids: Sequence[int], req_id: str, *, claim: bool = False
    ) -> Restored:
        """Restore the longest cached prefix of ``token_ids`` into a new DynamicCache.

        Only whole chunks, and never the last token (the model must compute at least
        one). The prefix comes back in windows of :attr:`window_chunks` chunks; the
        first chunk missing, or promoted too late for the lookup timeout, ends it.
        The caller finishes ``req_id`` (``kv.finish``) when the request is done.

        With ``claim`` the request says it computes and stores the chunks it did not
        find (:meth:`KVTier.lookup <kvtier.KVTier.lookup>`): a concurrent request with
        the same prefix then waits for them, within the lookup timeout, instead of
        computing them too. Only for a host that computes this request while the
        other waits, never one that waits while holding what this request needs to
        run (a one-at-a-time model lock taken before the lookup, say).

        Raises:
            KVTierError: the facade is closed, or a copy failed.
        """
        keys = self.keys(token_ids[:-1])
        restored = Restored(cache=self._new_cache(), tokens=0, chunks=0)
        # Every restored token goes straight to its place in these, one copy from the
        # pool; pages past the tokens restored are never touched, so never allocated.
        buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        bpc = self.blocks_per_chunk
        while restored.chunks < len(keys):
            window = keys[restored.chunks : restored.chunks + self.window_chunks]
            started = time.perf_counter()
            hits = await self.kv.lookup(window, req_id, timeout=self.lookup_timeout_s, claim=claim)
            looked_up = time.perf_counter()
            restored.lookup_s += looked_up - started
            loaded = 0
            # Blocks of the pool only for what was found, and only once it was: a
            # lookup may wait for promotions, and a miss needs none.
            if hits:
                async with self._blocks(hits * bpc) as blocks:
                    loaded = await self.kv.load(window[:hits], blocks, req_id)
                    copied = time.perf_counter()
                    if loaded:
                        if not buffers:
                            buffers = self._buffers(len(keys) * self.chunk_tokens)
                        await anyio.to_thread.run_sync(
                            self._gather,
                            blocks[: loaded * bpc],
                            buffers,
                            restored.chunks * self.chunk_tokens,
                            limiter=self._copy_limiter,
                        )
                    restored.load_s += copied - looked_up
                    restored.gather_s += time.perf_counter() - copied
            restored.chunks += loaded
            if loaded < len(window):
                if claim:
                    self.kv.claim(keys[restored.chunks :], req_id)
                break
        restored.tokens = restored.chunks * self.chunk_tokens
        if restored.tokens:
            started = time.perf_counter()
            for layer, (k, v) in enumerate(buffers):
                fill_layer(
                    restored.cache, layer, k[:, :, : restored.tokens], v[:, :, : restored.tokens]
                )
            restored.gather_s += time.perf_counter() - started
        return restored

    def _new_cache(self) -> Any:
        if self.model_config is None:
            return DynamicCache()
        return DynamicCache(config=self.model_config)

    def _buffers(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (1, self.layout.num_kv_heads, tokens, self.layout.head_dim)
        dtype = self.layout.dtype
        return [
            (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            for _ in self.kv_caches
        ]

    async def store(
        self, token_ids: Sequence[int], cache: Any, req_id: str, *, skip_chunks: int = 0
    ) -> int:
        """Store the full chunks of ``token_ids`` that ``cache`` holds, after the first
        ``skip_chunks`` (those restored from kvtier are there already).

        Returns how many chunks kvtier newly stored; cascades to the secondary tiers go
        on after it returns (``kv.drain()`` waits for them).

        Raises:
            ValueError: the cache holds a batch of more than one sequence, or KV of
                another geometry or dtype than the layout's.
            KVTierError: the facade is closed.
        """
        layers = cache_layers(cache)
        layout = self.layout
        if len(layers) != layout.num_layers:
            raise ValueError(f"the cache has {len(layers)} layers, the layout {layout.num_layers}")
        k = layers[0][0]
        if (k.shape[1], k.shape[3], k.dtype) != (
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
        ):
            raise ValueError(
                f"the cache holds (heads, head dim, dtype) = ({k.shape[1]}, {k.shape[3]}, "
                f"{k.dtype}), the layout ({layout.num_kv_heads}, {layout.head_dim}, {layout.dtype})"
            )
        keys = self.keys(list(token_ids)[: k.shape[-2]])
        bpc = self.blocks_per_chunk
        stored = 0
        for start in range(skip_chunks, len(keys), self.window_chunks):
            window = keys[start : start + self.window_chunks]
            async with self._blocks(len(window) * bpc) as blocks:
                await anyio.to_thread.run_sync(
                    self._scatter,
                    layers,
                    start * self.chunk_tokens,
                    blocks,
                    limiter=self._copy_limiter,
                )
                stored += await self.kv.store(window, blocks, req_id)
        return stored

    # --------------------------------------------------------------- copies

    def _gather(
        self, blocks: list[int], buffers: list[tuple[torch.Tensor, torch.Tensor]], first_token: int
    ) -> None:
        """Copy the tokens of ``blocks`` into ``buffers`` from ``first_token`` on."""
        layout = self.layout
        n, tpb, heads, dim = (
            len(blocks),
            layout.tokens_per_block,
            layout.num_kv_heads,
            layout.head_dim,
        )
        first = blocks[0]
        consecutive = blocks == list(range(first, first + n))
        index = None if consecutive else torch.tensor(blocks, dtype=torch.long)
        end = first_token + n * tpb
        for pool, (k, v) in zip(self.kv_caches, buffers, strict=True):
            # (n, 2, tpb, heads, dim): a view of the pool when the blocks are consecutive.
            picked = pool[first : first + n] if index is None else pool.index_select(0, index)
            # (n, tpb, heads, dim) -> (heads, n, tpb, dim), in one copy each.
            k[0, :, first_token:end].view(heads, n, tpb, dim).copy_(
                picked[:, 0].permute(2, 0, 1, 3)
            )
            v[0, :, first_token:end].view(heads, n, tpb, dim).copy_(
                picked[:, 1].permute(2, 0, 1, 3)
            )

    def _scatter(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        first_token: int,
        blocks: list[int],
    ) -> None:
        index = torch.tensor(blocks, dtype=torch.long)
        layout = self.layout
        end = first_token + len(blocks) * layout.tokens_per_block
        shape = (len(blocks), layout.tokens_per_block, layout.num_kv_heads, layout.head_dim)
        for pool, (k, v) in zip(self.kv_caches, layers, strict=True):
            # (1, heads, tokens, dim) -> (blocks, tokens per block, heads, dim)
            pool[index, 0] = k[0, :, first_token:end].transpose(0, 1).reshape(shape)
            pool[index, 1] = v[0, :, first_token:end].transpose(0, 1).reshape(shape)

    @contextlib.asynccontextmanager
    async def _blocks(self, count: int) -> AsyncIterator[list[int]]:
        """Take ``count`` blocks of the pool for one copy, waiting for others to return."""
        async with self._returned:
            await self._returned.wait_for(lambda: len(self._free) >= count)
            taken, self._free = self._free[:count], self._free[count:]
        try:
            yield taken
        finally:
            # Kept in order, so that blocks taken together are mostly consecutive and
            # a gather reads them as one view instead of copying them out first.
            self._free = sorted(self._free + taken)
            async with self._returned:
                self._returned.notify_all()


class PrefixRequest:
    """One request's restored prefix, and the inputs for the model to compute the rest."""

    def __init__(
        self, prefix: PrefixCache, token_ids: list[int], req_id: str, restored: Restored
    ) -> None:
        self.prefix = prefix
        self.token_ids = token_ids
        self.req_id = req_id
        self.restored = restored

    @property
    def cache(self) -> Any:
        """The DynamicCache: the restored tokens now, more once the model has run."""
        return self.restored.cache

    @property
    def cached_tokens(self) -> int:
        """How many leading tokens were restored rather than computed."""
        return self.restored.tokens

    @property
    def input_ids(self) -> torch.Tensor:
        """All the prompt's tokens, ``(1, tokens)``: what ``generate`` takes."""
        return torch.tensor([self.token_ids], dtype=torch.long)

    @property
    def new_ids(self) -> torch.Tensor:
        """The tokens the model still has to compute, ``(1, tokens)``: what ``model(...)`` takes."""
        return torch.tensor([self.token_ids[self.cached_tokens :]], dtype=torch.long)

    def forward_inputs(self, model: Any) -> dict[str, Any]:
        """Keyword arguments for ``model(**...)``: the new tokens and the cache."""
        return {"input_ids": self.new_ids, cache_keyword(model): self.cache, "use_cache": True}

    def generate_inputs(self, model: Any) -> dict[str, Any]:
        """Keyword arguments for ``model.generate(**...)``: every prompt token (generate
        skips those the cache holds), their attention mask and the cache."""
        ids = self.input_ids
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            cache_keyword(model): self.cache,
        }

    async def store(self) -> int:
        """Store the prompt's full chunks the model computed (not those restored)."""
        return await self.prefix.store(
            self.token_ids, self.cache, self.req_id, skip_chunks=self.restored.chunks
        )
