"""The MoRAgent job (``config.system="moragent"``): SFT of the variant's adapter on multi-role
trajectories, evaluation on the fixed BFCL subset, and the report.

``mode=train``: training data (``moragent.train_data``: the generated leakage-free set, or a JSON
Lines file in the multi-role format) -> SFT (``morse_jax.sft``, checkpoints in
``<workdir>/checkpoints``, resumed) -> evaluation -> report. ``mode=eval``: the latest checkpoint
(or the untrained adapter; the base variant has none) -> evaluation -> report.

Evaluation answers every item of ``moragent.eval_subset`` with the variant's protocol (base:
BFCL's own prompt, one greedy call; adapters: the role loop, the executor's calls scored) and
appends each verdict to ``<workdir>/bfcl_answers.jsonl``; ``bfcl_eval.json`` records the settings
those answers were made under and the summary. An evaluation with the same settings and the same
trained state resumes from (or re-reads) the answers file; any other starts it afresh.

``report.md`` / ``report.json``: the paper's Table 2 layout with one row per variant run beside
this one (the work directories ``<stem>_<variant>`` next to this one, evaluated under the same
settings), the per-category accuracies, and this run's facts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from morse_jax.config.variants import AGENT_VARIANTS, agent_variant_of, variant_dir
from morse_jax.models import load_backbone
from morse_jax.models.chat import stop_token_ids
from morse_jax.run.bfcl_eval import answer_direct, answer_roles, evaluate_items, read_answers, result_of
from morse_jax.run.build import resolve_model_path
from morse_jax.run.role_loop import RoleLoopConfig
from morse_jax.sampling.requests import SamplerConfig
from morse_jax.sampling.sampler import Sampler
from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl.subset import parse_subset, select_items

log = logging.getLogger("morse_jax.run.moragent")
ANSWERS, EVAL_RECORD = "bfcl_answers.jsonl", "bfcl_eval.json"


def loop_config(cfg) -> RoleLoopConfig:
    m = cfg.moragent
    return RoleLoopConfig(max_turns=m.max_turns, max_new_tokens=(
        ("reasoner", m.reasoner_max_new_tokens), ("executor", m.executor_max_new_tokens),
        ("summarizer", m.summarizer_max_new_tokens)), role_choice=m.role_choice, first_thought=m.first_thought,
                          no_call_bias=m.no_call_bias, executor=m.executor)


def eval_settings(cfg, trained_state: str) -> dict:
    """What an evaluation's answers depend on (two runs with equal settings give equal answers)."""
    m = cfg.moragent
    v = agent_variant_of(cfg)
    out = {"model": cfg.model.path, "dtype": cfg.model.dtype, "variant": cfg.variant, "protocol": v.protocol,
           "subset": list(m.eval_subset), "split": m.eval_split, "trained_state": trained_state}
    if v.protocol == "direct":
        out["max_new_tokens"] = m.direct_max_new_tokens
    else:
        out["role_loop"] = json.loads(json.dumps(loop_config(cfg).__dict__))
    return out


def comparable(settings: dict) -> dict:
    """The part of the settings every row of one report shares (not the variant, its protocol or state)."""
    return {k: settings.get(k, "test") if k == "split" else settings[k] for k in ("model", "dtype", "subset", "split")}


def sampler_config(cfg) -> SamplerConfig:
    """Buckets for BFCL prompts (up to 8k tokens: live items carry long function lists) and the
    answer budgets; batches up to ``sampler.max_batch``."""
    from morse_jax.config.derived import buckets_up_to

    d = SamplerConfig()
    m = cfg.moragent
    budget = max(m.direct_max_new_tokens, m.reasoner_max_new_tokens, m.executor_max_new_tokens,
                 m.summarizer_max_new_tokens)
    return SamplerConfig(batch_buckets=buckets_up_to(d.batch_buckets, cfg.sampler.max_batch),
                         prompt_buckets=buckets_up_to(d.prompt_buckets, 8192),
                         new_token_buckets=buckets_up_to(d.new_token_buckets, budget) if budget > max(
                             d.new_token_buckets) else d.new_token_buckets,
                         max_batch=cfg.sampler.max_batch, chunk=cfg.sampler.chunk, cpu_kernels=cfg.sampler.cpu_kernels,
                         block_weights=cfg.sampler.get("block_weights", "auto"),
                         prefill_rows=cfg.sampler.get("prefill_rows", 0))


