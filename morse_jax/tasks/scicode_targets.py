"""SciCode test targets: from the official ``test_data.h5`` or rebuilt from ground truth.

Split out of :mod:`morse_jax.tasks.scicode`, which re-exports every public name defined here.

* :class:`H5Targets` reads the official ``test_data.h5``.
* :class:`RebuiltTargets` runs the ground-truth code (plus upstream ground truth) on the test
  inputs in the sandbox, with each test rewritten by :func:`recording_test` to record the value
  it compares against ``target``; results are cached on disk.

Targets stay pickled bytes in this process; only the sandbox unpickles them.
"""

from __future__ import annotations

import ast
import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import Protocol

from morse_jax.tasks.scicode_code import gold_upstream, join_program
from morse_jax.tasks.scicode_data import Problem, Step
from morse_jax.tasks.scicode_harness import (HARNESS_VERSION, ExecLimits, _prepare_test, run_step_tests,
                                             step_program)

# --------------------------------------------------------------------------------------------
# Recording: tests rewritten so that the ground truth reports the values they compare


class TargetRebuildError(RuntimeError):
    """The target of a test cannot be rebuilt from ground truth (use the official test_data.h5)."""


def _target_key(node: ast.AST) -> tuple[bool, int | None]:
    if isinstance(node, ast.Name) and node.id == "target":
        return True, None
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "target"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
        return True, node.slice.value
    return False, None


def _record_sites(test: ast.expr) -> list[tuple[int | None, ast.expr]]:
    """(key, expression compared with target or target[key]) for each comparison in an assert."""
    sites = []
    for sub in ast.walk(test):
        pair = None
        if isinstance(sub, ast.Call) and not sub.keywords and len(sub.args) == 2:
            pair = sub.args
        elif isinstance(sub, ast.Compare) and len(sub.ops) == 1 and isinstance(sub.ops[0], ast.Eq):
            pair = [sub.left, sub.comparators[0]]
        if pair:
            keys = [_target_key(x) for x in pair]
            if keys[0][0] != keys[1][0]:
                i = 0 if keys[0][0] else 1
                sites.append((keys[i][1], pair[1 - i]))
    return sites


def recording_test(code: str, where: str) -> str:
    """Rewrite a test so each ``cmp(expr, target[i])`` records ``expr`` as target (index i).

    Covers ``np.allclose(x, target)``, ``cmp_tuple_or_list(x, target)``, ``x == target`` and
    ``... target[0] ... and ... target[1]``; asserts without ``target`` run unchanged. Anything
    else that reads ``target`` raises :class:`TargetRebuildError`.
    """
    tree = ast.parse(_prepare_test(code))

    class _Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node: ast.Assert):
            n_refs = sum(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(node.test))
            if not n_refs:
                return node
            sites = _record_sites(node.test)
            if len(sites) != n_refs:
                raise TargetRebuildError(f"{where}: cannot infer the target from `{ast.unparse(node)[:120]}`")
            return [ast.Expr(ast.Call(ast.Name("__record__", ast.Load()), [ast.Constant(k), e], []))
                    for k, e in sites]

    tree = ast.fix_missing_locations(_Rewrite().visit(tree))
    if any(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(tree)):
        raise TargetRebuildError(f"{where}: reads `target` outside an assert")
    return ast.unparse(tree)


# --------------------------------------------------------------------------------------------
# Target sources


class TargetSource(Protocol):
    def can_score(self, problem: Problem, step: Step) -> bool: ...

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        """One pickled target per test case of ``step`` (None where a test needs none)."""


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

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        out = []
        with self._h5py.File(self.path, "r") as f:
            for k in range(len(step.test_cases)):
                path = f"{step.step_id}/test{k + 1}"
                if path not in f:
                    raise KeyError(f"{self.path}: no group {path}")
                out.append(pickle.dumps(self._test_value(f[path]), protocol=4))
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

    Cached per test under ``cache_dir/<problem>/<step>/test<k>-<hash>.pkl``; the hash covers the
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
            paths.append(d / f"test{k + 1}-{h}.pkl")
        return program, paths

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        if not self.can_score(problem, step):
            raise TargetRebuildError(f"step {step.step_id}: no ground-truth code to rebuild targets "
                                     f"from; provide the official test_data.h5")
        program, paths = self._paths(problem, step)
        if all(p.is_file() for p in paths):
            self.hits += 1
            return tuple(p.read_bytes() for p in paths)
        tests = [recording_test(t, f"step {step.step_id} test {k + 1}") for k, t in enumerate(step.test_cases)]
        rep = run_step_tests(program, tests, self.limits)
        self.builds += 1
        if rep.program_error:
            raise TargetRebuildError(f"step {step.step_id}: ground-truth program failed: {rep.program_error}")
        for k, err in enumerate(rep.errors):
            if err:
                raise TargetRebuildError(f"step {step.step_id} test {k + 1}: ground truth failed: {err}")
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for p, blob in zip(paths, rep.targets):
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            os.replace(tmp, p)  # atomic: concurrent builders never read a half-written target
        return rep.targets


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
