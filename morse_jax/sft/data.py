"""SFT data: MoRAgent's multi-role trajectories rendered with the backbone's chat template into
tokens + per-token role ids + loss mask.

The record type and its JSON Lines format live in :mod:`morse_jax.tasks.trajectories` (task data
writes them; this module only reads them); the converter from plain function-calling records in
:mod:`morse_jax.tasks.bfcl.trajectories`.

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
from typing import Any

import numpy as np

from morse_jax.models.chat import stop_token_ids
from morse_jax.mor.batch import NO_ROLE  # one definition, shared with the objective
from morse_jax.tasks.trajectories import ROLE_NAMES, Trajectory



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
