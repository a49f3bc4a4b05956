"""One wave's verification: artifacts extracted in the caller's thread, verified in a bounded pool.

A wave's candidates are numbered by their request index ``j`` (``0 <= j < n``). Each gets its
artifact extracted once (``extract(j, text)``, in the caller's thread: families read state their
``execute_messages`` left, which all ran before the wave's generation) and, unless extraction
failed, is verified once (``verify(j, artifact)``) in the pool. Two schedules:

* overlapped (``WaveVerification(..., pool)``): the sampler reports each finished micro-batch
  (:meth:`WaveVerification.arrive`, its ``on_ready`` hook); those candidates are extracted and
  submitted at once, so sandboxed runs go on while the sampler generates the next micro-batch.
* after generation (``pool=None``): everything is extracted in request order when generation
  returns (:meth:`complete`) and submitted by :meth:`gather` -- the order before overlap existed,
  and what a multi-process run uses (its ``verify_collective`` runs :meth:`gather` on process 0).

Either way :meth:`gather` returns the results in request order, so the settling that follows
(best candidate, first diagnostic, counters, rollout groups) and hence every reward and trace is
the same as sequential verification's. What the orchestrator awaits, and where: ``settle`` needs
every candidate of a call (best-of-grid, first diagnostic) and the next wave needs every call of
this one settled (a child's context is its parent's chosen artifact, a retry's prompt carries the
diagnostic, and the next wave's request list, hence the sampler's key use, must be the sequential
run's), so the one await point is the end of the wave's generation.

Threads, not processes: a verifier's own work is light (parse, gate, compare recorded values);
the untrusted code already runs in its own sandboxed child process (``tasks.sandbox``), where a
crash, hang or memory kill is contained and costs only that candidate. A thread blocks on that
child with the GIL released. Worker processes would have to pickle the families (SciCode's target
cache, the contexts ``execute_messages`` recorded) and would isolate nothing more. The pool's
``max_workers`` bounds the verifications, hence the sandboxes, in flight.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future
from typing import Callable, Sequence

from morse_jax.tasks.base import VerifyResult

# extract(j, completion text) -> (artifact, None) or ("", the failed result when extraction raised)
ExtractFn = Callable[[int, str], tuple[str, VerifyResult | None]]
# verify(j, artifact) -> (result, True when the verifier raised and the result stands in for it)
VerifyFn = Callable[[int, str], tuple[VerifyResult, bool]]


def verify_threads(workers: int) -> int:
    """Threads for ``OrchestratorConfig.verify_workers`` (0 = one per CPU this process may use:
    sandbox timeouts are wall-clock, so more runs than CPUs would make honest programs time out)."""
    if workers > 0:
        return workers
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return len(usable) if usable else (os.cpu_count() or 1)


class WaveVerification:
    """The extraction and verification of one wave's ``n`` candidates (see the module docstring).

    Args:
      n: candidates (requests) in the wave.
      extract, verify: per candidate index ``j``; see ``ExtractFn`` / ``VerifyFn``.
      pool: submit verifications as candidates arrive (overlapped), or None to submit them all
        in :meth:`gather`.
    """

    def __init__(self, n: int, extract: ExtractFn, verify: VerifyFn, pool: Executor | None = None):
        self.n, self._extract, self._verify, self._pool = n, extract, verify, pool
        self._texts: list[str | None] = [None] * n
        self.artifacts: list[str] = [""] * n
        self.failed: list[VerifyResult | None] = [None] * n  # extraction failures (never verified)
        self._futures: list[Future | None] = [None] * n

    def arrive(self, indices: Sequence[int], completions: Sequence) -> None:
        """Candidates the sampler finished (its ``on_ready``): extract each, in index order, and
        submit it to the pool when overlapping."""
        if len(indices) != len(completions):
            raise RuntimeError(f"on_ready got {len(indices)} indices for {len(completions)} completions")
        for j, comp in sorted(zip(indices, completions), key=lambda jc: jc[0]):
            if not 0 <= j < self.n or self._texts[j] is not None:
                raise RuntimeError(f"on_ready reported request {j} {'twice' if 0 <= j < self.n else 'out of range'}")
            self._texts[j] = comp.text
            self.artifacts[j], self.failed[j] = self._extract(j, comp.text)
            if self._pool is not None and self.failed[j] is None:
                self._futures[j] = self._pool.submit(self._verify, j, self.artifacts[j])

    def complete(self, completions: Sequence) -> None:
        """After generation: extract (and submit) the candidates not reported yet, in index order,
        and check the reported ones are the completions generation returned."""
        if len(completions) != self.n:
            raise RuntimeError(f"generation returned {len(completions)} completions for {self.n} requests")
        for j, comp in enumerate(completions):
            if self._texts[j] is None:
                self.arrive([j], [comp])
            elif self._texts[j] != comp.text:
                raise RuntimeError(f"on_ready reported a different completion for request {j} than generation returned")

    def gather(self, pool: Executor) -> list[tuple[VerifyResult, bool] | None]:
        """Every candidate's ``verify`` result in index order (None where extraction failed: see
        ``failed``), submitting to ``pool`` what is not submitted yet (all of it without overlap);
        blocks until all are verified."""
        for j in range(self.n):
            if self._texts[j] is None:
                raise RuntimeError(f"request {j} was never extracted (call complete() first)")
            if self.failed[j] is None and self._futures[j] is None:
                self._futures[j] = pool.submit(self._verify, j, self.artifacts[j])
        return [None if self._futures[j] is None else self._futures[j].result() for j in range(self.n)]
