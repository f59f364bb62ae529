"""examples/serve.py answering with the real SmolLM2 weights (``nox -s model``).

One server process serves the whole module (``server``), with ``--max-tokens 40`` so
that an answer without ``max_tokens`` stays short; the shutdown test starts its own,
since it stops it. Answers are a few tokens long: on two cores a token takes ~0.1 s.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from serve import CHUNK_TOKENS

from kvtier.bench.servers import free_port

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 40
URL = "/v1/chat/completions"
#: Greedy SmolLM2 counts on and on: an answer that runs to any max_tokens.
COUNT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]
SHORT = [{"role": "user", "content": "Name three fruits."}]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    def connect(self, timeout: float = 300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of one request."""
        connection = self.connect()
        try:
            headers = {"Content-Type": content_type} if content_type else {}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheader("Content-Type", ""), response.read()
        finally:
            connection.close()

    def chat(self, **body: Any) -> dict[str, Any]:
        status, _, answer = self.request("POST", URL, json.dumps(body).encode(), "application/json")
        assert status == 200, answer
        decoded: dict[str, Any] = json.loads(answer)
        return decoded

    def stream(self, **body: Any) -> list[Any]:
        """The events of a streamed answer, decoded; ``[DONE]`` as the string."""
        status, content_type, answer = self.request(
            "POST", URL, json.dumps({**body, "stream": True}).encode(), "application/json"
        )
        assert status == 200, answer
        assert content_type.startswith("text/event-stream")
        return events(answer.decode())

    def metric(self, name: str) -> float:
        _, _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.split()[-1])
        return total

    def log_text(self) -> str:
        return self.log.read_text()


def events(text: str) -> list[Any]:
    assert text.endswith("\n\n")
    decoded = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        decoded.append(data if data == "[DONE]" else json.loads(data))
    return decoded


def start_server(root: Path, *extra: str) -> Server:
    port = free_port()
    log = root / "serve.log"
    command = [sys.executable, str(ROOT / "examples" / "serve.py"), "--port", str(port)]
    command += ["--fs-dir", str(root / "fs"), "--primary-tokens", "4096", *extra]
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = Server(process, port, log)
    deadline = time.monotonic() + 600  # a first run converts the weights
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited early:\n{server.log_text()[-3000:]}")
        try:
            if server.request("GET", "/health")[0] == 200:
                return server
        except OSError:
            time.sleep(0.5)
    stop(server)
    raise AssertionError("the server was not ready within 600 s")


def stop(server: Server) -> int:
    server.process.send_signal(signal.SIGINT)
    try:
        return server.process.wait(timeout=60)
    finally:
        server.process.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("serve"), "--max-tokens", str(LIMIT))
    yield running
    stop(running)


def new_system_prompt() -> dict[str, str]:
    """A system prompt of several chunks that no earlier request sent."""
    words = " ".join(f"rule{i}" for i in range(40))
    return {
        "role": "system",
        "content": f"Session {uuid.uuid4().hex}. You answer in one short line. {words}",
    }


def cached(answer: dict[str, Any]) -> int:
    tokens: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def assert_no_traceback(server: Server) -> None:
    log = server.log_text()
    assert "Traceback" not in log and '" 500 ' not in log, log[-3000:]


# ---------------------------------------------------------------------- answers


