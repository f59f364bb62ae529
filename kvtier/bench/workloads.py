"""Serving workloads for ``kvtier bench``: who asks for which prompt, in what order.

A prompt is a sequence of token blocks; a block is named by an integer, and a chunk's
key chains the hashes of every block before it, as a serving engine's prefix cache
does, so two prompts share keys exactly as long as they share a prefix. A workload is
a list of *waves*: the requests of one wave may run concurrently, and a wave starts
when the one before it has finished (a conversation's next round, a burst of forked
agents, the read pass after a write pass).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey, make_offload_key

__all__ = [
    "WORKLOADS",
    "BenchRequest",
    "Wave",
    "Workload",
    "WorkloadSize",
    "build_workload",
    "chain_keys",
]


@dataclass(frozen=True)
class BenchRequest:
    req_id: str
    #: The prompt's token blocks, one integer per chunk.
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Wave:
    requests: tuple[BenchRequest, ...]
    #: Empty the primary tier before the wave (what was written must come from below).
    reset_primary: bool = False


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    waves: tuple[Wave, ...]

    @property
    def requests(self) -> int:
        return sum(len(wave.requests) for wave in self.waves)

    @property
    def chunks_requested(self) -> int:
        return sum(len(r.blocks) for wave in self.waves for r in wave.requests)

    @property
    def unique_chunks(self) -> int:
        seen: set[tuple[int, ...]] = set()
        for wave in self.waves:
            for request in wave.requests:
                for end in range(1, len(request.blocks) + 1):
                    seen.add(request.blocks[:end])
        return len(seen)


@dataclass(frozen=True)
class WorkloadSize:
    """How big a workload is, in chunks; every shape below derives from it."""

    #: Distinct chunks the workload touches (its working set).
    working_set: int = 2048
    #: Longest prompt, in chunks.
    max_prompt: int = 64
    seed: int = 0


def chain_keys(blocks: Sequence[int]) -> list[OffloadKey]:
    """Chunk keys of a prompt: each hashes its block and the key before it."""
    keys: list[OffloadKey] = []
    parent = b""
    for block in blocks:
        parent = hashlib.blake2b(parent + block.to_bytes(8, "big"), digest_size=16).digest()
        keys.append(make_offload_key(parent))
    return keys


@dataclass
class _Blocks:
    """Hands out fresh block names: a new block is new content."""

    counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def take(self, count: int) -> tuple[int, ...]:
        return tuple(next(self.counter) for _ in range(count))


def multi_round_qa(size: WorkloadSize) -> Workload:
    """Users chat for several rounds under one system prompt; each round resends the
    history, which grows by a question and an answer."""
    rng, fresh = random.Random(size.seed), _Blocks()
    system = fresh.take(max(1, size.max_prompt // 8))
    turn = max(1, size.max_prompt // 16)
    rounds = max(2, (size.max_prompt - len(system)) // turn)
    users = max(1, (size.working_set - len(system)) // (rounds * turn))
    history = {user: system for user in range(users)}
    waves = []
    for round_ in range(rounds):
        requests = []
        for user in rng.sample(range(users), users):
            prompt = history[user] + fresh.take(turn)
            requests.append(BenchRequest(f"qa-u{user}-r{round_}", prompt))
            history[user] = prompt
        waves.append(Wave(tuple(requests)))
    return Workload(
        "multi-round-qa",
        f"{users} users x {rounds} rounds, {len(system)}-chunk system prompt, "
        f"+{turn} chunks per round",
        tuple(waves),
    )


def shared_prefix(size: WorkloadSize) -> Workload:
    """Groups of requests share a long prefix (a few-shot template, a tool schema) and
    differ in a short suffix; popular groups are asked more often."""
    rng, fresh = random.Random(size.seed), _Blocks()
    prefix_len = max(1, size.max_prompt * 3 // 4)
    suffix_len = max(1, size.max_prompt // 8)
    groups = max(1, size.working_set // (2 * prefix_len))
    prefixes = [fresh.take(prefix_len) for _ in range(groups)]
    count = max(groups, (size.working_set - groups * prefix_len) // suffix_len)
    weights = [1.0 / (rank + 1) for rank in range(groups)]  # Zipf: a few hot groups
    requests = []
    for i in range(count):
        group = rng.choices(range(groups), weights)[0]
        requests.append(BenchRequest(f"sp-{i}-g{group}", prefixes[group] + fresh.take(suffix_len)))
    return Workload(
        "shared-prefix",
        f"{count} requests over {groups} prefixes of {prefix_len} chunks (Zipf popularity)",
        (Wave(tuple(requests)),),
    )


def long_document_qa(size: WorkloadSize) -> Workload:
    """Long documents, each asked about several times in random order."""
    rng, fresh = random.Random(size.seed), _Blocks()
    doc_len = size.max_prompt
    docs = max(1, size.working_set // doc_len)
    repeats = 3
    order = [doc for doc in range(docs) for _ in range(repeats)]
    rng.shuffle(order)
    bodies = [fresh.take(doc_len - 1) for _ in range(docs)]
    requests = [
        BenchRequest(f"doc-{doc}-q{i}", bodies[doc] + fresh.take(1)) for i, doc in enumerate(order)
    ]
    return Workload(
        "long-doc-qa",
        f"{docs} documents of {doc_len} chunks, each asked {repeats} times",
        (Wave(tuple(requests)),),
    )


def cold_warm(size: WorkloadSize) -> Workload:
    """Write every chunk once, empty the primary tier, read everything back: the
    secondary tiers' bandwidth, with no reuse in between."""
    fresh = _Blocks()
    prompt_len = size.max_prompt
    count = max(1, size.working_set // prompt_len)
    prompts = [fresh.take(prompt_len) for _ in range(count)]
    write = tuple(BenchRequest(f"cold-{i}", p) for i, p in enumerate(prompts))
    read = tuple(BenchRequest(f"warm-{i}", p) for i, p in enumerate(prompts))
    return Workload(
        "cold-warm",
        f"{count} prompts of {prompt_len} chunks written, then read back from below",
        (Wave(write), Wave(read, reset_primary=True)),
    )


def agentic_fork(size: WorkloadSize) -> Workload:
    """An agent's long context, then a burst of sibling branches forked from it."""
    fresh = _Blocks()
    trunk = fresh.take(size.max_prompt)
    branch = max(1, size.max_prompt // 16)
    siblings = max(2, (size.working_set - len(trunk)) // branch)
    root = BenchRequest("agent-root", trunk)
    forks = tuple(
        BenchRequest(f"agent-fork-{i}", trunk + fresh.take(branch)) for i in range(siblings)
    )
    return Workload(
        "agentic-fork",
        f"one {len(trunk)}-chunk context, then {siblings} forks of +{branch} chunks at once",
        (Wave((root,)), Wave(forks)),
    )


def no_reuse(size: WorkloadSize) -> Workload:
    """Random prompts that share nothing: the cost of storing with no payback."""
    rng, fresh = random.Random(size.seed), _Blocks()
    requests: list[BenchRequest] = []
    total = 0
    while total < size.working_set:
        length = rng.randint(max(1, size.max_prompt // 4), size.max_prompt)
        requests.append(BenchRequest(f"random-{len(requests)}", fresh.take(length)))
        total += length
    return Workload(
        "no-reuse",
        f"{len(requests)} unrelated prompts of {size.max_prompt // 4}-{size.max_prompt} chunks",
        (Wave(tuple(requests)),),
    )


WORKLOADS: dict[str, Callable[[WorkloadSize], Workload]] = {
    "multi-round-qa": multi_round_qa,
    "shared-prefix": shared_prefix,
    "long-doc-qa": long_document_qa,
    "cold-warm": cold_warm,
    "agentic-fork": agentic_fork,
    "no-reuse": no_reuse,
}


def build_workload(name: str, size: WorkloadSize) -> Workload:
    try:
        return WORKLOADS[name](size)
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}"
        ) from None
