"""SciCode test targets: from the official ``test_data.h5`` or rebuilt from ground truth.

Split out of :mod:`morse_jax.tasks.scicode.family`, which re-exports every public name defined here.

* :class:`H5Targets` reads the official ``test_data.h5``.
* :class:`RebuiltTargets` runs the ground-truth code (plus upstream ground truth) on the test
  inputs in the sandbox, recording the values each assert compares (the same sandbox half of
  the tests that scoring runs), and takes as target the value compared with ``target``; results
  are cached on disk in the data-only wire format (never pickle).

Targets live only in this process: they never enter a sandbox (comparisons happen here).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Protocol, Sequence

from morse_jax.tasks.scicode.context import gold_upstream, join_program
from morse_jax.tasks.scicode.data import Problem, Step
from morse_jax.tasks.sandbox import wire_format
from morse_jax.tasks.scicode.compare import TestRewriteError
from morse_jax.tasks.scicode.harness import HARNESS_VERSION, ExecLimits, prepared_tests, run_step_tests, step_program

class TargetRebuildError(RuntimeError):
    """The target of a test cannot be rebuilt from ground truth (use the official test_data.h5)."""


# --------------------------------------------------------------------------------------------
# Target sources


class TargetSource(Protocol):
    def can_score(self, problem: Problem, step: Step) -> bool: ...

    def step_targets(self, problem: Problem, step: Step) -> tuple[Any, ...]:
        """The target of each test case of ``step`` (None where a test needs none)."""


class H5Targets:
    """Targets from the official SciCode ``test_data.h5`` (group ``<step>/test<k>``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"SciCode test data not found: {self.path}")
        try:
            import h5py  # optional dependency: only needed with the official targets
        except ImportError as e:
            raise ImportError("reading test_data.h5 needs h5py (pip install 'morse_jax[h5]')") from e
        self._h5py = h5py

    def can_score(self, problem: Problem, step: Step) -> bool:
        with self._h5py.File(self.path, "r") as f:
            return all(f"{step.step_id}/test{k + 1}" in f for k in range(len(step.test_cases)))

    def step_targets(self, problem: Problem, step: Step) -> tuple[Any, ...]:
        out = []
        with self._h5py.File(self.path, "r") as f:
            for k in range(len(step.test_cases)):
                path = f"{step.step_id}/test{k + 1}"
                if path not in f:
                    raise KeyError(f"{self.path}: no group {path}")
                out.append(self._test_value(f[path]))
        return tuple(out)

    # The layout read here is the one SciCode's own reader expects: a test group holds one
    # variable (the target) or several (a tuple, in key order); a variable is a dataset, or a
    # group holding "list", "sparse_matrix" or a dict of datasets.
    def _test_value(self, group):
        keys = list(group.keys())
        vals = [self._var(group[k]) for k in keys]
        return vals[0] if len(vals) == 1 else tuple(vals)

    def _var(self, obj):
        if isinstance(obj, self._h5py.Dataset):
            v = obj[()]
            return v.decode("utf-8") if isinstance(v, bytes) else v
        first = next(iter(obj.keys()), None)
        if first == "list":
            return [obj["list"][k][()] for k in obj["list"].keys()]
        if first == "sparse_matrix":
            return self._sparse(obj["sparse_matrix"])
        out = {}
        for k, v in obj.items():
            if isinstance(v, self._h5py.Group):
                out[k] = self._sparse(v["sparse_matrix"])
                continue
            val = v[()]
            if isinstance(val, bytes):
                out[k] = val.decode("utf-8")
                continue
            try:
                out[float(k)] = val
            except ValueError:
                out[k] = val
        return out

    @staticmethod
    def _sparse(g):
        import scipy.sparse as sps

        data, shape = g["data"][()], tuple(g["shape"][()])
        if "row" in g and "col" in g:
            return sps.coo_matrix((data, (g["row"][()], g["col"][()])), shape=shape)
        if "blocksize" in g:
            return sps.bsr_matrix((data, g["indices"][()], g["indptr"][()]), shape=shape,
                                  blocksize=tuple(g["blocksize"][()]))
        return sps.csr_matrix((data, g["indices"][()], g["indptr"][()]), shape=shape)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MORSE_JAX_CACHE", Path.home() / ".cache" / "morse_jax")) / "scicode"


