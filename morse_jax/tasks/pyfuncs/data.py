"""PyFuncs tasks: chains of 2-3 typed functions of distinct kinds plus a ``solve`` that composes them.

A task is drawn deterministically from its split and index (``random.Random("pyfuncs/<split>/<i>")``,
a string seed, stable across processes and Python hash seeds):

* 2 or 3 :class:`~morse_jax.tasks.pyfuncs.templates.FunctionSpec` s whose types chain
  (``f1: T0 -> T1``, ``f2: T1 -> T2``, ...) and whose kinds are pairwise distinct;
* ``solve(x) = fL(...f1(x))``, the merge step: implemented on top of the merged helpers;
* per function: 2 visible examples (in the prompt) and hidden tests (only in the verifier), each an
  input (``repr``, read back with ``ast.literal_eval`` in the sandbox) and the expected value,
  computed here by running the trusted reference code.

Splits: ``train`` and ``iid`` draw from the same templates with disjoint seeds (an iid task whose
text equals a train task's is dropped); ``ood`` tasks each contain at least one template of
:data:`~morse_jax.tasks.pyfuncs.templates.OOD_TEMPLATES`, which train and iid never use.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Sequence

from morse_jax.tasks.base import Task
from morse_jax.tasks.pyfuncs.templates import (OOD_TEMPLATES, TEMPLATE_LIST, TYPES, FunctionSpec, draw_spec,
                                               reference_function)

FAMILY = "pyfuncs"
SPLITS = ("train", "iid", "ood")
SPLIT_SIZES = {"train": 4000, "iid": 400, "ood": 400}  # tasks per split (more are never needed on CPU)
N_EXAMPLES, N_TESTS, N_SOLVE_TESTS = 3, 6, 5
SOLVE = "solve"


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: the input as a Python literal (``repr``) and the expected return value."""

    input_repr: str
    expected: Any


@dataclasses.dataclass(frozen=True)
class Step:
    """One plan node of a task: a function to write, its visible examples and hidden tests."""

    node_id: str
    spec: FunctionSpec
    examples: tuple[Case, ...]
    tests: tuple[Case, ...]


@dataclasses.dataclass(frozen=True)
class PyFuncsTask:
    """Payload of a PyFuncs :class:`~morse_jax.tasks.base.Task`: helper steps, then the solve step."""

    split: str
    index: int
    helpers: tuple[Step, ...]
    solve: Step

    @property
    def steps(self) -> tuple[Step, ...]:
        return (*self.helpers, self.solve)

    def step(self, node_id: str) -> Step:
        for s in self.steps:
            if s.node_id == node_id:
                return s
        raise KeyError(f"task {self.split}-{self.index}: no step {node_id!r}")

    @property
    def templates(self) -> tuple[str, ...]:
        return tuple(s.spec.template for s in self.helpers)


def _chain(rng: random.Random, pool: Sequence, length: int):
    """Templates t1..tL from ``pool``: types chain, kinds distinct, only t1 may read a source-only type."""
    for _ in range(200):
        first = rng.choice(pool)
        chain = [first]
        while len(chain) < length:
            nxt = [t for t in pool if t.in_type == chain[-1].out_type and TYPES[t.in_type][2] is not None
                   and t.kind not in {c.kind for c in chain}]
            if not nxt:
                break
            chain.append(rng.choice(nxt))
        if len(chain) == length:
            return chain
    raise RuntimeError("no template chain found")  # pragma: no cover -- the template set always has some


def _cases(rng: random.Random, spec_input, fn, n: int, *, informative: bool = False) -> tuple[Case, ...]:
    """n calls on random inputs; ``informative``: prefer inputs the function changes (an example
    where a string op leaves its input as it is shows the model nothing). The last case is redrawn
    (up to 50 times) while every expected value is the same, since then a function that ignores
    its input and returns that constant would pass every test."""
    out = []
    for i in range(n):
        x = spec_input(rng)
        for _ in range(20 if informative else 0):
            if fn(x) != x:
                break
            x = spec_input(rng)
        for _ in range(50 if i == n - 1 and n > 1 else 0):
            if any(repr(c.expected) != repr(fn(x)) for c in out):
                break
            x = spec_input(rng)
        out.append(Case(repr(x), fn(x)))
    return tuple(out)