class AgentJob:
    """The backbone, the variant's adapter (``role_adapter`` and its ``params``; None for base) and
    the sampler of one MoRAgent run."""

    def __init__(self, cfg, backbone=None):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir).expanduser()
        self.variant = agent_variant_of(cfg)
        t0 = time.time()
        self.backbone = backbone or load_backbone(resolve_model_path(cfg.model.path), jnp.dtype(cfg.model.dtype))
        if self.backbone.tokenizer is None:
            raise ValueError(f"config.model.path: {cfg.model.path} has no tokenizer; the job needs one")
        log.info("backbone loaded in %.1fs", time.time() - t0)
        self.stop_ids = stop_token_ids(self.backbone.tokenizer, self.backbone.config.eos_token_ids)
        self.key = jax.random.key(cfg.seed)
        self.role_adapter, self.params, self.trained_state = None, None, "none"
        self._scorer = None
        if self.variant.trains:
            from morse_jax.run.agent_training import build_adapter

            self.role_adapter, self.params = build_adapter(cfg, self.backbone, jax.random.fold_in(self.key, 1))
            self.trained_state = "untrained"
        self.sampler = Sampler(self.backbone, None, sampler_config(cfg), role_adapter=self.role_adapter)
        log.info("sampler native CPU kernels: %s", self.sampler.native_kernels)

    def generate(self, requests):
        self.key, sub = jax.random.split(self.key)
        return self.sampler.generate(self.params, requests, key=sub)

    def score(self, continuations):
        """Log-probabilities of continuations under the adapter (the role loop's decision scoring)."""
        if self._scorer is None:
            from morse_jax.run.continuation_scorer import ContinuationScorer

            self._scorer = ContinuationScorer(self.backbone, self.role_adapter.cfg)
        return self._scorer(self.params, continuations)

    def answer_fn(self):
        m = self.cfg.moragent
        tok = self.backbone.tokenizer
        if self.variant.protocol == "direct":
            return answer_direct(self.generate, tok, max_new_tokens=m.direct_max_new_tokens,
                                 stop_token_ids=self.stop_ids)
        return answer_roles(self.generate, tok, loop_config(self.cfg), stop_token_ids=self.stop_ids, score=self.score)

    def evaluate(self) -> tuple[list, dict]:
        """(verdicts, the settings record) on the configured subset, resuming a matching answers file."""
        settings = eval_settings(self.cfg, self.trained_state)
        record_path, answers = self.workdir / EVAL_RECORD, self.workdir / ANSWERS
        if answers.exists():
            old = json.loads(record_path.read_text()).get("settings") if record_path.exists() else None
            if old != settings:  # other settings or another trained state: those answers do not apply
                answers.replace(answers.with_suffix(".jsonl.old"))
                log.info("evaluation settings changed: previous answers moved to %s", answers.with_suffix(".jsonl.old"))
        record_path.write_text(json.dumps({"settings": settings}, indent=1))
        items = select_items(parse_subset(tuple(self.cfg.moragent.eval_subset)), self.cfg.moragent.eval_split)
        bar = tqdm(total=len(items), initial=len(read_answers(answers)), desc=f"bfcl {self.cfg.variant}",
                   unit="item", disable=None)
        try:
            results = evaluate_items(items, self.answer_fn(), answers_path=answers, batch=self.cfg.moragent.eval_batch,
                                     progress=bar.update)
        finally:
            bar.close()
        summary = bfcl.summarize(results)
        record_path.write_text(json.dumps({"settings": settings, "summary": summary}, indent=1))
        return results, settings


def sibling_rows(workdir: Path, cfg, settings: dict) -> dict[str, list]:
    """variant -> verdicts of the runs beside ``workdir`` (``<stem>_<variant>``, or the stem itself)
    evaluated under settings comparable to ``settings``, this run included, in AGENT_VARIANTS order."""
    stem = workdir.name
    for name in AGENT_VARIANTS:
        suffix = "_" + variant_dir(name)
        if cfg.variant == name and stem.endswith(suffix):
            stem = stem[:-len(suffix)]
    rows = {}
    for name in AGENT_VARIANTS:
        for d in (workdir.parent / f"{stem}_{variant_dir(name)}", workdir.parent / stem):
            rec = d / EVAL_RECORD
            if not rec.exists():
                continue
            data = json.loads(rec.read_text())
            s = data.get("settings", {})
            if s.get("variant") != name or "summary" not in data or comparable(s) != comparable(settings):
                continue
            done = read_answers(d / ANSWERS)
            rows[name] = [result_of(r) for r in done.values()]
            break
    return rows


def write_agent_report(workdir: Path, cfg, settings: dict, run_info: dict, train_info: dict | None) -> Path:
    """report.md / report.json: Table 2 layout over this run and its comparable siblings."""
    rows = sibling_rows(workdir, cfg, settings)
    subset = ", ".join(cfg.moragent.eval_subset) + (" (dev split)" if cfg.moragent.eval_split == "dev" else "")
    digest = hashlib.sha1(json.dumps(comparable(settings), sort_keys=True).encode()).hexdigest()[:8]
    lines = [f"# MoRAgent on BFCL v4 ({cfg.variant})", "",
             f"Fixed subset: {subset} (evenly spaced in BFCL's order; settings {digest}). BFCL v4 has no "
             "executable functions, so the paper's Non-live Exec column is absent and AVG averages the columns "
             "shown; v4 has 16 live_relevance items (the paper's version 18).", "",
             bfcl.table2_markdown(rows), "## This run", ""]
    lines += [f"- {k}: {v}" for k, v in run_info.items()]
    if train_info:
        lines += ["", "## Training", ""] + [f"- {k}: {v}" for k, v in train_info.items()]
    (workdir / "report.md").write_text("\n".join(lines) + "\n")
    (workdir / "report.json").write_text(json.dumps({
        "rows": {k: bfcl.summarize(v) for k, v in rows.items()}, "settings": settings, "run": run_info,
        "train": train_info}, indent=1, default=str))
    return workdir / "report.md"


def run_moragent(cfg, workdir: Path, *, t_start: float) -> int:
    """Modes train and eval of ``config.system="moragent"``: (SFT ->) evaluation -> report."""
    job = AgentJob(cfg)
    print(f"morse_jax: moragent {cfg.mode} variant={cfg.variant} ({job.variant.what}) model={job.backbone.source} "
          f"workdir={workdir}")
    train_info = None
    if job.variant.trains:
        from morse_jax.run.agent_training import restore_or_train

        train_info = restore_or_train(job, train=cfg.mode == "train")
        print("training: " + json.dumps(train_info, default=str))
    results, settings = job.evaluate()
    s = bfcl.summarize(results)
    print("eval: " + json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in s.items()
                                 if k not in ("categories", "counts")}))
    report = write_agent_report(workdir, cfg, settings, {
        "mode": cfg.mode, "variant": cfg.variant, "model": job.backbone.source, "items": len(results),
        "wall time (s)": round(time.time() - t_start, 1)}, train_info)
    print(f"report: {report}")
    return 0
