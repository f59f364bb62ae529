"""vLLM 0.33's scheduler and offloading connector run offline on CPU, with kvtier's spec.

What the vLLM benchmark (``vllm_path.py``) and the vLLM tests
(``tests/integrations/vllm``) share: vLLM's names, the tiny offline model config, the
engine's configuration, a KV cache sized by hand (one full-attention group, or a
hybrid model's groups overlaying each other as vLLM's hybrid allocator places them),
and the connector calls that frame a model runner's step. Each keeps its own model runner: the
tests write every token's KV, the benchmark a pattern per block.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Importing vLLM compiles a few kernels with torch, which warns about its own
# deprecations; they say nothing about kvtier (and the test suite turns warnings into
# errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "MAX_MODEL_LEN",
    "MLA_MODEL_DIR",
    "MODEL_DIR",
    "SPEC_CONFIG",
    "FullAttentionSpec",
    "KVCacheConfig",
    "MLAAttentionSpec",
    "MambaSpec",
    "ModelConfig",
    "ModelRunnerOutput",
    "OffloadingConnector",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "VllmConfig",
    "begin_step",
    "block_hasher",
    "end_step",
    "end_step_without_copies",
    "engine_config",
    "model_config",
    "offloading_config",
    "one_group_kv_cache",
    "overlaid_kv_cache",
    "scheduler",
    "worker_connector",
]

#: A tiny Llama config.json: it satisfies ModelConfig offline; the KV cache is sized by
#: hand, not from it.
MODEL_DIR = Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm" / "model"
#: A tiny DeepSeek-V2 config.json: a model vLLM runs with MLA (one latent KV per token
#: that every tensor-parallel rank holds alike).
MLA_MODEL_DIR = MODEL_DIR.with_name("mla_model")
MAX_MODEL_LEN = 2048  # the tiny config's max_position_embeddings
SPEC_CONFIG = {
    "spec_name": "KVTierOffloadingSpec",
    "spec_module_path": "kvtier.integrations.vllm",
}


def model_config(*, mla: bool = False) -> ModelConfig:
    """The offline model config (vLLM probes its architecture once per cache root):
    the tiny Llama, or with ``mla`` the tiny DeepSeek-V2."""
    return ModelConfig(
        model=str(MLA_MODEL_DIR if mla else MODEL_DIR),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=MAX_MODEL_LEN,
    )


def engine_config(
    model: ModelConfig,
    extra_config: dict[str, Any],
    *,
    engine_id: str,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    events: bool = False,
) -> VllmConfig:
    """A CPU engine whose ``OffloadingConnector`` loads kvtier's spec with ``extra_config``."""
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={**SPEC_CONFIG, **extra_config},
        ),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def one_group_kv_cache(
    num_blocks: int, layers: Sequence[str], attention: FullAttentionSpec
) -> KVCacheConfig:
    """``layers`` in one full-attention group, as vLLM's KV cache manager sizes them."""
    page = attention.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * len(layers),
                layers=list(layers),
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), attention)],
    )


def overlaid_kv_cache(
    num_blocks: int, groups: Sequence[tuple[Sequence[str], AttentionSpec | MambaSpec]]
) -> KVCacheConfig:
    """Several groups of as many layers each, of one page size, overlaying each other
    from byte 0 of one allocation: how vLLM's hybrid allocator places a model's full
    attention and sliding-window or Mamba layers (layer ``i`` of every group shares
    tensor ``i``; a block belongs to one group at a time)."""
    pages = {spec.page_size_bytes for _, spec in groups}
    counts = {len(layers) for layers, _ in groups}
    assert len(pages) == 1 and len(counts) == 1, "one page size, as many layers per group"
    page, count = pages.pop(), counts.pop()
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * count,
                layers=list(layers),
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for layers, _ in groups
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups],
    )


def block_hasher(block_size: int) -> Any:
    """vLLM's prefix hash of a request's blocks (sha256, as vLLM's default)."""
    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def scheduler(config: VllmConfig, kv_cache: KVCacheConfig) -> Scheduler:
    """vLLM's scheduler; its connector (scheduler role) builds kvtier's manager."""
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=config.cache_config.block_size,
        log_stats=True,
    )


def worker_connector(
    config: VllmConfig, kv_cache: KVCacheConfig, caches: dict[str, torch.Tensor]
) -> OffloadingConnector:
    """The worker-role connector over ``caches`` (one tensor per layer, block first)."""
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache)
    worker.register_kv_caches(caches)
    return worker


def begin_step(worker: OffloadingConnector, out: SchedulerOutput) -> None:
    """A model runner's connector calls before its forward pass: loads start."""
    meta = out.kv_connector_metadata
    assert meta is not None
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]


def end_step(
    worker: OffloadingConnector, out: SchedulerOutput, sampled: dict[str, list[int]]
) -> ModelRunnerOutput:
    """A model runner's connector calls after its forward pass, and its output."""
    worker.wait_for_save()
    finished_sending, finished_recving = worker.get_finished(out.finished_req_ids)
    worker_meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return runner_output(
        out,
        sampled,
        KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=worker_meta,
        ),
    )


def offloading_config(
    engine_id: str,
    extra: dict[str, Any],
    *,
    worker_kv_bytes_per_block: int,
    groups: int = 1,
    tokens_per_block: int = 16,
    blocks_per_chunk: int = 1,
    model: str = "tiny",
    world_size: int = 1,
    agnostic: bool = True,
    canonical_layout: bool = False,
    replicated_layout: bool = False,
    kv_cache_layout: str | None = "LBNHC",
) -> OffloadingConfig:
    """vLLM's normalized offloading config for the scheduler side of one engine (no
    parallelism unless ``world_size`` says): what ``OffloadingSpecFactory.create_spec``
    takes, without an engine around it. ``agnostic`` is what vLLM would have certified
    of the pages; the layout flags are the ones vLLM derives."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block, (f"model.layers.{i}.self_attn.attn",), i)
            for i in range(groups)
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=kv_cache_layout,
    )


def runner_output(
    out: SchedulerOutput, sampled: dict[str, list[int]], connector: KVConnectorOutput
) -> ModelRunnerOutput:
    """The model runner's output for ``out``: the tokens sampled, and the connector's."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(req_id, []) for req_id in req_ids],
        kv_connector_output=connector,
    )


def end_step_without_copies(
    out: SchedulerOutput, sampled: dict[str, list[int]], world_size: int = 1
) -> ModelRunnerOutput:
    """A model runner's output for a step whose transfer jobs all completed at once,
    without a worker: for running a spec's scheduler side alone (vLLM's own specs'
    workers need a GPU), where only which tokens hit matters, not their bytes. Every
    one of ``world_size`` ranks reports each job, as vLLM's executor aggregates them."""
    meta = out.kv_connector_metadata
    assert isinstance(meta, OffloadingConnectorMetadata)
    completed = dict.fromkeys([*meta.load_jobs, *meta.store_jobs], world_size)
    finished_recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
    return runner_output(
        out,
        sampled,
        KVConnectorOutput(
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=(
                OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
            ),
        ),
    )
