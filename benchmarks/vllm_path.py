"""The serving path through vLLM: its real scheduler and connector driving kvtier's spec.

``benchmarks/serving_path.py``'s workload, run through vLLM 0.33's ``Scheduler`` with the
``OffloadingConnector`` in both roles and ``KVTierOffloadingSpec`` (loaded through
``spec_module_path``) with one fs tier, so that set beside ``serving_path.py`` (kvtier
alone) the difference is what vLLM's connector and kvtier's adapter cost. The model
runner is this script: it steps the scheduler, runs the worker-role connector over CPU
KV tensors, and its "forward pass" fills each computed block with a pattern derived
from the block's hash (two KV tensors of half a chunk each, as in ``serving_path.py``).

1. Raw reference: ``kvtier.bench.physical.measure_disk``, as ``serving_path.py`` takes it.
2. Stores: ``--gib`` of distinct prompts of ``--job-chunks`` blocks (one block is one
   chunk) plus a short tail, one new request per step with ``max_tokens=1``; vLLM's
   connector stores their blocks. A prompt is sent once kvtier's primary tier has room
   for its chunks (``serving_path.py`` waits at ``prepare_store`` the same way). The
   clock runs until the scheduler has nothing left (every cascade to the fs tier
   finished) and ``os.sync()`` returned.
3. Promotions: vLLM's GPU prefix cache and kvtier's primary tier emptied
   (``reset_prefix_cache(reset_connector=True)``), the KV tensors zeroed, the page cache
   dropped; the same prompts sent again in a seeded random order, ``--in-flight`` at once
   (vLLM's ``max_num_seqs`` too). vLLM looks up every key of every waiting request each
   step; when a request is first scheduled every block it found computed is compared
   with the pattern of its hash. A request's wait runs from the first step whose lookups
   deferred it to the step that started its load.
4. The raw reference again; the limit is the mean of the two.

``--groups 2`` makes the model hybrid: a sliding-window group of ``--window-blocks``
blocks beside the full-attention one, its layers overlaying the first group's tensors as
vLLM's hybrid allocator places them, each group's blocks with patterns of their own.
``--tp 2`` runs two tensor-parallel ranks (in this process, each with its own worker
connector and half the KV heads, patterns of its own), their outputs aggregated as
vLLM's executor does; the chunk is both ranks' bytes together.

Every step is timed (``scheduler.schedule()`` plus ``update_from_output``), and inside it
the time spent in vLLM's connector, in kvtier's adapter (the spec's manager) and in
kvtier's manager, by wrapping their methods here. vLLM's engine is built as the vLLM
tests build theirs (``vllm_offline.py``); it needs vLLM, as ``nox -s vllm`` installs it.

The last line is one JSON object with ``serving_path.py``'s figures by the same names
(``promotion_gbps``, ``promotion_ratio``, ``promotion_p50_ms`` / ``_p99_ms`` (job times),
``request_wait_p50_ms`` / ``_p99_ms``, ``loop_lag_p99_ms``, ``mismatches``, ...) and the
step figures (``step_p50_ms`` / ``step_p99_ms``, ``connector_own_ms_per_step``,
``adapter_own_ms_per_step``, ``kvtier_own_ms_per_step``, ...).

    .nox/vllm/bin/python benchmarks/vllm_path.py --root /path/on/the/disk/to/measure
    .nox/vllm/bin/python benchmarks/vllm_path.py --quick     # small sizes; a few seconds
                                                             # after importing vLLM
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The tiny model config only satisfies ModelConfig; nothing is fetched from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import common
import torch
from step_timing import LAYERS_TIMED, StepClocks, step_figures, wrapper_cost_s
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm_offline import (
    MAX_MODEL_LEN,
    FullAttentionSpec,
    ModelRunnerOutput,
    OffloadingConnector,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    SlidingWindowSpec,
    begin_step,
    block_hasher,
    end_step,
    engine_config,
    model_config,
    one_group_kv_cache,
    overlaid_kv_cache,
    scheduler,
    worker_connector,
)

from kvtier.hosts import Step, step_until_blocking

TOKENS_PER_BLOCK = 16  # vLLM's default block size
HEAD_SIZE = 128
# Two KV tensors of half a chunk each per block, as serving_path.py's worker copies: a
# 2 MiB block of 16 tokens is a Llama-3-8B's (32 layers x 8 KV heads x 128), folded
# into two layers of 128 heads.
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
#: The sliding-window group's layers (with --groups 2), overlaying LAYERS' tensors.
WINDOW_LAYERS = ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")
# Tokens after the stored blocks: vLLM computes at least one token of every prompt, and
# a partial block is never stored.
TAIL_TOKENS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = common.workload_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--groups", type=int, choices=(1, 2), default=1, help="KV-cache groups (2: hybrid)"
    )
    parser.add_argument(
        "--window-blocks", type=int, default=4, help="the sliding-window group's window"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    args = parser.parse_args(argv)
    common.check_workload_args(parser, args)
    chunk = int(args.chunk_mib * common.MIB)
    per_head = len(LAYERS) * 2 * TOKENS_PER_BLOCK * HEAD_SIZE * 2  # K and V, fp16
    if chunk % (per_head * args.tp):
        parser.error(f"--chunk-mib must be a multiple of {per_head * args.tp} bytes here")
    if args.tp < 1 or args.window_blocks < 1:
        parser.error("--tp and --window-blocks must be at least 1")
    args.kv_heads = chunk // per_head
    if args.job_chunks * TOKENS_PER_BLOCK + TAIL_TOKENS + 1 > MAX_MODEL_LEN:
        parser.error(
            f"--job-chunks {args.job_chunks} makes prompts longer than the model's "
            f"{MAX_MODEL_LEN} tokens"
        )
    return args


# --------------------------------------------------------------------- the engine


class Engine:
    """vLLM's scheduler plus a worker-role connector over CPU KV tensors, stepped by hand."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        tier = {
            "type": "fs",
            "root_dir": str(root / "tier"),
            **common.tier_options(args.tier_option),
        }
        prompt_tokens = args.job_chunks * TOKENS_PER_BLOCK + TAIL_TOKENS
        # Every request in flight holds its blocks and one for its tail; two more
        # requests' worth keeps stores from recycling blocks still being copied.
        self.num_blocks = (args.in_flight + 2) * (args.job_chunks + 1) + 1
        self.config = engine_config(
            model_config(),
            {"cpu_bytes_to_use": int(args.primary_gib * common.GIB), "secondary_tiers": [tier]},
            engine_id=f"bench-vllm-{uuid.uuid4().hex[:8]}",
            block_size=TOKENS_PER_BLOCK,
            num_blocks=self.num_blocks,
            max_num_seqs=args.in_flight,
            max_num_batched_tokens=max(MAX_MODEL_LEN, args.in_flight * prompt_tokens),
        )
        heads = args.kv_heads // args.tp
        attention = FullAttentionSpec(
            block_size=TOKENS_PER_BLOCK,
            num_kv_heads=heads,
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        self.groups: tuple[tuple[str, ...], ...] = (LAYERS,)
        self.window = args.window_blocks * TOKENS_PER_BLOCK if args.groups > 1 else None
        if self.window is None:
            kv_cache = one_group_kv_cache(self.num_blocks, LAYERS, attention)
        else:
            window = SlidingWindowSpec(
                block_size=TOKENS_PER_BLOCK,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=torch.float16,
                sliding_window=self.window,
            )
            self.groups = (LAYERS, WINDOW_LAYERS)
            kv_cache = overlaid_kv_cache(
                self.num_blocks, [(LAYERS, attention), (WINDOW_LAYERS, window)]
            )
        #: Chunks one prompt stores: its blocks, and in a window group the last few
        #: (vLLM keeps a window's worth, and the chunk it starts inside).
        self.chunks_per_prompt = args.job_chunks
        if self.window is not None:
            self.chunks_per_prompt += min(args.job_chunks, args.window_blocks + 1)
        self.config.parallel_config.tensor_parallel_size = args.tp
        self.config.parallel_config.world_size = args.tp
        self.hasher = block_hasher(TOKENS_PER_BLOCK)
        self.scheduler = scheduler(self.config, kv_cache)
        self.aggregator = KVOutputAggregator(args.tp)
        self.ranks: list[Rank] = []
        try:
            for rank in range(args.tp):
                self.ranks.append(Rank(self.config, kv_cache, self.groups, rank, heads, args.seed))
        except BaseException:
            self.close()
            raise
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        assert connector.connector_scheduler is not None
        self.adapter: Any = connector.connector_scheduler.manager
        self.kvtier = self.adapter.kvtier
        self.timing = StepClocks(connector, self.adapter, self.kvtier)
        #: Each request's GPU blocks, one list per KV-cache group.
        self.blocks: dict[str, list[list[int]]] = {}
        #: Blocks each request found computed when first scheduled, all verified.
        self.loaded: dict[str, int] = {}
        self.mismatches = 0
        self.steps = 0

    def add(self, req_id: str, tokens: list[int]) -> None:
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=tokens,
                sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )

    def step(self) -> tuple[SchedulerOutput, list[str], bool]:
        """One engine step: the output, the requests it finished, whether anything moved."""
        self.timing.begin_step()
        started = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter() - started
        runner_output = self.run_model(out)
        ran = time.perf_counter()
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        self.timing.end_step(scheduled + time.perf_counter() - ran, ran - started - scheduled)
        self.steps += 1
        finished = [
            output.request_id
            for outputs in engine_outputs.values()
            for output in outputs.outputs
            if output.finished
        ]
        meta: Any = out.kv_connector_metadata
        kv_output = runner_output.kv_connector_output
        moved = bool(
            out.total_num_scheduled_tokens
            or finished
            or (meta is not None and (meta.load_jobs or meta.store_jobs))
            or (
                kv_output is not None and (kv_output.finished_recving or kv_output.finished_sending)
            )
        )
        return out, finished, moved

    def run_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The model runners' half of a step: connector hooks around a cheap forward pass,
        on every rank; their outputs aggregated as vLLM's executor does."""
        for rank in self.ranks:
            begin_step(rank.worker, out)
        if out.preempted_req_ids or out.scheduled_cached_reqs.resumed_req_ids:
            raise RuntimeError(
                "a request was preempted: the benchmark sizes vLLM's blocks so none is"
            )
        requests = self.scheduler.requests
        # Where each request's tokens of this step start: schedule() has already
        # advanced the requests' own counts past them.
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self.verify(requests[new.req_id], new.num_computed_tokens)
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids:
                for blocks, ids in zip(self.blocks[req_id], new_ids, strict=True):
                    blocks.extend(ids)
            starts[req_id] = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            request = requests[req_id]
            start = starts[req_id]
            self.compute(request, start, start + count)
            if start + count >= request.num_tokens:
                sampled[req_id] = [7]
        outputs = [end_step(rank.worker, out, sampled) for rank in self.ranks]
        return outputs[0] if len(outputs) == 1 else self.aggregator.aggregate(outputs)

    def compute(self, request: Request, start: int, end: int) -> None:
        """Fill each block this step completes with the pattern of its hash, in every
        group (a window's blocks passed by are vLLM's null block, 0) and on every rank."""
        first = start // TOKENS_PER_BLOCK
        done = min(end // TOKENS_PER_BLOCK, len(request.block_hashes))
        if done <= first:
            return
        for group, blocks in enumerate(self.blocks[request.request_id]):
            hashes, ids = held(request.block_hashes[first:done], blocks[first:done])
            for rank in self.ranks:
                rank.patterns[group].write(hashes, ids)

    def verify(self, request: Request, num_computed: int) -> None:
        """Every block the request found computed holds exactly its hash's pattern, in
        every group that holds it and on every rank."""
        count = num_computed // TOKENS_PER_BLOCK
        for group, blocks in enumerate(self.blocks[request.request_id]):
            hashes, ids = held(request.block_hashes[:count], blocks[:count])
            for rank in self.ranks:
                self.mismatches += rank.patterns[group].wrong(hashes, ids)
        self.loaded[request.request_id] = count

    def wipe(self) -> None:
        """Empty vLLM's GPU prefix cache and kvtier's primary tier, and zero the KV tensors."""
        if not self.scheduler.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM refused to reset its prefix cache")
        for rank in self.ranks:
            for tensor in rank.caches.values():
                tensor.zero_()

    def has_room(self, chunks: int) -> bool:
        """Whether kvtier's primary tier can take ``chunks`` new chunks without refusing."""
        primary = self.kvtier.primary
        with self.kvtier.lock:
            return bool(primary.num_free + primary.num_evictable >= chunks)

    def run(self, step: Callable[[], Step], idle_s: float) -> None:
        """Step until ``step`` is done; after a step that moved nothing, wait for kvtier
        to complete something, at most ``idle_s`` (timed as the phase's idle time)."""
        times = self.timing.current
        idle_since: float | None = None

        def timed() -> Step:
            nonlocal idle_since
            if idle_since is not None:
                times.idle_s += time.perf_counter() - idle_since
            found = step()
            idle_since = time.perf_counter() if found is Step.WAIT else None
            return found

        step_until_blocking(self.kvtier.host, timed, recheck=lambda: idle_s)

    def close(self) -> None:
        try:
            for rank in self.ranks:
                rank.worker.shutdown()
        finally:
            self.scheduler.shutdown()


def held(hashes: Sequence[Any], blocks: Sequence[int]) -> tuple[list[Any], list[int]]:
    """The hashes and blocks of those blocks a group holds (a window passed by the rest:
    vLLM's null block, 0)."""
    pairs = [(h, b) for h, b in zip(hashes, blocks, strict=True) if b]
    return [h for h, _ in pairs], [b for _, b in pairs]


class Rank:
    """One tensor-parallel rank: its KV tensors, worker-role connector and patterns.

    Every group's layers share the first group's tensors (one per layer index), so the
    groups' patterns differ by their seeds; so do the ranks'.
    """

    def __init__(
        self,
        config: Any,
        kv_cache: Any,
        groups: Sequence[Sequence[str]],
        rank: int,
        heads: int,
        seed: int,
    ) -> None:
        num_blocks = kv_cache.num_blocks
        config = copy.deepcopy(config)
        config.parallel_config.rank = rank
        shape = (num_blocks, 2, TOKENS_PER_BLOCK, heads, HEAD_SIZE)
        tensors = [torch.zeros(shape, dtype=torch.float16) for _ in LAYERS]
        self.caches = {name: tensors[i] for layers in groups for i, name in enumerate(layers)}
        self.worker = worker_connector(config, kv_cache, self.caches)
        self.patterns = [
            common.Patterns(
                [tensor.view(num_blocks, -1).view(torch.int64) for tensor in tensors],
                seed + 1000 * rank + 100 * group,
            )
            for group in range(len(groups))
        ]


# ------------------------------------------------------------------------ phases


@dataclass
class LoadFigures:
    waits: list[float] = field(default_factory=list)
    resident_requests: int = 0
    recomputed_blocks: int = 0


def prompts(seed: int, count: int, job_chunks: int) -> list[list[int]]:
    """``count`` distinct prompts of ``job_chunks`` full blocks and a short tail."""
    rng = random.Random(seed)
    length = job_chunks * TOKENS_PER_BLOCK + TAIL_TOKENS
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def store_all(engine: Engine, texts: Sequence[list[int]], idle_s: float) -> float:
    """Seconds to store ``texts``, one new request a step, and cascade them to disk.

    vLLM looks every new prompt up first, and kvtier answers RETRY until its fs tier
    said MISS: requests wait a few steps, then go in together. A prompt is sent only
    when the primary tier has room for it and for every prompt still waiting.
    """
    started = time.perf_counter()
    scheduler = engine.scheduler
    requests = scheduler.requests
    sent = 0
    unscheduled: list[str] = []

    def step() -> Step:
        nonlocal sent, unscheduled
        if not (sent < len(texts) or scheduler.has_requests()):
            return Step.DONE
        unscheduled = [
            req_id
            for req_id in unscheduled
            if req_id in requests and requests[req_id].status is RequestStatus.WAITING
        ]
        added = sent < len(texts) and engine.has_room(
            (len(unscheduled) + 1) * engine.chunks_per_prompt
        )
        if added:
            req_id = f"store-{sent}"
            engine.add(req_id, texts[sent])
            unscheduled.append(req_id)
            sent += 1
        _, _, moved = engine.step()
        return Step.AGAIN if moved or added else Step.WAIT

    engine.run(step, idle_s)
    os.sync()
    return time.perf_counter() - started


def load_all(
    engine: Engine,
    texts: Sequence[tuple[int, list[int]]],
    job_chunks: int,
    in_flight: int,
    timeout_s: float,
    idle_s: float,
) -> LoadFigures:
    """Send ``texts`` again, ``in_flight`` at once, until each is answered."""
    figures = LoadFigures()
    requests = engine.scheduler.requests
    pending = list(reversed(texts))
    admitted: dict[str, float] = {}
    #: The first step whose lookups deferred a request; gone once its load started.
    deferred: dict[str, float] = {}
    loading: set[str] = set()

    def step() -> Step:
        if not (pending or admitted):
            return Step.DONE
        while pending and len(admitted) < in_flight:
            index, tokens = pending.pop()
            req_id = f"load-{index}"
            engine.add(req_id, tokens)
            admitted[req_id] = time.perf_counter()
        step_started = time.perf_counter()
        _, finished, moved = engine.step()
        for req_id in finished:
            del admitted[req_id]
            loading.discard(req_id)
        for req_id, since in admitted.items():
            if req_id in loading:
                continue
            if requests[req_id].status is RequestStatus.WAITING:
                deferred.setdefault(req_id, step_started)
                if step_started - since > timeout_s:
                    raise RuntimeError(
                        f"request {req_id} still waits for its chunks after {timeout_s:g} s"
                    )
                continue
            loading.add(req_id)
            if req_id in deferred:
                figures.waits.append(step_started - deferred.pop(req_id))
            else:  # every chunk was readable at its first lookup
                figures.resident_requests += 1
        return Step.AGAIN if moved else Step.WAIT

    engine.run(step, idle_s)
    figures.recomputed_blocks = sum(
        job_chunks - count for req_id, count in engine.loaded.items() if req_id.startswith("load-")
    )
    return figures


# ----------------------------------------------------------------------- the run


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    chunk = int(args.chunk_mib * common.MIB)
    count = max(1, int(args.gib * common.GIB) // chunk // args.job_chunks)
    chunks = count * args.job_chunks
    cache_mode = common.cold_read_mode(args)
    engine = Engine(args, root)
    try:
        fs = common.FsTierShape(engine.kvtier)
        chunk = engine.adapter.spec.chunk_bytes
        measured = common.PathRun(args, fs, cache_mode, "cpu")
        measured.begin(engine.kvtier, root, chunks, chunk)
        texts = prompts(args.seed, count, args.job_chunks)
        idle_s = args.idle_ms / 1e3
        try:
            measured.phase("store", store_all, engine, texts, idle_s)
            engine.wipe()
            common.make_reads_cold(cache_mode, root / "tier")
            order = list(enumerate(texts))
            random.Random(args.seed).shuffle(order)
            engine.timing.start_phase("load")
            loads = measured.phase(
                "load",
                load_all,
                engine,
                order,
                args.job_chunks,
                args.in_flight,
                args.timeout_s,
                idle_s,
            )
        finally:
            measured.end(engine.kvtier)
        methods = {
            f"{layer}_ms_per_step_by_method": engine.timing.by_method(layer)
            for layer in LAYERS_TIMED
        }
    finally:
        engine.close()
    return {
        **measured.figures(root, chunks, chunk, loads.waits),
        "mismatches": engine.mismatches,
        "recomputed_blocks": loads.recomputed_blocks,
        "resident_requests": loads.resident_requests,
        **step_figures(engine.timing.times, wrapper_cost_s()),
        **methods,
        "kv_heads": args.kv_heads,
        "gpu_blocks": engine.num_blocks,
        "groups": args.groups,
        "window_blocks": args.window_blocks if args.groups > 1 else None,
        "tp": args.tp,
    }


def report(figures: dict[str, Any]) -> None:
    total = figures["chunks"] * figures["chunk_bytes"] / common.GIB
    print(
        f"vLLM path: {total:.2f} GiB of {figures['chunk_bytes'] / common.MIB:g} MiB blocks in "
        f"{figures['job_chunks']}-block prompts, {figures['in_flight']} requests in flight, "
        f"fs tier depth {figures['read_depth']} read / {figures['write_depth']} write, "
        f"page cache {figures['page_cache']}, KV tensors on {figures['device']}, "
        f"{figures['groups']} KV-cache group(s), TP={figures['tp']}"
    )
    common.print_path_summary(figures)
    print(
        f"  vLLM steps while loading: {figures['steps']}, p50 {figures['step_p50_ms']:.2f} ms, "
        f"p99 {figures['step_p99_ms']:.2f} ms, mean {figures['step_ms_mean']:.2f} ms; own time "
        f"per step: vLLM's connector {figures['connector_own_ms_per_step']:.3f} ms, kvtier's "
        f"adapter {figures['adapter_own_ms_per_step']:.3f} ms, kvtier "
        f"{figures['kvtier_own_ms_per_step']:.3f} ms (timing adds "
        f"{figures['timing_overhead_us_per_call']:.2f} us per call, left out)"
    )
    print(
        f"  loading: {figures['scheduler_s']:.2f} s in vLLM's scheduler, "
        f"{figures['model_runner_s']:.2f} s in the model runner (worker connector, block "
        f"checks), {figures['idle_s']:.2f} s waiting for tiers"
    )
    print(
        f"  {figures['mismatches']} mismatched blocks, {figures['recomputed_blocks']} "
        f"recomputed; CPU {figures['cpu_s_per_gib']:.2f} s per GiB"
    )
    common.print_json(figures)


def main(argv: Sequence[str] | None = None) -> None:
    report(common.run_in_scratch(run, parse_args(argv), "vllm_path.py"))


if __name__ == "__main__":
    main()
