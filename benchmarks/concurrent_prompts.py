"""Concurrent requests sharing a new system prompt, through ``examples/serve.py``.

The server is started as users start it (its own process, an fs tier under a fresh
directory) and sent ``--requests`` chat completions at once, every one with the same
system prompt, never seen before, and its own question. The server computes one
request at a time, and looks the cache up when a request reaches the model, so the
first computes the system prompt and stores it and the others restore it. The same
requests are then sent at once again, their prompts cached this time: the first
round's total time over the second's is what computing the shared prompt once costs.

    python benchmarks/concurrent_prompts.py --json out.json    # ~2 minutes on 2 cores

Part of ``benchmarks/real_model.py``'s report; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from kvtier.bench.servers import free_port

HERE = Path(__file__).resolve().parent
SERVE = HERE.parent / "examples" / "serve.py"

QUESTIONS = [
    "Do you repair electric bikes?",
    "Which bike suits a hilly commute?",
    "When are you open on Saturday?",
    "What does a service cost?",
    "Is a cargo bike heavy?",
    "Do you offer test rides?",
    "Can I wait in the shop?",
    "Do you sell helmets?",
    "Where can I park?",
    "Do I need an appointment?",
    "Is the chain included in a service?",
    "How long does a repair take?",
]

#: The first start converts the weights (about a minute on 2 cores); later starts
#: load the converted copy in seconds.
READY_LIMIT_S = 600.0


def handbook(rules: int) -> str:
    """A system prompt of ``rules`` numbered rules (about 30 tokens each), none repeated."""
    items = ["city bikes", "mountain bikes", "cargo bikes", "e-bikes", "tandems", "trailers"]
    lines = [
        f"Rule {rule}: for {items[rule % len(items)]}, quote {10 + rule % 37} euros for "
        f"check number {rule * 7 % 101}, and book it within {1 + rule % 5} days."
        for rule in range(1, rules + 1)
    ]
    return "\n".join(
        ["You are the help desk of a bicycle shop. Follow the handbook below.", *lines]
    )


@contextlib.contextmanager
def server(fs_dir: Path, log: Path, primary_tokens: int) -> Iterator[str]:
    """``examples/serve.py`` on a free loopback port; its base URL. Stopped with SIGINT."""
    port = free_port()
    command = [sys.executable, str(SERVE), "--port", str(port), "--fs-dir", str(fs_dir)]
    command += ["--primary-tokens", str(primary_tokens)]
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            finally:
                process.kill()


async def wait_ready(base: str) -> None:
    deadline = time.monotonic() + READY_LIMIT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{base}/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server at {base} was not ready within {READY_LIMIT_S} s")


async def send_at_once(
    base: str, system: str, questions: list[str], max_tokens: int
) -> tuple[float, list[dict[str, Any]]]:
    """Every question at once; the wall time until the last answer, and the answers."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def ask(question: str) -> dict[str, Any]:
            body = {
                "messages": messages(system, question),
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                answer: dict[str, Any] = await response.json()
                return answer

        started = time.perf_counter()
        answers = await asyncio.gather(*(ask(q) for q in questions))
        return time.perf_counter() - started, list(answers)


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both rounds; the report, with ``answers`` (the first round's, in question order)."""
    questions = QUESTIONS[: args.requests]
    system = handbook(args.rules)
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        log = Path(root) / "serve.log"
        with server(Path(root) / "fs", log, args.primary_tokens) as base:
            await wait_ready(base)
            # One request on another prompt first: the first forward passes pay for
            # one-time setup (allocator, kernels), which is not the shared prompt's cost.
            # It shares no chunk with the handbook, so it caches nothing the rounds use.
            await send_at_once(base, "Answer in one word.", ["Hello"], 4)
            new_s, new = await send_at_once(base, system, questions, args.max_tokens)
            cached_s, cached = await send_at_once(base, system, questions, args.max_tokens)
    reused = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in new]
    texts = [a["choices"][0]["message"]["content"] for a in new]
    again = [a["choices"][0]["message"]["content"] for a in cached]
    return {
        "requests": len(questions),
        "prompt_tokens": [a["usage"]["prompt_tokens"] for a in new],
        "max_tokens": args.max_tokens,
        "new_prompt_s": round(new_s, 2),
        "cached_prompt_s": round(cached_s, 2),
        "new_over_cached": round(new_s / cached_s, 3),
        "requests_reusing_the_prompt": sum(1 for tokens in reused if tokens > 0),
        "cached_tokens_new_round": reused,
        "answers_equal_across_rounds": texts == again,
        "system": system,
        "questions": questions,
        "answers": texts,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="requests sent at once (8)")
    parser.add_argument(
        "--rules", type=int, default=66, help="rules in the system prompt (66: about 2k tokens)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (64)")
    parser.add_argument(
        "--primary-tokens", type=int, default=16384, help="the server's primary tier (16384)"
    )
    parser.add_argument("--root", type=Path, default=None, help="where the fs tier writes")
    parser.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = parser.parse_args(argv)
    if not 2 <= args.requests <= len(QUESTIONS):
        parser.error(f"--requests must be in [2, {len(QUESTIONS)}]")
    return args


def main() -> None:
    args = parse_args()
    report = asyncio.run(measure(args))
    print(
        f"{report['requests']} requests at once, new system prompt: {report['new_prompt_s']} s; "
        f"cached: {report['cached_prompt_s']} s ({report['new_over_cached']}x); "
        f"{report['requests_reusing_the_prompt']} reused it"
    )
    for name in ("system", "questions", "answers"):
        del report[name]
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
