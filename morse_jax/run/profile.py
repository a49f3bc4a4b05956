"""Where a training step's wall time goes: seconds per phase, exclusive, adding up to the wall.

:class:`StepProfile` is plain Python (no JAX arrays): the train loop starts one per step and hands
it down explicitly (``Job.run_tasks`` -> orchestrator / sampler / route draw / verification), and
each place opens ``with profile.phase(name):`` around its work. Phases:

* ``plan``: the planner rounds' host work (prompts, parsing, repairs); their generation is counted
  in prefill / decode / compile, which run nested inside it.
* ``route``: the router's route draws (``Job.route``), results pulled to the host.
* ``prefill``: the sampler's prefill calls, blocked on their logits, and the token-healing
  restriction of the first token (``Sampler._generate_batch``).
* ``decode``: the rest of every ``generate`` call: the decode loop (each chunk is pulled to the
  host by its ``done`` flags, so device work is inside it), packing, stop strings, detokenizing.
* ``compile``: tracing, lowering and XLA compiling anywhere in the step (``jax.monitoring``
  duration events on the profiling thread), taken out of the phase it happened in.
* ``verify``: the wave's verification (``Job.verify_collective``): sandboxed test runs in the
  orchestrator's thread pool, waited for.
* ``update``: building the examples and ``Trainer.update`` (it returns host floats, so the
  optimiser's device work is done when it returns).
* ``checkpoint``: ``Checkpointer.save``'s blocking part (the write itself finishes asynchronously,
  overlapped with the next step).
* ``other``: wall - the sum of the above (metrics records, extraction of artifacts, Python glue);
  reported so the parts add up to the wall.

Phases nest and are exclusive: a phase's seconds are its elapsed time minus the phases (and
``add``-ed seconds) inside it, so no second is counted twice. Only the thread that called
``start`` records; phases opened on other threads are no-ops (work they overlap shows as the
main thread's waiting in the enclosing phase).

Idle share: 1 - (this process's CPU seconds, user + system, plus those of its waited-for
children: the sandboxed verifiers) / (wall x the cores this process may run on). Cores other
processes keep busy count as idle here: it says how much of the machine the step leaves unused,
not why.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator

PHASES = ("plan", "route", "prefill", "decode", "compile", "verify", "update", "checkpoint")
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

_running: list["StepProfile"] = []  # profiles between start() and stop(); compile events go to them
_listener_installed = False


def _on_duration(event: str, secs: float, **_) -> None:
    if event in COMPILE_EVENTS:
        for p in list(_running):
            p.add("compile", secs)


def _install_compile_listener() -> None:
    # jax.monitoring has no public way to remove a listener: one module-level listener forwards
    # to whichever profiles are running.
    global _listener_installed
    if not _listener_installed:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listener_installed = True


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_seconds() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def phase_of(profile: "StepProfile | None", name: str):
    """``profile.phase(name)``, or a no-op context without a profile."""
    return contextlib.nullcontext() if profile is None else profile.phase(name)


class StepProfile:
    """Seconds per phase of one step (see the module docstring).

    Args (for tests): clock: wall clock in seconds; cpu: () -> (own CPU s, children's CPU s);
    cores: cores available; compile_events: whether jax compile durations are recorded.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], tuple[float, float]] = _cpu_seconds, cores: int | None = None,
                 compile_events: bool = True):
        self.clock, self.cpu = clock, cpu
        self.cores = cores or available_cores()
        self.compile_events = compile_events
        self.seconds = {p: 0.0 for p in PHASES}
        self._stack: list[list] = []  # [name, start, seconds of nested phases]
        self._owner: int | None = None
        self._t0 = self._cpu0 = self._child0 = None
        self.wall = self.cpu_s = self.child_cpu_s = 0.0

    def start(self) -> "StepProfile":
        self._owner = threading.get_ident()
        self._t0 = self.clock()
        self._cpu0, self._child0 = self.cpu()
        if self.compile_events:
            _install_compile_listener()
            _running.append(self)
        return self

    def stop(self) -> "StepProfile":
        if self._t0 is None:
            raise RuntimeError("StepProfile.stop before start")
        if self._stack:
            raise RuntimeError(f"StepProfile.stop inside phase {self._stack[-1][0]!r}")
        if self in _running:
            _running.remove(self)
        self.wall = self.clock() - self._t0
        cpu, child = self.cpu()
        self.cpu_s, self.child_cpu_s = cpu - self._cpu0, child - self._child0
        self._owner = None
        return self

    def _records(self) -> bool:
        return self._owner is not None and threading.get_ident() == self._owner

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (exclusive of phases nested in it)."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r} (phases: {PHASES})")
        if not self._records():
            yield
            return
        entry = [name, self.clock(), 0.0]
        self._stack.append(entry)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = self.clock() - entry[1]
            self.seconds[name] += elapsed - entry[2]
            if self._stack:
                self._stack[-1][2] += elapsed

    def add(self, name: str, seconds: float) -> None:
        """``seconds`` measured elsewhere, spent inside the innermost open phase (taken out of it)."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r} (phases: {PHASES})")
        if not self._records():
            return
        self.seconds[name] += seconds
        if self._stack:
            self._stack[-1][2] += seconds

    @property
    def other(self) -> float:
        return self.wall - sum(self.seconds.values())

    @property
    def idle_share(self) -> float:
        used = (self.cpu_s + self.child_cpu_s) / max(self.wall * self.cores, 1e-9)
        return min(1.0, max(0.0, 1.0 - used))

    def record(self) -> dict[str, float]:
        """The metrics-record fields: ``time/<phase>_s`` for every phase and other, the wall,
        CPU seconds (own, children), cores and the idle share."""
        rec = {"time/wall_s": self.wall}
        rec.update({f"time/{p}_s": s for p, s in self.seconds.items()})
        rec.update({"time/other_s": self.other, "time/cpu_s": self.cpu_s, "time/child_cpu_s": self.child_cpu_s,
                    "time/cores": float(self.cores), "time/idle_share": self.idle_share})
        return rec

    def line(self) -> str:
        """One line: the wall = every phase of at least 0.05 s, largest first, then the idle share."""
        parts = sorted([*self.seconds.items(), ("other", self.other)], key=lambda kv: -kv[1])
        body = " + ".join(f"{p} {s:.1f}" for p, s in parts if abs(s) >= 0.05) or "0"
        return f"{self.wall:.1f} s = {body} | idle {100 * self.idle_share:.0f}% of {self.cores} cores"


def breakdown(records: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, mean seconds per step, share of the mean wall) over step records with
    ``time/*`` keys, phases then other, in :data:`PHASES` order."""
    if not records:
        return []
    n = len(records)
    wall = sum(r.get("time/wall_s", 0.0) for r in records) / n
    rows = []
    for p in (*PHASES, "other"):
        mean = sum(r.get(f"time/{p}_s", 0.0) for r in records) / n
        rows.append((p, mean, mean / wall if wall > 0 else 0.0))
    return rows
