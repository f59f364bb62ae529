"""The ``kvtier`` command's arguments: its parser, and a bad argument or file refused
in one line on stderr with exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtier import __version__

__all__ = ["MIB", "build_parser", "fail", "read_json_object", "spoken_list"]

MIB = 1 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtier: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def spoken_list(words: Sequence[str]) -> str:
    """``a, b and c``."""
    return " and ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else "".join(words)


def build_parser() -> argparse.ArgumentParser:
    from kvtier.bench import BENCH_TIERS, WORKLOADS

    parser = _Parser(prog="kvtier", description="Multi-tier KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    bench = commands.add_parser(
        "bench",
        help="replay a serving workload through the tiers and report hit rates and throughput",
        description="Replay a serving workload through KVTier (primary tier + secondary tiers) "
        "the way an async serving engine would, then report per-tier hit rates, GB/s, "
        "latency percentiles and event-loop lag against the disk and memory bandwidth "
        "measured in the same run. Without a GPU, CPU tensors stand in for it.",
    )
    bench.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="multi-round-qa",
        help="which workload to replay (default: multi-round-qa)",
    )
    bench.add_argument(
        "--tiers",
        default="fs",
        help="comma-separated secondary tiers, in lookup order, from "
        f"{spoken_list(BENCH_TIERS.names())} "
        "(default: fs); s3 starts a local S3 server, p2p a peer engine on loopback",
    )
    bench.add_argument(
        "--config",
        type=Path,
        help="JSON file of extra_config keys to apply; a secondary_tiers list there "
        "replaces --tiers (to benchmark real endpoints and peers)",
    )
    bench.add_argument(
        "--chunk-mib", type=_positive_float, default=1.0, help="bytes per chunk, MiB (1)"
    )
    bench.add_argument(
        "--primary-mib", type=_positive_int, default=1024, help="primary tier, MiB (1024)"
    )
    bench.add_argument(
        "--working-set-mib", type=_positive_int, default=3072, help="distinct data, MiB (3072)"
    )
    bench.add_argument(
        "--max-prompt-chunks", type=_positive_int, default=64, help="longest prompt (64)"
    )
    bench.add_argument(
        "--concurrency", type=_positive_int, default=4, help="requests in flight (4)"
    )
    bench.add_argument(
        "--duration", type=_positive_float, default=180.0, help="stop after this many seconds (180)"
    )
    bench.add_argument(
        "--root",
        type=Path,
        help="working directory: the fs tier (ROOT/fs), the local S3 server's data "
        "(ROOT/s3); new or empty unless --reuse-root; created if missing, its parent "
        "never (default: a temporary one, removed after the run)",
    )
    bench.add_argument(
        "--reuse-root",
        action="store_true",
        help="start from the cache an earlier run left in --root (a warm start: more hits)",
    )
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the workload's prompts and order: the same seed, the same requests (0)",
    )
    bench.add_argument(
        "--json", dest="json_path", type=Path, help="also write the report as JSON here"
    )
    bench.add_argument(
        "--plot",
        type=Path,
        help="draw hit rate and throughput over time, spans without a finished request "
        "shaded (idle: none in flight; stalled: some in flight) and the measured limits "
        "as lines (needs matplotlib)",
    )
    bench.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT"
    )
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")

    inspect = commands.add_parser(
        "inspect",
        help="list what an fs tier's root_dir holds; --verify checks every chunk",
        description="List the namespaces, chunk counts and bytes under an fs tier's root_dir. "
        "With --verify, read every chunk file and check its header and checksum.",
    )
    inspect.add_argument("root_dir", type=Path, help="the fs tier's root_dir")
    inspect.add_argument("--verify", action="store_true", help="check every file's checksum")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")

    plan = commands.add_parser(
        "plan",
        help="check a configuration and show the primary region it describes",
        description=textwrap.fill(
            "Validate an extra_config the way the engine reads it and print the chunk "
            "geometry and region size it yields, and the KV cache's bytes per block it "
            "was given or worked out from the model's shape."
        ),
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--config",
        type=Path,
        help="JSON file holding the extra_config (kv_connector_extra_config) mapping",
    )
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set one extra_config key (value parsed as JSON, else taken as a string); "
        "repeatable, applied after --config",
    )
    size = plan.add_argument_group(
        "the KV cache's size",
        textwrap.fill(
            "Give --kv-bytes-per-block, or the model's shape: --model-config, or --layers, "
            "--dtype and --kv-heads with --head-dim (--mla-latent-dim for an MLA model)."
        ),
    )
    size.add_argument(
        "--kv-bytes-per-block",
        type=_positive_int,
        metavar="BYTES",
        help="bytes ONE worker (tensor-parallel rank) holds for one GPU block, all layers: "
        "layers x 2 (K and V) x KV heads per rank x head size x dtype bytes x tokens "
        "per block (--tokens-per-block); an MLA model: layers x latent size x dtype "
        "bytes x tokens per block (the same on every rank). See the examples below",
    )
    size.add_argument(
        "--model-config",
        type=Path,
        metavar="PATH",
        help="the model's Hugging Face config.json, or its directory (a snapshot): the "
        "layers, KV heads, head size (or MLA latent) and dtype are read from it",
    )
    size.add_argument(
        "--layers", type=_positive_int, metavar="N", help="the model's attention layers"
    )
    size.add_argument(
        "--kv-heads",
        type=_positive_int,
        metavar="N",
        help="the model's KV heads, all ranks together (num_key_value_heads; without GQA, "
        "its attention heads); split over --world-size",
    )
    size.add_argument(
        "--head-dim", type=_positive_int, metavar="N", help="elements per head (head_dim)"
    )
    size.add_argument(
        "--mla-latent-dim",
        type=_positive_int,
        metavar="N",
        help="an MLA model's cached latent per token and layer: kv_lora_rank + "
        "qk_rope_head_dim (DeepSeek-V3: 512 + 64 = 576); in place of --kv-heads and "
        "--head-dim; every rank holds the same bytes",
    )
    size.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="the KV cache's dtype: bfloat16 (bf16), float16 (fp16), float32, fp8 "
        "(vLLM's --kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2); with --model-config, "
        "default (or auto): the model's torch_dtype",
    )
    plan.add_argument(
        "--tokens-per-block",
        type=_positive_int,
        default=16,
        metavar="N",
        help="tokens per GPU block: vLLM's --block-size, SGLang's --page-size (default: 16)",
    )
    plan.add_argument(
        "--world-size",
        "--tp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="workers sharing the engine's KV cache: its tensor-parallel size "
        "(vLLM's --tensor-parallel-size, SGLang's --tp-size; default: 1)",
    )
    plan.add_argument(
        "--engine-id",
        default="plan",
        help="the engine id the region is named after (/dev/shm/kvtier_<id>...); "
        "nothing is created (default: plan)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


_PLAN_EPILOG = """\
--kv-bytes-per-block, worked out (16-token blocks):
  Llama-3.1-8B, bf16, one GPU:  32 layers x 2 x 8 KV heads x 128 x 2 bytes x 16
                                = 2,097,152
  the same on 2 GPUs (--tp 2):  32 x 2 x 4 KV heads per rank x 128 x 2 x 16
                                = 1,048,576
  DeepSeek-V3, MLA, bf16:       61 layers x 576 latent x 2 bytes x 16 = 1,124,352
                                (on every rank)

examples:
  kvtier plan --model-config ./Llama-3.1-8B/config.json --tp 2 \\
      --set cpu_bytes_to_use=8e9
  kvtier plan --layers 32 --kv-heads 8 --head-dim 128 --dtype bf16 \\
      --set cpu_bytes_to_use=8e9
  kvtier plan --kv-bytes-per-block 2097152 --config extra.json
"""


def fail(message: str) -> NoReturn:
    print(f"kvtier: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        fail(f"{path} is not valid JSON: {exc}")
    if not isinstance(loaded, dict):
        fail(f"{path} must hold a JSON object (the extra_config mapping)")
    return loaded
