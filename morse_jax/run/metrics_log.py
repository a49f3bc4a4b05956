"""Run metrics: one JSON object per line in ``metrics.jsonl`` plus TensorBoard event files."""

from __future__ import annotations

import json
import logging
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)


class MetricsWriter:
    """Append-only metrics log. Scalars also go to TensorBoard (``<workdir>/tb``)."""

    def __init__(self, workdir: str | Path, *, tensorboard: bool = True, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled  # False on processes other than 0 of a multi-process run
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_cut_line()
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
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")  # one write of one line: a kill cuts at most this line
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, numbers.Number) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
            self._tb.flush()

    def _drop_cut_line(self) -> None:
        # A kill during write() can leave a last line without its newline; appending after it
        # would glue the next record onto it. Cut the file back to its last complete line.
        if not self.path.exists():
            return
        with self.path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            keep = size - len(tail) + tail.rfind(b"\n") + 1
            log.warning("%s: last line is incomplete (interrupted write), dropped: %r", self.path,
                        tail[keep - size:][:80])
            f.truncate(keep)

    def read(self, kind: str | None = None) -> list[dict]:
        """The records, oldest first. A last line without its newline was cut by a kill during
        :meth:`write` and is skipped (with a warning); a bad line elsewhere raises, naming it."""
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        cut = lines.pop()  # "" when the file ends with a newline
        if cut.strip():
            log.warning("%s: last line is incomplete (interrupted write), ignored: %r", self.path, cut[:80])
        recs = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}:{lineno}: not a JSON record ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{self.path}:{lineno}: a record must be a JSON object")
            recs.append(rec)
        return [r for r in recs if kind is None or r.get("kind") == kind]

    def drop_after(self, step: int, kind: str) -> None:
        """Forget ``kind`` records past ``step`` and a line cut by a kill (a resumed run re-does
        those steps). The file is replaced atomically: a kill during this leaves the old one."""
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in self.read() if r.get("kind") != kind or r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

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
