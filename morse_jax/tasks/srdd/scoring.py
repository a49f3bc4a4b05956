"""SRDD scoring: the sandboxed smoke run, the training reward (Eq. 11) and ECI evaluation (Eq. 14).

Split out of :mod:`morse_jax.tasks.srdd.family`, which re-exports every public name defined here.

* Smoke run: ``python main.py`` with stdin closed, in :mod:`morse_jax.tasks.sandbox.runner` (imported
  lazily); a time-out or an EOFError on input counts as running (:func:`classify_run`).
* Training reward, behind the gate "main.py runs": 0.5*r_exec + 0.5*r_comp +
  1.0*(0.7*cons(task, code) + 0.3*cons(subtask, code)), cons lexical (:func:`score_codebase`).
* Evaluation: per-codebase r_exec, r_comp and an embedding-cosine r_cons (:class:`SRDDScores`),
  summarised as Exec and ECI (:func:`eci_summary`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from morse_jax.tasks.base import VerifyResult
from morse_jax.tasks.srdd.analysis import codebase_text, completeness, find_placeholders, lexical_cosine
from morse_jax.tasks.srdd.codebase import clean_filename


# ============================================================================ running


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """Classified smoke run of ``python main.py`` (stdin closed).

    ``ran``: exited 0, hit the time limit, or stopped on EOFError while reading input.
    ``reason``: "exit0" | "timeout" | "eof" | "no_main" | "invalid" | "syntax" | "crash" | "killed".
    """

    ran: bool
    reason: str
    detail: str = ""


def _tail(text: str, n_lines: int = 15, n_chars: int = 1500) -> str:
    return "\n".join(text.strip().splitlines()[-n_lines:])[-n_chars:]


def _last_exception(stderr: str) -> str:
    for ln in reversed(stderr.strip().splitlines()):
        if ln and not ln.startswith((" ", "\t", "[sandbox:")):
            return ln.strip()
    return ""


def _precheck(files: Mapping[str, str]) -> RunOutcome | None:
    if "main.py" not in files:
        return RunOutcome(False, "no_main", "no main.py entry point in the codebase"
                          + (f" (files: {', '.join(sorted(files))})" if files else " (no code found)"))
    bad = [f for f in files if clean_filename(f) != f]
    if bad:
        return RunOutcome(False, "invalid", f"unsafe file names {bad}")
    try:  # compiling never runs the code; deep nesting can exhaust the parser, hence the extras
        compile(files["main.py"], "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return RunOutcome(False, "syntax", f"main.py does not compile: {e}")
    return None


def classify_run(result) -> RunOutcome:
    """Map the ``SandboxResult`` of ``python main.py`` to a :class:`RunOutcome`."""
    if result.timed_out:
        return RunOutcome(True, "timeout", "still running at the time limit (counts as running)")
    if result.returncode == 0:
        return RunOutcome(True, "exit0", "")
    last = _last_exception(result.stderr or "")
    if last.startswith("EOFError"):
        return RunOutcome(True, "eof", "stopped waiting for input (stdin closed; counts as running)")
    if getattr(result, "signal", None):
        return RunOutcome(False, "killed", f"killed by signal {result.signal} "
                                           f"(memory or process limit?)\n{_tail(result.stderr or '')}")
    return RunOutcome(False, "crash", f"`python main.py` failed (exit status {result.returncode}):\n"
                                      f"{_tail(result.stderr or '') or '(no output on stderr)'}")


def _run_kwargs(files: Mapping[str, str], timeout_s: float, memory_mb: int) -> dict:
    # code=None: the sandbox runs `python -s main.py` from the codebase directory, stdin /dev/null.
    return dict(code=None, files=dict(files), timeout_s=timeout_s, memory_mb=memory_mb, stdin=None)


def smoke_run(files: Mapping[str, str], *, timeout_s: float = 3.0, memory_mb: int = 2048) -> RunOutcome:
    """Run ``python main.py`` of a codebase in the sandbox, stdin closed, for ``timeout_s``."""
    pre = _precheck(files)
    if pre is not None:
        return pre
    from morse_jax.tasks.sandbox import runner as sandbox  # noqa: PLC0415

    return classify_run(sandbox.run_python(**_run_kwargs(files, timeout_s, memory_mb)))


def smoke_run_many(codebases: Sequence[Mapping[str, str]], *, timeout_s: float = 3.0,
                   memory_mb: int = 2048, max_workers: int = 2) -> list[RunOutcome]:
    """:func:`smoke_run` over many codebases, ``max_workers`` sandboxes at a time."""
    outcomes: list[RunOutcome | None] = [_precheck(f) for f in codebases]
    todo = [i for i, o in enumerate(outcomes) if o is None]
    if todo:
        from morse_jax.tasks.sandbox import runner as sandbox  # noqa: PLC0415

        results = sandbox.run_many([_run_kwargs(codebases[i], timeout_s, memory_mb) for i in todo],
                                   max_workers=max_workers, isolate_failures=True)
        for i, r in zip(todo, results):
            outcomes[i] = classify_run(r)
    return outcomes  # type: ignore[return-value]


# ============================================================================ reward


@dataclasses.dataclass(frozen=True)
class SRDDRewardConfig:
    """Training-reward settings (paper Appendix I defaults).

    ``use_gate=False`` reproduces the authors' code, where a crashing program still earns the
    completeness and consistency terms (its VerifyResult then always has ``gate=True``).
    """

    w_exec: float = 0.5
    w_comp: float = 0.5
    w_cons: float = 1.0
    cons_task_share: float = 0.7  # the node's subtask gets 1 - this
    smoke_timeout_s: float = 3.0
    memory_mb: int = 2048
    use_gate: bool = True
    completeness_mode: str = "ast"

    def __post_init__(self):
        for f in ("w_exec", "w_comp", "w_cons", "smoke_timeout_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"SRDDRewardConfig.{f} must be a finite number >= 0, got {v!r}")
        if not 0.0 <= self.cons_task_share <= 1.0:
            raise ValueError(f"SRDDRewardConfig.cons_task_share must be in [0, 1], got {self.cons_task_share!r}")
        if self.smoke_timeout_s <= 0:
            raise ValueError("SRDDRewardConfig.smoke_timeout_s must be > 0")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 64:
            raise ValueError(f"SRDDRewardConfig.memory_mb must be an int >= 64, got {self.memory_mb!r}")
        if self.completeness_mode not in ("ast", "line_rule"):
            raise ValueError("SRDDRewardConfig.completeness_mode must be 'ast' or 'line_rule', "
                             f"got {self.completeness_mode!r}")


def score_codebase(task_text: str, subtask_text: str, files: Mapping[str, str], outcome: RunOutcome,
                   cfg: SRDDRewardConfig = SRDDRewardConfig()) -> VerifyResult:
    """The training reward of a codebase whose smoke run gave ``outcome`` (pure, no execution).

    Components: exec = r_exec, comp = r_comp, cons = 0.7*cons(task) + 0.3*cons(subtask)
    (lexical). All three are reported even when the gate fails.
    """
    code = codebase_text(files, stripped=True)
    r_exec = 1.0 if outcome.ran else 0.0
    r_comp = completeness(files, mode=cfg.completeness_mode)
    r_cons = (cfg.cons_task_share * lexical_cosine(task_text, code)
              + (1.0 - cfg.cons_task_share) * lexical_cosine(subtask_text, code))
    comps = {"exec": r_exec, "comp": r_comp, "cons": r_cons}
    notes = []
    if r_comp == 0.0 and cfg.completeness_mode == "ast":
        notes.append("placeholders: " + "; ".join(find_placeholders(files)[:5]))
    if cfg.use_gate and not outcome.ran:
        return VerifyResult(gate=False, reward=0.0, diagnostic=outcome.detail, components=comps)
    reward = cfg.w_exec * r_exec + cfg.w_comp * r_comp + cfg.w_cons * r_cons
    diag = "; ".join(([outcome.detail] if not outcome.ran else []) + notes)
    return VerifyResult(gate=True, reward=float(reward), diagnostic=diag, components=comps)


def srdd_reward(task_text: str, subtask_text: str, files: Mapping[str, str],
                cfg: SRDDRewardConfig = SRDDRewardConfig()) -> VerifyResult:
    """Gate + training reward of one codebase (runs main.py in the sandbox)."""
    outcome = smoke_run(files, timeout_s=cfg.smoke_timeout_s, memory_mb=cfg.memory_mb)
    return score_codebase(task_text, subtask_text, files, outcome, cfg)


# ============================================================================ evaluation (ECI)


@dataclasses.dataclass(frozen=True)
class SRDDScores:
    """Per-codebase evaluation components, each in [0, 1]: r_exec, r_comp, r_cons."""

    exec: float
    comp: float
    cons: float

    def __post_init__(self):
        for f in ("exec", "comp", "cons"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"SRDDScores.{f} must be in [0, 1], got {v!r}")


def eci_summary(scores: Sequence[SRDDScores]) -> dict[str, float]:
    """Suite metrics (paper Eq. 14): Exec = mean r_exec; ECI mean = mean of (r_exec + r_comp +
    r_cons)/3; ECI product = mean of r_exec*r_comp*r_cons. Averages are over codebases."""
    if not scores:
        raise ValueError("scores: ECI needs at least one codebase")
    n = len(scores)
    return {
        "n": float(n),
        "exec": sum(s.exec for s in scores) / n,
        "eci_mean": sum((s.exec + s.comp + s.cons) / 3.0 for s in scores) / n,
        "eci_product": sum(s.exec * s.comp * s.cons for s in scores) / n,
    }


def embedding_consistency(embedder, descriptions: Sequence[str], codebases: Sequence[Mapping[str, str]],
                          batch_size: int = 32) -> list[float]:
    """Embedding cosine of each description with its stripped code, clipped to [0, 1] (ECI is
    [0, 1]-valued; a codebase with no Python code scores 0)."""
    codes = [codebase_text(f, stripped=True) for f in codebases]
    sims = embedder.cosine(list(descriptions), codes, batch_size=batch_size)
    return [min(1.0, max(0.0, float(s))) if c.strip() else 0.0 for s, c in zip(sims, codes)]


def evaluate_codebases(descriptions: Sequence[str], codebases: Sequence[Mapping[str, str]], embedder, *,
                       timeout_s: float = 3.0, memory_mb: int = 2048, max_workers: int = 2,
                       completeness_mode: str = "ast") -> list[SRDDScores]:
    """ECI components of each final codebase: r_exec from a sandboxed run (time-out and EOF count
    as running), r_comp (placeholders), r_cons (embedding cosine with ``embedder``, e.g.
    :class:`morse_jax.tasks.embedding.SentenceEmbedder`)."""
    if len(descriptions) != len(codebases):
        raise ValueError(f"descriptions and codebases differ in length: {len(descriptions)} vs {len(codebases)}")
    outcomes = smoke_run_many(codebases, timeout_s=timeout_s, memory_mb=memory_mb, max_workers=max_workers)
    cons = embedding_consistency(embedder, descriptions, codebases)
    return [SRDDScores(exec=1.0 if o.ran else 0.0, comp=completeness(f, mode=completeness_mode), cons=c)
            for o, f, c in zip(outcomes, codebases, cons)]
