"""kvtier.integrations.transformers on a tiny, randomly initialised Llama.

The model has two layers and a few thousand weights, built from a config with a fixed
seed: nothing is fetched, and a forward pass takes milliseconds. What holds for it
(restored KV bit-identical, greedy continuations equal to a full recompute) is what
the ``model`` session checks again on the real SmolLM2 weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest
import torch
from helpers import scripted
from scripted_tier import ScriptedTier
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier import KVTier
from kvtier.integrations.transformers import PrefixCache, cache_keyword, paged_layout
from kvtier.paged import PagedKVLayout

pytestmark = pytest.mark.anyio

CHUNK_TOKENS = 32  # two 16-token blocks per chunk
VOCAB = 256
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # No token ends generation, so every continuation has NEW_TOKENS tokens.
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def layout(model) -> PagedKVLayout:
    return paged_layout(model.config, torch.float32)


def prompt(length: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=gen).tolist()


def open_kv(engine_id, layout, *, cpu_tokens, root_dir=None, pool_blocks=64, tiers=None):
    if tiers is None:
        tiers = [{"type": "fs", "root_dir": str(root_dir)}] if root_dir is not None else []
    config = layout.config(
        engine_id,
        cpu_tokens=cpu_tokens,
        tokens_per_chunk=CHUNK_TOKENS,
        model_name="tiny-llama-random-seed0",
        kv_dtype="float32",
        secondary_tiers=tiers,
    )
    pool = layout.allocate(pool_blocks)
    return KVTier(config, pool), pool


def full_recompute(model, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )


def computed_kv(model, token_ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([token_ids]), **{cache_keyword(model): cache}, use_cache=True)
    return cache


async def serve(prefix: PrefixCache, model, token_ids: list[int]):
    """What a host does per request: restore, generate, store. Returns (tokens
    restored, the output ids, the cache as restored before the model ran)."""
    async with prefix.request(token_ids) as hit:
        restored = [
            (layer.keys.clone(), layer.values.clone())
            for layer in hit.cache.layers
            if hit.cached_tokens
        ]
        with torch.no_grad():
            out = model.generate(
                **hit.generate_inputs(model), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        await hit.store()
    return hit.cached_tokens, out, restored


def assert_kv_equal(restored, reference: DynamicCache, tokens: int) -> None:
    assert len(restored) == len(reference.layers)
    for (k, v), layer in zip(restored, reference.layers, strict=True):
        assert k.shape[-2] == tokens
        assert torch.equal(k, layer.keys[:, :, :tokens])
        assert torch.equal(v, layer.values[:, :, :tokens])


async def test_restored_kv_is_bit_identical_to_the_kv_computed_the_first_time(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(150)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        first, _, _ = await serve(prefix, model, tokens)
        assert first == 0
        again, _, restored = await serve(prefix, model, tokens + prompt(20, seed=2))
    assert again == 128  # four whole chunks of the 150 tokens
    assert_kv_equal(restored, computed_kv(model, tokens), 128)


async def test_greedy_continuation_from_a_restored_prefix_equals_a_full_recompute(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    system = prompt(100)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, system + prompt(10, seed=2))
        question = system + prompt(30, seed=3)
        cached, out, _ = await serve(prefix, model, question)
    assert cached == 96
    assert torch.equal(out, full_recompute(model, question))


async def test_model_forward_with_a_restored_prefix_gives_the_full_pass_logits(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(90)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, tokens)
        async with prefix.request(tokens) as hit:
            with torch.no_grad():
                logits = model(**hit.forward_inputs(model)).logits
        assert hit.cached_tokens == 64
    with torch.no_grad():
        full = model(torch.tensor([tokens])).logits
    assert logits.shape[1] == 90 - 64
    torch.testing.assert_close(logits, full[:, 64:], rtol=1e-5, atol=1e-5)


async def test_the_last_token_is_always_left_for_the_model_to_compute(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(3 * CHUNK_TOKENS)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, tokens)
        cached, out, _ = await serve(prefix, model, tokens)
    assert cached == 2 * CHUNK_TOKENS
    assert torch.equal(out, full_recompute(model, tokens))


async def test_only_the_chunks_before_the_first_changed_token_are_restored(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(160)
    changed = list(tokens)
    changed[70] = (changed[70] % (VOCAB - 1)) + 1  # in the third chunk
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, tokens)
        cached, out, _ = await serve(prefix, model, changed)
    assert cached == 2 * CHUNK_TOKENS
    assert torch.equal(out, full_recompute(model, changed))


async def test_a_prefix_comes_back_from_the_fs_tier_after_a_reset(
    engine_id, model, layout, tmp_path
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024, root_dir=tmp_path)
    tokens = prompt(200)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, tokens)
        await kv.drain()
        await kv.reset()
        assert kv.manager.host.readable_prefix(prefix.keys(tokens)) == 0
        question = tokens + prompt(15, seed=4)
        cached, out, restored = await serve(prefix, model, question)
        fs_hits = kv.manager.diagnostics.tier_stats()["1:fs"]["hits"]
    assert cached == 192
    assert fs_hits >= 6
    assert_kv_equal(restored, computed_kv(model, tokens), 192)
    assert torch.equal(out, full_recompute(model, question))


async def test_a_prefix_longer_than_the_primary_tier_restores_in_windows(
    engine_id, model, layout, tmp_path
):
    # The primary tier holds 4 chunks; the prefix is 12.
    kv, pool = open_kv(engine_id, layout, cpu_tokens=4 * CHUNK_TOKENS, root_dir=tmp_path)
    tokens = prompt(12 * CHUNK_TOKENS + 5)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        assert prefix.window_chunks == 1
        await serve(prefix, model, tokens)
        await kv.drain()
        cached, out, restored = await serve(prefix, model, tokens)
    assert cached == 12 * CHUNK_TOKENS
    assert_kv_equal(restored, computed_kv(model, tokens), 12 * CHUNK_TOKENS)
    assert torch.equal(out, full_recompute(model, tokens))


async def test_windows_of_several_chunks_restore_a_long_prefix_too(
    engine_id, model, layout, tmp_path
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=6 * CHUNK_TOKENS, root_dir=tmp_path)
    tokens = prompt(10 * CHUNK_TOKENS + 1)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config, window_chunks=3)
        await serve(prefix, model, tokens)
        await kv.drain()
        await kv.reset()
        cached, _, restored = await serve(prefix, model, tokens)
    assert cached == 10 * CHUNK_TOKENS
    assert_kv_equal(restored, computed_kv(model, tokens), 10 * CHUNK_TOKENS)


async def test_concurrent_requests_share_a_pool_of_one_window(engine_id, model, layout):
    # Two blocks: one chunk at a time, so requests queue for the pool.
    kv, pool = open_kv(engine_id, layout, cpu_tokens=2048, pool_blocks=2)
    system = prompt(4 * CHUNK_TOKENS)
    questions = [system + prompt(40, seed=10 + i) for i in range(4)]
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, [*system, 1])
        results = await asyncio.gather(*(serve(prefix, model, q) for q in questions))
    for question, (cached, out, _) in zip(questions, results, strict=True):
        assert cached == 4 * CHUNK_TOKENS
        assert torch.equal(out, full_recompute(model, question))


async def test_every_request_is_finished_even_when_the_model_fails(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(100)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        await serve(prefix, model, tokens)
        with pytest.raises(RuntimeError, match="model broke"):
            async with prefix.request(tokens) as hit:
                assert hit.cached_tokens == 96
                raise RuntimeError("model broke")
        # The failed request's pins are gone: every key is readable and unpinned.
        primary = kv.manager.primary
        assert {primary.ref_count(key) for key in prefix.keys(tokens)} == {0}


async def test_keys_depend_on_the_cache_identity(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(64)
    async with kv:
        fp32 = PrefixCache(kv, layout, pool)
        other = PrefixCache(kv, layout, pool, salt="tiny-llama-random-seed0\0bfloat16")
        assert fp32.keys(tokens) != other.keys(tokens)
        assert len(fp32.keys(tokens)) == 2


async def test_a_pool_that_does_not_match_the_layout_is_rejected(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    async with kv:
        with pytest.raises(ValueError, match="kv_caches has 1 tensors"):
            PrefixCache(kv, layout, pool[:1])
        wide = PagedKVLayout(2, 4, 16, torch.float32)
        with pytest.raises(ValueError, match=r"kv_caches\[0\] is"):
            PrefixCache(kv, wide, pool)
        bigger = LlamaConfig(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64
        )
        with pytest.raises(ValueError, match="the layout has"):
            PrefixCache(kv, layout, pool, model_config=bigger)


async def test_storing_a_cache_of_another_dtype_is_rejected(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(64)
    half = DynamicCache()
    for i, layer in enumerate(computed_kv(model, tokens).layers):
        half.update(layer.keys.half(), layer.values.half(), i)
    async with kv:
        prefix = PrefixCache(kv, layout, pool)
        with pytest.raises(ValueError, match="dtype"):
            await prefix.store(tokens, half, "r")


def test_importing_kvtier_does_not_import_transformers():
    code = (
        "import sys, kvtier, kvtier.integrations\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_a_prefix_restores_through_blocks_that_are_not_consecutive(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024, pool_blocks=8)
    tokens = prompt(3 * CHUNK_TOKENS + 3)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config, window_chunks=2)
        await serve(prefix, model, tokens)
        stack = contextlib.AsyncExitStack()
        first = await stack.enter_async_context(prefix._blocks(2))
        # Another request's copy holds blocks 2 and 3 meanwhile, so the restore's first
        # window of two chunks gets blocks 0, 1, 4 and 5.
        async with prefix._blocks(2) as held:
            await stack.aclose()
            assert (first, held) == ([0, 1], [2, 3])
            for tensor in pool:  # what the first request's copies left there goes
                tensor.zero_()
            cached, out, restored = await serve(prefix, model, tokens)
    assert cached == 3 * CHUNK_TOKENS
    assert_kv_equal(restored, computed_kv(model, tokens), 3 * CHUNK_TOKENS)
    assert torch.equal(out, full_recompute(model, tokens))


async def test_a_request_waits_for_the_whole_prefix_a_concurrent_claimer_computes(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    tokens = prompt(6 * CHUNK_TOKENS + 5)
    async with kv:
        # Windows of two chunks: the claim must reach past the window that missed.
        prefix = PrefixCache(kv, layout, pool, model_config=model.config, window_chunks=2)
        async with prefix.request(tokens, claim=True) as first:
            assert first.cached_tokens == 0
            second = asyncio.ensure_future(_claimed_serve(prefix, model, tokens))
            await asyncio.sleep(0.05)
            assert not second.done()  # waiting for the first request's chunks
            with torch.no_grad():
                model(**first.forward_inputs(model))
            # The first window's chunks alone: the second request takes them and
            # waits on for the rest, which the first request claimed as well.
            assert await prefix.store(tokens[: 2 * CHUNK_TOKENS], first.cache, first.req_id) == 2
            await asyncio.sleep(0.05)
            assert not second.done()
            assert await first.store() == 4
        cached, out = await asyncio.wait_for(second, 30)
    assert cached == 6 * CHUNK_TOKENS  # computed once, every chunk reused
    assert torch.equal(out, full_recompute(model, tokens))


async def _claimed_serve(prefix: PrefixCache, model, token_ids: list[int]):
    async with prefix.request(token_ids, claim=True) as hit:
        with torch.no_grad():
            out = model.generate(
                **hit.generate_inputs(model), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        await hit.store()
    return hit.cached_tokens, out


async def test_prefill_timings_set_the_cost_promotions_are_weighed_against(
    engine_id, model, layout
):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        assert prefix.recompute_s_per_chunk is None
        prefix.observe_prefill(CHUNK_TOKENS - 1, 5.0)  # less than a chunk: says little
        assert prefix.recompute_s_per_chunk is None
        prefix.observe_prefill(4 * CHUNK_TOKENS, 0.4)
        assert prefix.recompute_s_per_chunk == pytest.approx(0.1)
        prefix.observe_prefill(2 * CHUNK_TOKENS, 0.6)  # a slower machine moves it up
        assert 0.1 < prefix.recompute_s_per_chunk < 0.3
        assert kv.manager.host.recompute_s_per_chunk == prefix.recompute_s_per_chunk
        with pytest.raises(ValueError, match="seconds > 0"):
            prefix.observe_prefill(CHUNK_TOKENS, 0.0)


async def test_a_lookup_never_waits_longer_than_recomputing_its_chunks(engine_id, model, layout):
    kv, pool = open_kv(engine_id, layout, cpu_tokens=1024, tiers=[scripted("stuck", instant=True)])
    tokens = prompt(4 * CHUNK_TOKENS + 1)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config, lookup_timeout_s=600)
        await serve(prefix, model, tokens)
        await kv.drain()
        await kv.reset()  # the prefix is in the secondary tier only
        tier = ScriptedTier.instances["stuck"]
        tier.gate.clear()  # and its promotion never ends
        try:
            prefix.observe_prefill(4 * CHUNK_TOKENS, 0.2)  # 50 ms a chunk
            # The promotion is started (the tier is not measured yet), but the request
            # gives up on it after the 0.2 s recomputing would take, not 600 s.
            cached, _ = await asyncio.wait_for(_claimed_serve(prefix, model, tokens), 60)
        finally:
            tier.gate.set()
    assert cached == 0