class RebuiltTargets:
    """Targets rebuilt by running the ground truth (plus upstream ground truth) on the test inputs.

    Cached per test under ``cache_dir/<problem>/<step>/test<k>-<hash>.json`` (wire format); the hash covers the
    program, the test code and the harness, so edited data never reads a stale target.
    Only problems with ground-truth code (the 15 development problems) can be scored this way.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, limits: ExecLimits | None = None):
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.limits = limits or ExecLimits(timeout_s=1800.0, test_timeout_s=1200.0, memory_mb=4096,
                                           max_output_bytes=256 << 20)
        self.hits = 0  # steps served from the cache
        self.builds = 0  # steps rebuilt in the sandbox

    def can_score(self, problem: Problem, step: Step) -> bool:
        return step.ground_truth is not None and all(
            s.ground_truth is not None or s.supplied_code is not None for s in problem.steps_before(step.step_id))

    def _paths(self, problem: Problem, step: Step) -> tuple[str, list[Path]]:
        program = step_program(problem, join_program(gold_upstream(problem, step.step_id), step.step_id,
                                                     step.ground_truth))
        d = self.cache_dir / _safe(problem.problem_id) / _safe(step.step_id)
        paths = []
        for k, t in enumerate(step.test_cases):
            h = hashlib.sha256("\0".join([HARNESS_VERSION, program, t]).encode()).hexdigest()[:16]
            paths.append(d / f"test{k + 1}-{h}.json")
        return program, paths

    def step_targets(self, problem: Problem, step: Step) -> tuple[Any, ...]:
        if not self.can_score(problem, step):
            raise TargetRebuildError(f"step {step.step_id}: no ground-truth code to rebuild targets "
                                     f"from; provide the official test_data.h5")
        program, paths = self._paths(problem, step)
        if all(p.is_file() for p in paths):
            self.hits += 1
            return tuple(wire_format.loads(p.read_text(encoding="utf-8"), 1 << 40) for p in paths)
        try:
            tests = prepared_tests(step.test_cases, f"step {step.step_id} ")
        except TestRewriteError as e:
            raise TargetRebuildError(str(e)) from None
        rep = run_step_tests(program, tests, self.limits, where=f"step {step.step_id} ")
        self.builds += 1
        if rep.program_error:
            raise TargetRebuildError(f"step {step.step_id}: ground-truth program failed: {rep.program_error}")
        for k, err in enumerate(rep.errors):
            if err:
                raise TargetRebuildError(f"step {step.step_id} test {k + 1}: ground truth failed: {err}")
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for p, value in zip(paths, rep.targets):
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(wire_format.dumps(value), encoding="utf-8")
            os.replace(tmp, p)  # atomic: concurrent builders never read a half-written target
        return rep.targets


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def summarize(problems: Sequence[Problem], targets: TargetSource | None = None) -> dict[str, int]:
    """Counts of problems / testable steps / tests, and how many of them ``targets`` can score."""
    steps = [(p, s) for p in problems for s in p.testable_steps]
    out = {"problems": len(problems), "steps": len(steps),
           "tests": sum(len(s.test_cases) for _, s in steps),
           "problems_with_ground_truth": sum(p.has_ground_truth for p in problems)}
    if targets is not None:
        ok = [(p, s) for p, s in steps if targets.can_score(p, s)]
        out.update(scorable_steps=len(ok), scorable_tests=sum(len(s.test_cases) for _, s in ok),
                   scorable_problems=sum(all(targets.can_score(p, s) for s in p.testable_steps)
                                         for p in problems))
    return out