def test_streamed_events_add_up_to_the_non_streamed_greedy_answer(server):
    answer = server.chat(messages=SHORT, max_tokens=12)
    streamed = server.stream(messages=SHORT, max_tokens=12)
    assert streamed[-1] == "[DONE]"
    chunks = streamed[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == answer["choices"][0]["message"]["content"] and text.strip()
    finish = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert finish[-1] == answer["choices"][0]["finish_reason"] == "length"
    assert set(finish[:-1]) == {None}
    # The last event carries the usage, cached tokens included, without being asked.
    assert chunks[-1]["usage"] == answer["usage"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("usage" not in chunk for chunk in chunks[:-1])


def test_include_usage_adds_a_last_chunk_with_the_usage_and_no_choices(server):
    streamed = server.stream(messages=SHORT, max_tokens=4, stream_options={"include_usage": True})
    assert streamed[-1] == "[DONE]"
    *chunks, last = streamed[:-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # under a chunk
    assert all(chunk["usage"] is None for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_greedy_answer_is_the_same_with_the_prefix_restored(server):
    messages = [new_system_prompt(), *SHORT]
    first = server.chat(messages=messages, max_tokens=12)
    again = server.chat(messages=messages, max_tokens=12, temperature=0)
    streamed = server.stream(messages=messages, max_tokens=12)
    assert cached(first) == 0
    assert cached(again) >= 2 * CHUNK_TOKENS and cached(again) % CHUNK_TOKENS == 0
    assert streamed[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(again)
    text = first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == text
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1]) == text


def test_sampling_with_a_seed_gives_the_same_answer_again(server):
    request = {"messages": SHORT, "max_tokens": 12, "temperature": 1.2, "top_p": 0.95}
    texts = {
        seed: [server.chat(**request, seed=seed)["choices"][0]["message"]["content"] for _ in "ab"]
        for seed in (1, 2, 3)
    }
    for first, second in texts.values():
        assert first == second
    greedy = server.chat(messages=SHORT, max_tokens=12)["choices"][0]["message"]["content"]
    # Three seeds of a sampled answer are not all the greedy one, nor all alike.
    assert len({first for first, _ in texts.values()} | {greedy}) > 1


def test_max_tokens_null_runs_to_the_servers_limit(server):
    answer = server.chat(messages=COUNT, max_tokens=None)
    assert answer["usage"]["completion_tokens"] == LIMIT
    assert answer["choices"][0]["finish_reason"] == "length"
    assert server.chat(messages=COUNT, max_completion_tokens=3)["usage"]["completion_tokens"] == 3
    status, _, body = server.request(
        "POST",
        URL,
        json.dumps({"messages": COUNT, "max_tokens": LIMIT + 1}).encode(),
        "application/json",
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"


def test_content_given_as_text_parts_is_answered_as_their_lines(server):
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    joined = [{"role": "user", "content": "Name a colour.\nOne word."}]
    from_parts = server.chat(messages=[{"role": "user", "content": parts}], max_tokens=6)
    from_text = server.chat(messages=joined, max_tokens=6)
    assert from_parts["choices"] == from_text["choices"]
    assert from_parts["usage"] == from_text["usage"]
    image = [*parts, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    status, _, body = server.request(
        "POST",
        URL,
        json.dumps({"messages": [{"role": "user", "content": image}]}).encode(),
        "application/json",
    )
    assert status == 400 and "'image_url'" in json.loads(body)["error"]["message"]


# ------------------------------------------------------------------------ errors


BAD = [
    ("POST", URL, b'{"messages": "\xff"}', "application/json", 400),
    ("POST", URL, b"{}", "application/json; charset=klingon", 415),
    (
        "POST",
        URL,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "application/json",
        400,
    ),
    ("POST", URL, b"[" * 50_000 + b"]" * 50_000, "application/json", 400),
    ("POST", URL, b"{" + b" " * (2 << 20) + b"}", "application/json", 413),
    ("POST", URL, b"{}", "text/plain", 415),
    ("POST", URL, b"not json", "application/json", 400),
    ("POST", "/v1/embeddings", b"{}", "application/json", 404),
    ("GET", URL, None, None, 405),
    ("DELETE", "/v1/models", None, None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "content_type", "status"), BAD)
def test_a_bad_request_gets_a_json_4xx_and_leaves_no_traceback(
    server, method, path, body, content_type, status
):
    got, answer_type, answer = server.request(method, path, body, content_type)
    assert got == status
    assert answer_type.startswith("application/json")
    error = json.loads(answer)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert_no_traceback(server)


# -------------------------------------------------------------------- the model


def disconnected_after(server: Server, skip: int) -> list[int]:
    """The tokens each disconnect the log reports had, but for the first ``skip``."""
    found = re.findall(r"client disconnected; stopped after (\d+) of", server.log_text())
    return [int(tokens) for tokens in found[skip:]]


def disconnects(server: Server) -> int:
    return len(disconnected_after(server, 0))


def test_a_streaming_client_that_leaves_frees_the_model(server):
    before = disconnects(server)
    connection = server.connect()
    body = json.dumps({"messages": COUNT, "stream": True})
    connection.request("POST", URL, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    read = 0
    while read < 3:  # the role, then two pieces of text
        line = response.readline()
        read += line.startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    tokens_before = server.metric("serve_completion_tokens_total")
    after = server.chat(messages=SHORT, max_tokens=3)
    assert after["usage"]["completion_tokens"] == 3
    [stopped] = disconnected_after(server, before)
    # It stopped on the disconnect, far short of the 40 tokens it could have had; the
    # tokens generated since are the next answer's and its own last few, no more.
    assert stopped < LIMIT // 2
    assert server.metric("serve_completion_tokens_total") - tokens_before < LIMIT // 2
    assert server.metric('serve_requests_total{outcome="client_disconnected"}') >= 1
    assert "client disconnected after" in server.log_text()  # the access log's line
    assert_no_traceback(server)


def test_a_waiting_client_that_leaves_mid_answer_frees_the_model(server):
    before = disconnects(server)
    started = server.metric("serve_completion_tokens_total")
    connection = server.connect()
    body = json.dumps({"messages": COUNT})
    connection.request("POST", URL, body=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 120
    while server.metric("serve_completion_tokens_total") == started:
        assert time.monotonic() < deadline, "the answer never started"
        time.sleep(0.05)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert server.chat(messages=SHORT, max_tokens=3)["usage"]["completion_tokens"] == 3
    [stopped] = disconnected_after(server, before)
    assert 1 <= stopped < LIMIT // 2
    assert_no_traceback(server)


def test_concurrent_requests_sharing_a_new_system_prompt_compute_it_once(server):
    system = new_system_prompt()
    questions = [f"Question {i}: name a fruit." for i in range(8)]

    def ask(question: str) -> dict[str, Any]:
        return server.chat(messages=[system, {"role": "user", "content": question}], max_tokens=2)

    hits_before = server.metric('kvtier_tiering_chunk_hits_total{tier="0:primary"}')
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(ask, questions))
    hits = [cached(answer) for answer in answers]
    assert sum(tokens >= 2 * CHUNK_TOKENS for tokens in hits) >= 7, hits
    assert hits.count(0) <= 1, hits
    primary = server.metric('kvtier_tiering_chunk_hits_total{tier="0:primary"}')
    assert primary - hits_before >= 7 * 2


# ------------------------------------------------------------------------ shutdown


def test_sigterm_with_answers_queued_exits_0_within_5_s_and_cleans_dev_shm(tmp_path):
    running = start_server(tmp_path)  # --max-tokens 512: each answer could take a minute
    results: list[tuple[int, bytes]] = []

    def ask(stream: bool) -> None:
        body = json.dumps({"messages": COUNT, "max_tokens": 512, "stream": stream}).encode()
        try:
            status, _, answer = running.request("POST", URL, body, "application/json")
            results.append((status, answer))
        except (OSError, http.client.HTTPException) as exc:
            results.append((0, repr(exc).encode()))

    try:
        clients = [threading.Thread(target=ask, args=(i % 2 == 0,)) for i in range(4)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        while running.metric("serve_completion_tokens_total") < 2:
            assert time.monotonic() < deadline, "no answer started"
            time.sleep(0.05)
        signalled = time.monotonic()
        running.process.send_signal(signal.SIGTERM)
        code = running.process.wait(timeout=60)
        took = time.monotonic() - signalled
        for client in clients:
            client.join(timeout=30)
    finally:
        running.process.kill()
    log = running.log_text()
    assert code == 0, log[-3000:]
    assert took < 5.0, f"{took:.1f} s"
    assert not list(Path("/dev/shm").glob(f"kvtier_serve-{running.process.pid}-*"))
    # The one generating stopped within a few of its 512 tokens; the queued ones were
    # turned away with a 503, the streamed one under way ends with an error event.
    [(stopped,)] = re.findall(r"stopped by the shutdown after (\d+) tokens", log)
    assert int(stopped) < 100
    assert len(results) == 4
    for status, answer in results:
        if status == 200:
            assert b'"shutting_down"' in answer and answer.endswith(b"data: [DONE]\n\n")
        else:
            assert status == 503 and json.loads(answer)["error"]["code"] == "shutting_down"
    assert "Traceback" not in log, log[-3000:]
