"""MoRAgent's multi-role trajectories: the JSON Lines format, its validating loader, rendering with the
backbone's chat template into tokens + per-token role ids + loss mask, and a rule-based converter from
plain single-turn function-calling records.

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

Rendering (reading (B) of the MoRAgent reference: one packed sequence per trajectory): the system
text plus the function list (indent-4 JSON, as BFCL shows functions) is the system message; user
turns are user messages; role turns are assistant messages; observations are user messages prefixed
"Observation:" (templates differ in tool-role support; every template has user). Per token:

* role id: the turn's role index in ROLE_NAMES for the tokens of a role turn, from its header through
  its end-of-turn token (the header is prefilled under that role at inference too); NO_ROLE (-1)
  for system, user, observation and template glue tokens (they get no adapter);
* loss mask: the role turn's content tokens and its end-of-turn token (so the model learns to stop).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from morse_jax.models.chat import stop_token_ids

ROLE_NAMES = ("reasoner", "executor", "summarizer")  # role index = position (the adapter's groups)
TURN_ROLES = ("user",) + ROLE_NAMES + ("observation",)
NO_ROLE = -1
_RECORD_KEYS = {"functions", "system", "turns", "id"}

DEFAULT_SYSTEM = ("You are a function-calling agent made of three roles. The reasoner reads the request and "
                  "what happened so far, thinks, and ends with 'Next: executor.' or 'Next: summarizer.'. The "
                  "executor answers only with function calls in the format [func_name(param=value, ...)]. The "
                  "summarizer gives the user the final answer.")


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


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A trajectory as model input.

    Attributes:
      tokens: int32[T] token ids of the whole chat.
      role_ids: int32[T] index into ROLE_NAMES, NO_ROLE (-1) for tokens with no role.
      loss_mask: bool[T] True where the token is a target (role-turn content + its end-of-turn).
    """

    tokens: np.ndarray
    role_ids: np.ndarray
    loss_mask: np.ndarray


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


# --------------------------------------------------------------------------- rendering


def system_text(traj: Trajectory) -> str:
    """The system message: the record's system text, then the functions as indent-4 JSON."""
    if not traj.functions:
        return traj.system
    listing = "Here is a list of functions in JSON format that you can invoke.\n" + json.dumps(
        [dict(f) for f in traj.functions], indent=4)
    return f"{traj.system}\n\n{listing}" if traj.system else listing


def chat_messages(traj: Trajectory) -> list[dict[str, str]]:
    """The chat messages the trajectory renders as (role turns become assistant messages)."""
    msgs = []
    sys_text = system_text(traj)
    if sys_text:
        msgs.append({"role": "system", "content": sys_text})
    for t in traj.turns:
        if t.role == "user":
            msgs.append({"role": "user", "content": t.content})
        elif t.role == "observation":
            msgs.append({"role": "user", "content": "Observation:\n" + t.content})
        else:
            msgs.append({"role": "assistant", "content": t.content})
    return msgs


