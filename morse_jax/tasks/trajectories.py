"""MoRAgent's multi-role trajectories: the record type and its JSON Lines format (validating loader,
writer). A task-level data type: task data (``tasks.bfcl``) writes it, SFT (``morse_jax.sft.data``)
renders it into tokens.

Format (one JSON object per line)::

    {"functions": [{"name": "...", "description": "...", "parameters": {...}}, ...],   # optional, []
     "system": "...",                                                                   # optional, ""
     "turns": [{"role": "user", "content": "..."},
               {"role": "reasoner", "content": "... Next: executor."},
               {"role": "executor", "content": "[func(arg=value)]"},
               {"role": "observation", "content": "..."},
               {"role": "reasoner", "content": "... Next: summarizer."},
               {"role": "summarizer", "content": "..."}],
     "id": "..."}                                                                       # optional

``turns`` starts with a user turn and contains at least one role turn (reasoner / executor /
summarizer); each role turn's content is non-empty. Any other key, a wrong type or an unknown role is
an error naming file, line and field (``data.jsonl:12: turns[3].role: ...``); with
``skip_invalid=True`` bad lines are skipped and counted instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

ROLE_NAMES = ("reasoner", "executor", "summarizer")  # role index = position (the adapter's groups)
TURN_ROLES = ("user",) + ROLE_NAMES + ("observation",)
_RECORD_KEYS = {"functions", "system", "turns", "id"}

class DataFormatError(ValueError):
    """A record that does not follow the multi-role format (message: ``file:line: field: problem``)."""


@dataclasses.dataclass(frozen=True)
class Turn:
    role: str  # one of TURN_ROLES
    content: str


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One multi-role trajectory (see the module docstring for the format)."""

    turns: tuple[Turn, ...]
    functions: tuple[Mapping[str, Any], ...] = ()
    system: str = ""
    id: str = ""


# --------------------------------------------------------------------------- validation / loading


class _FieldError(Exception):
    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")


def parse_record(obj: Any) -> Trajectory:
    """A decoded JSON value -> Trajectory; raises DataFormatError("field: problem") when invalid."""
    try:
        return _parse(obj)
    except _FieldError as e:
        raise DataFormatError(str(e)) from None


def _parse(obj: Any) -> Trajectory:
    if not isinstance(obj, dict):
        raise _FieldError("record", f"expected a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - _RECORD_KEYS)
    if extra:
        raise _FieldError(extra[0], f"unknown key (allowed: {', '.join(sorted(_RECORD_KEYS))})")
    functions = obj.get("functions", [])
    if not isinstance(functions, list):
        raise _FieldError("functions", "expected a list of function docs")
    for i, f in enumerate(functions):
        if not isinstance(f, dict):
            raise _FieldError(f"functions[{i}]", "expected an object")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise _FieldError(f"functions[{i}].name", "expected a non-empty string")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise _FieldError(f"functions[{i}].parameters", "expected an object")
    system = obj.get("system", "")
    if not isinstance(system, str):
        raise _FieldError("system", "expected a string")
    rid = obj.get("id", "")
    if not isinstance(rid, str):
        raise _FieldError("id", "expected a string")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise _FieldError("turns", "expected a non-empty list of {role, content} objects")
    parsed = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise _FieldError(f"turns[{i}]", "expected an object with 'role' and 'content'")
        extra = sorted(set(t) - {"role", "content"})
        if extra:
            raise _FieldError(f"turns[{i}].{extra[0]}", "unknown key (allowed: role, content)")
        if t.get("role") not in TURN_ROLES:
            raise _FieldError(f"turns[{i}].role", f"expected one of {', '.join(TURN_ROLES)}, got {t.get('role')!r}")
        if not isinstance(t.get("content"), str):
            raise _FieldError(f"turns[{i}].content", "expected a string")
        if t["role"] in ROLE_NAMES and not t["content"].strip():
            raise _FieldError(f"turns[{i}].content", f"empty {t['role']} turn")
        parsed.append(Turn(t["role"], t["content"]))
    if parsed[0].role != "user":
        raise _FieldError("turns[0].role", f"a trajectory starts with the user's request, got {parsed[0].role!r}")
    if not any(t.role in ROLE_NAMES for t in parsed):
        raise _FieldError("turns", "no reasoner / executor / summarizer turn (nothing to train on)")
    return Trajectory(turns=tuple(parsed), functions=tuple(functions), system=system, id=rid)


def load_jsonl(path: str | os.PathLike, *, skip_invalid: bool = False) -> tuple[list[Trajectory], int]:
    """Every trajectory of a JSON Lines file and the number of skipped lines.

    Blank lines are ignored. A line that is not valid JSON or not a valid record raises
    DataFormatError("path:line: field: problem"), or, with ``skip_invalid``, is skipped and counted.
    """
    path = Path(path)
    out, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(f"record: invalid JSON ({e.msg} at column {e.colno})") from None
                out.append(parse_record(obj))
            except DataFormatError as e:
                if not skip_invalid:
                    raise DataFormatError(f"{path}:{lineno}: {e}") from None
                skipped += 1
    return out, skipped


def to_json(traj: Trajectory) -> dict:
    """The JSON object of ``traj`` (inverse of parse_record)."""
    obj = {"functions": [dict(f) for f in traj.functions], "system": traj.system,
           "turns": [{"role": t.role, "content": t.content} for t in traj.turns]}
    if traj.id:
        obj["id"] = traj.id
    return obj


def write_jsonl(path: str | os.PathLike, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories as JSON Lines (one record per line, UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(to_json(t), ensure_ascii=False) + "\n")
