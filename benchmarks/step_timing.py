"""Where the time of a vLLM scheduler step goes: vLLM's connector, kvtier's adapter and
kvtier's manager, each timed by wrapping its methods (for ``vllm_path.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import common

__all__ = [
    "CONNECTOR_METHODS",
    "LAYERS_TIMED",
    "MANAGER_METHODS",
    "CallClock",
    "StepClocks",
    "StepTimes",
    "step_figures",
    "wrapper_cost_s",
]


class CallClock:
    """Seconds spent inside some objects' methods since the last :meth:`take`.

    A call made from inside another timed call of the same clock counts once.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        #: Seconds by method name, over a whole phase (``Engine.start_phase`` resets them).
        self.by_name: dict[str, float] = {}
        self._depth = 0

    def wrap(self, obj: Any, names: Sequence[str]) -> None:
        for name in names:
            method = getattr(obj, name, None)
            if method is not None:
                setattr(obj, name, self._timed(name, method))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter
        by_name = self.by_name
        by_name[name] = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth = 1
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                took = clock() - started
                self.seconds += took
                by_name[name] += took
                self.calls += 1
                self._depth = 0

        return timed

    def take(self) -> tuple[float, int]:
        """Seconds and calls since the last call."""
        taken = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return taken


def wrapper_cost_s(calls: int = 200_000) -> float:
    """What one timed call adds, measured on a method that does nothing."""

    class Idle:
        def call(self) -> None:
            pass

    idle = Idle()
    plain = idle.call
    started = time.perf_counter()
    for _ in range(calls):
        plain()
    bare = time.perf_counter() - started
    CallClock().wrap(idle, ["call"])
    timed = idle.call
    started = time.perf_counter()
    for _ in range(calls):
        timed()
    return max(0.0, time.perf_counter() - started - bare) / calls


#: The scheduler-role connector's methods vLLM's scheduler calls.
CONNECTOR_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "take_events",
    "get_kv_connector_stats",
)
#: The manager interface vLLM's connector calls: on the adapter, and the same names on
#: kvtier's manager behind it.
MANAGER_METHODS = (
    "lookup",
    "get_load_source",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
    "has_pending_work",
    "take_events",
    "get_stats",
    "config_info",
    "reset_cache",
    "on_reset_flushed",
)


#: The layers timed inside a step, outermost first: vLLM's connector (which calls the
#: adapter), kvtier's adapter (which calls kvtier's manager), kvtier's manager.
LAYERS_TIMED = ("connector", "adapter", "kvtier")


@dataclass
class StepTimes:
    """Per step of one phase: vLLM's scheduler, and the time of each layer inside it."""

    step_s: list[float] = field(default_factory=list)
    layer_s: dict[str, list[float]] = field(
        default_factory=lambda: {layer: [] for layer in LAYERS_TIMED}
    )
    #: Timed calls per layer over the phase: each adds the timing's own cost to the
    #: layer above it.
    layer_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LAYERS_TIMED, 0))
    #: The model runner's half of each step: the worker connector and the "forward".
    runner_s: list[float] = field(default_factory=list)
    #: Waiting for a tier completion after steps in which nothing moved.
    idle_s: float = 0.0


class StepClocks:
    """The clocks of the layers timed inside each step, and each phase's step times."""

    def __init__(self, connector: Any, adapter: Any, kvtier: Any) -> None:
        self.clocks = {layer: CallClock() for layer in LAYERS_TIMED}
        self.clocks["connector"].wrap(connector, CONNECTOR_METHODS)
        self.clocks["adapter"].wrap(adapter, MANAGER_METHODS)
        self.clocks["kvtier"].wrap(kvtier, MANAGER_METHODS)
        self.times: dict[str, StepTimes] = {}
        self.phase = "store"

    @property
    def current(self) -> StepTimes:
        """The step times of the phase being timed."""
        return self.times.setdefault(self.phase, StepTimes())

    def start_phase(self, phase: str) -> None:
        """Time the steps from now on as ``phase``; the by-method times start again."""
        self.phase = phase
        for clock in self.clocks.values():
            for name in clock.by_name:
                clock.by_name[name] = 0.0

    def begin_step(self) -> None:
        for clock in self.clocks.values():
            clock.take()  # calls between steps (add_request, has_requests) are not a step's

    def end_step(self, step_s: float, runner_s: float) -> None:
        """The step took ``step_s`` in vLLM's scheduler, ``runner_s`` in the model runner."""
        times = self.current
        times.step_s.append(step_s)
        times.runner_s.append(runner_s)
        for layer, clock in self.clocks.items():
            seconds, calls = clock.take()
            times.layer_s[layer].append(seconds)
            times.layer_calls[layer] += calls

    def by_method(self, layer: str) -> dict[str, float]:
        """Milliseconds per step of this phase in each method of ``layer``, largest first."""
        steps = max(1, len(self.times.get(self.phase, StepTimes()).step_s))
        times = self.clocks[layer].by_name
        return {
            name: seconds / steps * 1e3
            for name, seconds in sorted(times.items(), key=lambda item: -item[1])
            if seconds
        }


def step_figures(times: dict[str, StepTimes], wrapper_s: float) -> dict[str, Any]:
    """Step time percentiles and each layer's time inside the steps, per phase.

    ``<layer>_ms_per_step`` is the time inside a layer's methods, the layers below it
    included; ``<layer>_own_ms_per_step`` leaves out the layer below and the cost of
    timing it, so the connector's, the adapter's and kvtier's own times add up.
    """
    out: dict[str, Any] = {}
    for phase, phase_times in times.items():
        steps = max(1, len(phase_times.step_s))
        total = sum(phase_times.step_s)
        prefix = "" if phase == "load" else f"{phase}_"
        out |= {
            f"{prefix}steps": len(phase_times.step_s),
            f"{prefix}step_p50_ms": common.percentile(phase_times.step_s, 0.5) * 1e3,
            f"{prefix}step_p99_ms": common.percentile(phase_times.step_s, 0.99) * 1e3,
            f"{prefix}step_ms_mean": total / steps * 1e3,
        }
        below = dict(zip(LAYERS_TIMED, [*LAYERS_TIMED[1:], None], strict=True))
        for layer, seconds in phase_times.layer_s.items():
            inner = below[layer]
            own = sum(seconds)
            if inner is not None:
                own -= sum(phase_times.layer_s[inner])
                own -= phase_times.layer_calls[inner] * wrapper_s
            out |= {
                f"{prefix}{layer}_ms_per_step": sum(seconds) / steps * 1e3,
                f"{prefix}{layer}_p99_ms": common.percentile(seconds, 0.99) * 1e3,
                f"{prefix}{layer}_own_ms_per_step": own / steps * 1e3,
                f"{prefix}{layer}_own_share": own / total if total else 0.0,
                f"{prefix}{layer}_calls": phase_times.layer_calls[layer],
                # Steps differ in how much they do (how many requests wait, how many
                # finish); a layer's own time per call of it compares across runs.
                f"{prefix}{layer}_own_us_per_call": own
                / max(1, phase_times.layer_calls[layer])
                * 1e6,
            }
        out |= {
            f"{prefix}scheduler_s": total,
            f"{prefix}model_runner_s": sum(phase_times.runner_s),
            f"{prefix}idle_s": phase_times.idle_s,
        }
    out["timing_overhead_us_per_call"] = wrapper_s * 1e6
    return out