def render(traj: Trajectory, tokenizer: Any) -> Rendered:
    """Tokens, per-token role ids and loss mask of ``traj`` under the tokenizer's chat template.

    Works with any template that renders a conversation as the concatenation of its messages'
    renderings with each content verbatim (ChatML, Llama 3, Gemma, ...); raises ValueError otherwise.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("mor.data.render: the tokenizer has no chat template")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("mor.data.render: needs a fast (tokenizers-backed) tokenizer for character offsets")
    msgs = chat_messages(traj)
    roles = ([None] if msgs[0]["role"] == "system" else []) + [t.role for t in traj.turns]
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    # Message i occupies full[bounds[i]:bounds[i+1]]: prefixes of the conversation render as prefixes.
    bounds = [0]
    for i in range(len(msgs)):
        prefix = tokenizer.apply_chat_template(msgs[:i + 1], tokenize=False)
        if not full.startswith(prefix) or len(prefix) < bounds[-1]:
            raise ValueError("mor.data.render: the chat template does not render a conversation as the "
                             f"concatenation of its messages (message {i})")
        bounds.append(len(prefix))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    role_ids = np.full(tokens.shape, NO_ROLE, np.int32)
    loss = np.zeros(tokens.shape, bool)
    stops = set(stop_token_ids(tokenizer))
    for i, (m, role) in enumerate(zip(msgs, roles)):
        if role not in ROLE_NAMES:
            continue
        lo, hi = bounds[i], bounds[i + 1]
        c0 = full.rfind(m["content"], lo, hi)  # the content follows the role header
        if c0 < 0:
            raise ValueError(f"mor.data.render: the chat template changed the content of message {i}")
        c1 = c0 + len(m["content"])
        in_msg = (offsets[:, 1] > lo) & (offsets[:, 0] < hi)
        content = (offsets[:, 1] > c0) & (offsets[:, 0] < c1)
        idx = np.flatnonzero(in_msg)
        last = np.flatnonzero(content)[-1]
        end = next((j for j in idx if j > last and int(tokens[j]) in stops), None)
        stop_at = end if end is not None else last
        role_ids[idx[idx <= stop_at]] = ROLE_NAMES.index(role)
        loss[content] = True
        if end is not None:
            loss[end] = True
    return Rendered(tokens=tokens, role_ids=role_ids, loss_mask=loss)


# --------------------------------------------------------------------------- converter


def _args_text(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no arguments"


def from_function_calling(record: Mapping[str, Any], *, system: str = DEFAULT_SYSTEM) -> Trajectory:
    """A plain single-turn function-calling record ``{"query", "functions", "calls"}`` (calls as
    ``[{name: {param: value}}]``, ``[]`` when no offered function applies) -> a multi-role trajectory.

    The paper completes thoughts and summaries with GPT-4o and grades them with DeepSeek-V3; those
    completions are not available offline, so every role turn here is templated from the reference
    calls: the reasoner names the calls and the next role, the executor makes exactly the reference
    calls (BFCL's ``[func(param=value)]`` syntax), the observation reports a success per call, the
    reasoner then hands over to the summarizer, which restates what was done. With no call, the
    reasoner explains that no offered function applies and goes straight to the summarizer, which
    declines. The template variant is chosen by a hash of the query (deterministic).
    """
    from morse_jax.tasks.bfcl.prompting import format_calls  # the answer syntax BFCL's decoder reads

    for key in ("query", "functions", "calls"):
        if key not in record:
            raise DataFormatError(f"{key}: missing from the function-calling record")
    query, functions, calls = record["query"], list(record["functions"]), list(record["calls"])
    offered = {f["name"] for f in functions}
    for c in calls:
        if len(c) != 1 or next(iter(c)) not in offered:
            raise DataFormatError(f"calls: {c!r} is not one call of an offered function")
    v = zlib.crc32(query.encode()) % 2
    turns = [Turn("user", query)]
    if calls:
        plan = "; ".join(f"{name} with {_args_text(args)}" for c in calls for name, args in c.items())
        n = len(calls)
        what = "one call" if n == 1 else f"{n} calls"
        thought = (f"The request maps to {what}: {plan}. Every required value is stated, so the executor should "
                   f"make {'it' if n == 1 else 'them'}. Next: executor." if v == 0 else
                   f"I need {what} here: {plan}. The arguments come straight from the request. Next: executor.")
        obs = json.dumps([{"function": name, "status": "ok"} for c in calls for name in c])
        done = ", ".join(f"{name} ({_args_text(args)})" for c in calls for name, args in c.items())
        turns += [Turn("reasoner", thought), Turn("executor", format_calls(calls)), Turn("observation", obs),
                  Turn("reasoner", "The calls succeeded, so the request is done. Next: summarizer." if n > 1 else
                       "The call succeeded, so the request is done. Next: summarizer."),
                  Turn("summarizer", f"Done. I ran {done}." if v == 0 else f"All set: I called {done}.")]
    else:
        names = ", ".join(sorted(offered)) or "none"
        turns += [Turn("reasoner", f"None of the available functions ({names}) can do what the user asks, so no "
                                   "call should be made. Next: summarizer."),
                  Turn("summarizer", "I can't do that with the functions available here; none of them covers "
                                     "this request.")]
    return Trajectory(turns=tuple(turns), functions=tuple(functions), system=system,
                      id=str(record.get("id", "")))


def write_jsonl(path: str | os.PathLike, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories as JSON Lines (one record per line, UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(to_json(t), ensure_ascii=False) + "\n")
