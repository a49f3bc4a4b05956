"""The Colab notebooks under notebooks/ run top to bottom (executed with nbclient on CPU).

The quickstart notebook runs in the default set because CI must execute it: the whole loop (load,
plan, route, generate, verify, one HGRPO step, evaluate, checkpoint, report) on one SciCode
problem with the smallest budgets. At 48 new tokens the small model's code rarely parses, so the
step's rewards usually tie and its update is skipped: this test covers the notebook and the job's
plumbing; the update itself is covered by the rl/ tests. The ablation and analysis notebooks run several such jobs and
are marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from morse_jax.run.report import SCICODE_COLS, VARIANT_NAMES

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
NAMES = ("quickstart", "ablations", "analysis")
CELL_TIMEOUT_S = 1800  # one cell runs a whole job; a loaded 2-core machine is slow


def tiny_args(cache_dir: Path) -> list[str]:
    """Overrides that keep every stage of the loop but make it as small as it gets."""
    return ["--config.train.steps=1", "--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)",
            "--config.data.tasks_per_step=1", "--config.rollout.routes=2", "--config.rollout.candidates=2",
            "--config.rollout.max_new_tokens=48", "--config.rollout.eval_max_new_tokens=48",
            "--config.rollout.max_attempts=1", f"--config.data.cache_dir={cache_dir}"]


def results_header() -> str:
    """The start of the paper Table 1/2 header for SciCode, as morse_jax.run.report writes it."""
    return "| Variant | " + " | ".join(col[1] for col in SCICODE_COLS) + " |"


def parameters_cell(nb) -> nbformat.NotebookNode:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged 'parameters'"
    return code[0]


def execute(name: str, params: dict) -> nbformat.NotebookNode:
    """Run notebooks/<name>.ipynb with ``params`` overriding its parameters cell; returns the executed notebook.

    It starts in notebooks/, as a user opening the notebook does, so it must find the repo root itself.
    """
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    cell = parameters_cell(nb)
    names = {line.split("=", 1)[0].strip() for line in cell.source.splitlines() if "=" in line}
    assert set(params) <= names, f"{name}: unknown parameters {set(params) - names}"
    cell.source += "\n# injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def outputs(nb, mime: str) -> list[str]:
    """Every output of the notebook in ``mime`` ("stream" for printed text)."""
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if mime == "stream" and o.output_type == "stream":
                out.append(o.text)
            elif mime in o.get("data", {}):
                out.append(o.data[mime])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_clean_and_parametrised(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    parameters_cell(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{name}: committed with outputs"
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 4, f"{name}: explain the steps"


@pytest.mark.gguf
def test_quickstart_notebook_runs_the_whole_loop(tmp_path):
    workdir = tmp_path / "run"
    nb = execute("quickstart", {"WORKDIR": str(workdir), "EXTRA_ARGS": tiny_args(tmp_path / "cache")})

    for name in ("config.json", "metrics.jsonl", "report.md", "report.json"):
        assert (workdir / name).is_file(), name
    steps = [p for p in (workdir / "checkpoints").iterdir() if p.is_dir()]
    assert steps, "no checkpoint written"
    report = json.loads((workdir / "report.json").read_text())
    assert [e["variant"] for e in report["evals"]] == ["D"]
    assert len(report["train"]) == 1 and report["train"][0]["step"] == 1
    assert "reward.png" in report["plots"]

    text = "".join(outputs(nb, "stream"))
    assert "morse_jax: train variant=D" in text and "report: " in text  # the job's streamed output
    assert "reward_mean" in text  # last train metrics from metrics.jsonl
    markdown = "\n".join(outputs(nb, "text/markdown"))
    assert results_header() in markdown
    assert f"| {VARIANT_NAMES['D']} |" in markdown
    assert "![" not in markdown  # image links are shown as images instead
    assert len(outputs(nb, "image/png")) == len(report["plots"])


@pytest.mark.slow
@pytest.mark.gguf
def test_ablations_notebook(tmp_path):
    root = tmp_path / "ablations"
    nb = execute("ablations", {"WORKDIR_ROOT": str(root), "VARIANTS": ["A", "B", "C", "D"],
                               "EXTRA_ARGS": tiny_args(tmp_path / "cache")})
    for v in "ABCD":
        assert (root / v / "report.json").is_file(), v
    table = (root / "ablations.md").read_text()
    for v in "ABCD":
        assert f"| {VARIANT_NAMES[v]} |" in table
    assert results_header() in "\n".join(outputs(nb, "text/markdown"))
    assert (root / "ablation_rewards.png").is_file()
    assert len(outputs(nb, "image/png")) == 1


@pytest.mark.slow
@pytest.mark.gguf
def test_analysis_notebook_trains_then_diagnoses(tmp_path):
    workdir = tmp_path / "run"
    nb = execute("analysis", {"WORKDIR": str(workdir), "EXTRA_ARGS": tiny_args(tmp_path / "cache")})
    assert (workdir / "report.json").is_file() and (workdir / "checkpoints").is_dir()
    diag = json.loads((workdir / "diagnose.json").read_text())
    assert "heterogeneity" in diag and "checkpoint step 1" in diag["run"]["trainable"]
    assert "# Diagnostics" in "\n".join(outputs(nb, "text/markdown"))
    assert len(outputs(nb, "image/png")) == 3
