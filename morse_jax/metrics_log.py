"""Run metrics: one JSON object per line in ``metrics.jsonl`` plus TensorBoard event files."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any, Mapping


class MetricsWriter:
    """Append-only metrics log. Scalars also go to TensorBoard (``<workdir>/tb``)."""

    def __init__(self, workdir: str | Path, *, tensorboard: bool = True, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled  # False on processes other than 0 of a multi-process run
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(Path(workdir) / "tb"))
            except ImportError:  # optional: JSONL is the source of truth
                self._tb = None

    def write(self, metrics: Mapping[str, Any], *, step: int, kind: str) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, numbers.Number) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
            self._tb.flush()

    def read(self, kind: str | None = None) -> list[dict]:
        if not self.path.exists():
            return []
        recs = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in recs if kind is None or r.get("kind") == kind]

    def drop_after(self, step: int, kind: str) -> None:
        """Forget ``kind`` records past ``step`` (a resumed run re-does those steps)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in self.read() if r.get("kind") != kind or r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v
