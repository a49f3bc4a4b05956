"""SRDD data: the ChatDev software requirement CSV splits, loaded as ``Task`` objects.

Split out of :mod:`morse_jax.tasks.srdd.family` (one concept per module), which re-exports every public
name defined here. The data is CC BY-NC: it is read from a configurable directory
(``data_dir`` or ``$MORSE_JAX_SRDD_DIR``), never shipped with the package.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from collections import Counter
from pathlib import Path

from morse_jax.tasks.base import Task

SPLITS = ("iid_train", "iid_test", "ood_train", "ood_test", "iid_train_small", "iid_test_small")
DATA_DIR_ENV = "MORSE_JAX_SRDD_DIR"
COLUMNS = ("Name", "Description", "Category")


@dataclasses.dataclass(frozen=True)
class SRDDInfo:
    """``Task.payload`` of an SRDD task: the row's name and category, and where it came from."""

    name: str
    category: str
    source: str
    record: int  # 1-based data record number in the CSV (header excluded)


def resolve_srdd_path(path_or_split: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path:
    """A split name (see ``SPLITS``) under ``data_dir`` (or $MORSE_JAX_SRDD_DIR), or a CSV path."""
    if str(path_or_split) in SPLITS:
        base = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
        if not base:
            raise ValueError(f"data_dir: needed to find SRDD split {str(path_or_split)!r} "
                             f"(or set ${DATA_DIR_ENV}); it is the directory holding {path_or_split}.csv")
        base = Path(base)
        for cand in (base / f"{path_or_split}.csv", base / "srdd" / "data" / f"{path_or_split}.csv"):
            if cand.is_file():
                return cand
        raise FileNotFoundError(f"data_dir: no {path_or_split}.csv in {base} (nor in {base}/srdd/data)")
    path = Path(path_or_split)
    if path.is_file():
        return path
    if path.suffix.lower() == ".csv":
        raise FileNotFoundError(f"path_or_split: SRDD file {path} does not exist")
    raise ValueError(f"path_or_split: {str(path_or_split)!r} is neither a split name {SPLITS} nor a CSV file")


def _rows(reader, path: Path):
    """The reader's rows; a malformed one (an unclosed quote cut by the end of the file, a stray
    quote ...) raises one line naming the file and the line."""
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise ValueError(f"{path}: line {reader.line_num}: malformed CSV ({e}; a quoted field "
                             "not closed, or the file cut short?)") from None


def load_srdd(path_or_split: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> list[Task]:
    """Load SRDD rows (columns Name, Description, Category) as ``Task`` objects in file order.

    ``task_id`` is the Name; a Name repeated within the file gets ``~2``, ``~3``... on its later
    occurrences (the IID train split repeats some names). Bad rows raise ``ValueError`` naming
    the file, the record and its line.
    """
    path = resolve_srdd_path(path_or_split, data_dir)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}: line {line}: not UTF-8") from None
    with io.StringIO(text, newline="") as fh:
        reader = csv.reader(fh, strict=True)
        rows = _rows(reader, path)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected header {','.join(COLUMNS)}")
        if tuple(h.strip() for h in header) != COLUMNS:
            raise ValueError(f"{path}: header is {header}, expected {list(COLUMNS)}")
        tasks: list[Task] = []
        seen: Counter = Counter()
        record = 0
        for row in rows:
            if not row:  # blank line: no data to lose
                continue
            record += 1
            where = f"{path}: record {record} (ending line {reader.line_num})"
            if len(row) != len(COLUMNS):
                missing = COLUMNS[len(row)] if len(row) < len(COLUMNS) else None
                raise ValueError(f"{where}: expected {len(COLUMNS)} fields, got {len(row)}"
                                 + (f" (field {missing!r} missing)" if missing else ""))
            name, desc, cat = (f.strip() for f in row)
            for col, val in zip(COLUMNS, (name, desc, cat)):
                if not val:
                    raise ValueError(f"{where}: field {col!r} is empty")
            seen[name] += 1
            tid = name if seen[name] == 1 else f"{name}~{seen[name]}"
            tasks.append(Task(task_id=tid, description=desc, family="srdd",
                              payload=SRDDInfo(name=name, category=cat, source=str(path), record=record)))
    if not tasks:
        raise ValueError(f"{path}: no data rows")
    return tasks