def _compose(fns):
    def solve(x):
        for f in fns:
            x = f(x)
        return x
    return solve


def solve_spec(helpers: Sequence[FunctionSpec]) -> FunctionSpec:
    """The merge step's function: ``solve(x) = fL(...f1(x))`` over the helpers."""
    first, last = helpers[0], helpers[-1]
    call = first.param
    for h in helpers:
        call = f"{h.name}({call})"
    # The call written out as code to copy (calibration: answers dropped or reordered helpers).
    doc = f"Return `{call}`, calling the functions defined above (do not define them again)."
    header = f"def {SOLVE}({first.param}: {TYPES[first.in_type][0]}) -> {TYPES[last.out_type][0]}:"
    return FunctionSpec("compose", "compose", first.in_type, last.out_type, SOLVE, doc,
                        f"{header}\n    return {call}\n", ())


@functools.lru_cache(maxsize=None)
def make_task(split: str, index: int) -> Task:
    """Task ``index`` of ``split``; the same (split, index) always gives the same task."""
    if split not in SPLITS:
        raise ValueError(f"pyfuncs split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{FAMILY}/{split}/{index}")
    length = rng.choice((2, 3))
    if split == "ood":
        while True:
            chain = _chain(rng, TEMPLATE_LIST, length)
            if any(t.key in OOD_TEMPLATES for t in chain):
                break
    else:
        chain = _chain(rng, [t for t in TEMPLATE_LIST if t.key not in OOD_TEMPLATES], length)
    specs = [draw_spec(t, rng) for t in chain]
    fns = [reference_function(s.reference, s.name) for s in specs]
    helpers = tuple(Step(f"f{i + 1}", s, _cases(rng, s.make_input, f, N_EXAMPLES, informative=True),
                         _cases(rng, s.make_input, f, N_TESTS))
                    for i, (s, f) in enumerate(zip(specs, fns)))
    solve = _compose(fns)
    sspec = solve_spec(specs)
    solve_step = Step(SOLVE, sspec, _cases(rng, specs[0].make_input, solve, N_EXAMPLES, informative=True),
                      _cases(rng, specs[0].make_input, solve, N_SOLVE_TESTS))
    payload = PyFuncsTask(split, index, helpers, solve_step)
    return Task(f"{split}-{index:05d}", task_description(payload), FAMILY, payload)


def task_description(p: PyFuncsTask) -> str:
    lines = [f"Write a small Python program: {len(p.helpers)} helper functions and a function "
             f"`{SOLVE}` that chains them."]
    lines += [f"- `{s.spec.header[4:-1]}`: {s.spec.doc}" for s in p.steps]
    return "\n".join(lines)


def load_split(split: str, n: int = 0) -> list[Task]:
    """The first ``n`` tasks of ``split`` (0: all SPLIT_SIZES[split]); iid tasks that repeat a
    train task's text are skipped, so the iid list holds n tasks no train task equals."""
    if split not in SPLITS:
        raise ValueError(f"pyfuncs split must be one of {SPLITS}, got {split!r}")
    size = SPLIT_SIZES[split]
    n = size if n <= 0 else min(n, size)
    seen = _train_texts() if split == "iid" else frozenset()
    out, i = [], 0
    while len(out) < n and i < 4 * size:
        t = make_task(split, i)
        i += 1
        if t.description not in seen:
            out.append(t)
    return out


@functools.lru_cache(maxsize=1)
def _train_texts() -> frozenset:
    return frozenset(make_task("train", i).description for i in range(SPLIT_SIZES["train"]))
