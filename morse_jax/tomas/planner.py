"""Planner: task description -> chat prompt -> model text -> validated, repaired DAG (``Plan``).

The model's output is untrusted text. ``extract_json_object`` finds the JSON in it,
``validate_plan`` turns it into a :class:`Plan` (strict checks, plus a few repairs whose
outcome is unambiguous), and ``plan_task`` wraps both with bounded re-planning and a final
single-node fallback, so no model output can crash the orchestrator.

Parsing choices (documented because they decide what a malformed plan becomes):

* JSON is taken from the first fenced block (```json ... ```) that holds a parseable JSON
  value, else from the whole text. Candidates are top-level balanced ``{...}``/``[...]``
  spans (string-aware, so braces inside strings do not count); the first that parses wins,
  optionally preferring one that carries a plan key. A trailing comma before ``}``/``]`` is
  removed if that is what stops a span from parsing.
* A top-level list of objects is read as the node list (``{"nodes": [...]}``). Lists of
  anything else are skipped (``[1]`` in prose is a citation, not a plan).
* Node-list aliases: ``subtasks``, ``steps`` or ``tasks`` are accepted when ``nodes`` is
  absent and exactly one alias holds a list; two aliases at once is an error (ambiguous).
* Repairs (each recorded in ``Plan.repairs`` and logged on ``morse_jax.planner``): unknown
  dependency dropped; self-dependency dropped; repeated dependency de-duplicated;
  ``depends_on`` given as a string (comma-separated ids) or a single int turned into a list;
  ``dependencies``/``deps``/``parents`` accepted for ``depends_on``; missing title derived
  from the description; each cycle broken by removing the back edge that the depth-first
  search (roots and children in the model's node order) meets first, repeated until acyclic.
* Errors (``PlanValidationError``): no node list, zero nodes or a count outside
  [min_nodes, max_nodes], a node that is not an object, missing/empty/duplicate id, empty or
  non-string description, a ``depends_on`` of another type. With ``repair=False`` (used for
  user-written plan files) every repair above is an error instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import networkx as nx

from morse_jax.tomas.plan import Plan, PlanNode

logger = logging.getLogger("morse_jax.planner")

Message = dict[str, str]
GenerateFn = Callable[[list[Message]], str]

NODE_LIST_ALIASES = ("subtasks", "steps", "tasks")
DEPENDS_ALIASES = ("dependencies", "deps", "parents")
_TRAILING_RE = re.compile(r"\s*[}\]]")
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\r?\n?(.*?)```", re.DOTALL)
_TITLE_CHARS = 60
_PLACEHOLDER = "What to do and what it delivers."  # the prompt's example; an echo of it is rejected
_ECHO_CHARS = 1500  # how much of a rejected answer is echoed back when re-planning

# Domain guidance a software-project task family (SRDD) can pass as ``roles_hint``; adapted
# from the rules of the authors' planner prompt.
SOFTWARE_PROJECT_HINT = (
    "Subtasks are developer work items (requirements analysis, architecture, implementation of "
    "modules, integration, testing). The program must use the Python standard library only; "
    "if the task implies graphics or a GUI, plan a terminal/ASCII interface instead."
)


class PlanParseError(ValueError):
    """The model output contains no usable JSON value."""


class PlanValidationError(ValueError):
    """A JSON plan violates the schema or the DAG rules; the message names the node and field."""


# ---------------------------------------------------------------------------------------------
# Prompts


def _check_bounds(min_nodes: int, max_nodes: int | None) -> None:
    if not isinstance(min_nodes, int) or min_nodes < 1:
        raise ValueError(f"min_nodes must be an int >= 1, got {min_nodes!r}")
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < min_nodes):
        raise ValueError(f"max_nodes must be an int >= min_nodes ({min_nodes}), got {max_nodes!r}")


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
    return value.strip()


_SYSTEM = (
    "You are the planner of a multi-agent system. You decompose a task into a dependency graph "
    "(a DAG) of subtasks. Each subtask is carried out later by its own agent, which sees the task, "
    "its subtask description and the outputs of the subtasks it depends on."
)


def planner_messages(
    task_description: str,
    *,
    min_nodes: int = 2,
    max_nodes: int = 8,
    roles_hint: str | Sequence[str] | None = None,
) -> list[Message]:
    """Chat messages asking the backbone for ``{"nodes": [{id, title, description, depends_on}]}``.

    Adapted from the authors' structured-output planner prompt (appendix E: "the planner uses the
    same backbone with a structured-output prompt"): bounded node count, full coverage of the
    task's requirements, joins that must combine all their parents, JSON only.
    ``roles_hint``: optional domain guidance (a string or a list of rules) added to the rules.
    """
    task = _check_text("task_description", task_description)
    _check_bounds(min_nodes, max_nodes)
    span = f"{min_nodes}" if min_nodes == max_nodes else f"{min_nodes} to {max_nodes}"
    rules = [
        "Together the descriptions must cover every requirement and detail stated in the task; "
        "make clear which subtask handles each requirement.",
        "Dependencies must form a DAG: refer only to ids of this plan, never to the subtask itself, "
        "and never in a cycle.",
        "Add a dependency only where a subtask really needs that output; independent subtasks may "
        "run in parallel.",
        "A subtask with several dependencies must use and combine the concrete outputs of all of them.",
        "A subtask that several others depend on must produce what they need to proceed consistently.",
    ]
    if isinstance(roles_hint, str) and roles_hint.strip():
        rules.append(roles_hint.strip())
    elif roles_hint is not None and not isinstance(roles_hint, str):
        rules.extend(str(r).strip() for r in roles_hint if str(r).strip())
    example = {"nodes": [
        {"id": "n1", "title": "Short action", "description": _PLACEHOLDER, "depends_on": []},
        {"id": "n2", "title": "Short action", "description": _PLACEHOLDER, "depends_on": ["n1"]},
    ]}
    user = "\n".join([
        f"Decompose the task below into {span} subtasks. For every subtask give:",
        '- "id": a short unique identifier ("n1", "n2", ...)',
        '- "title": a concise action of a few words',
        '- "description": one or two sentences: the work and the concrete intermediate deliverable',
        '- "depends_on": the ids of the subtasks whose outputs it needs ([] for a starting subtask)',
        "",
        "Rules:",
        *(f"- {r}" for r in rules),
        "",
        "Answer with one JSON object only, with no markdown fences and no text before or after it, "
        "in exactly this shape (the content is a placeholder):",
        json.dumps(example),
        "",
        "Task:",
        task,
    ])
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def _replan_messages(base: list[Message], previous: str, error: str) -> list[Message]:
    """The original request, the rejected answer (truncated) and the reason it was rejected."""
    prev = previous if len(previous) <= _ECHO_CHARS else previous[:_ECHO_CHARS] + " [...]"
    fix = (f"That answer was rejected: {error}\nReply again with the complete corrected plan as "
           "one JSON object only.")
    return [*base, {"role": "assistant", "content": prev}, {"role": "user", "content": fix}]


# ---------------------------------------------------------------------------------------------
# JSON extraction


def _balanced_spans(text: str) -> tuple[list[tuple[int, int]], int | None]:
    """Top-level balanced ``{}``/``[]`` spans, string-aware inside a span.

    Returns (spans as (start, end_exclusive), start of an opener never closed or None).
    Quotes in prose outside any span are ignored; a mismatched closer abandons the span.
    """
    spans, stack, in_str, esc = [], [], False, False
    pairs = {"}": "{", "]": "["}
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"' and stack:
            in_str = True
        elif c in "{[":
            stack.append((c, i))
        elif c in "}]" and stack:
            if stack[-1][0] != pairs[c]:
                stack = []  # not JSON; look for a fresh span after this point
                continue
            _, start = stack.pop()
            if not stack:
                spans.append((start, i + 1))
    return spans, (stack[0][1] if stack else None)


def _strip_trailing_commas(s: str) -> str:
    """Remove commas directly before a closing bracket, outside strings."""
    out, in_str, esc = [], False, False
    for i, c in enumerate(s):
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c == "," and _TRAILING_RE.match(s, i + 1):
            continue
        out.append(c)
    return "".join(out)


def _loads(s: str) -> tuple[Any, str | None]:
    """(value, None) or (None, error); trailing-comma fallback; never raises."""
    try:
        return json.loads(s), None
    except (ValueError, RecursionError) as e:
        err = str(e)[:160]
    try:
        return json.loads(_strip_trailing_commas(s)), None
    except (ValueError, RecursionError):
        return None, err


def _as_object(value: Any) -> dict | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {"nodes": value}
    return None


def _extract(text: str, prefer_keys: Sequence[str]) -> tuple[dict | None, str]:
    spans, unclosed = _balanced_spans(text)
    found, first_err = [], ""
    for a, b in spans:
        value, err = _loads(text[a:b])
        obj = _as_object(value) if err is None else None
        if obj is not None:
            if not prefer_keys or any(k in obj for k in prefer_keys):
                return obj, ""
            found.append(obj)
        elif err and not first_err:
            first_err = f"the JSON at characters {a}..{b} does not parse ({err})"
    if found:
        return found[0], ""
    if first_err:
        return None, first_err
    if unclosed is not None:
        return None, f"the JSON looks truncated: the bracket at character {unclosed} is never closed"
    return None, "no JSON object found in the output"


def extract_json_object(text: str, *, prefer_keys: Sequence[str] = ()) -> dict:
    """The first JSON object in model output (see the module docstring for the rules).

    Args:
      text: raw model output; may hold prose, code fences, several JSON values.
      prefer_keys: if given, the first object having one of these keys beats earlier objects
        (so an echoed example or a stray ``{"x": 1}`` does not shadow the answer).
    Returns: the object; a top-level list of objects comes back as ``{"nodes": list}``.
    Raises: PlanParseError saying why nothing usable was found.
    """
    if not isinstance(text, str):
        raise PlanParseError(f"model output must be a string, got {type(text).__name__}")
    for m in _FENCE_RE.finditer(text):
        obj, _ = _extract(m.group(2), prefer_keys)
        # a fenced object without a preferred key may be an example; the full scan decides
        if obj is not None and (not prefer_keys or any(k in obj for k in prefer_keys)):
            return obj
    obj, why = _extract(text, prefer_keys)
    if obj is None:
        snippet = " ".join(text.split())[:120]
        raise PlanParseError(f"{why}; output starts: {snippet!r}")
    return obj


# ---------------------------------------------------------------------------------------------
# Validation and repair


class _Fixer:
    """Collects repairs, or turns each into an error when repairs are not allowed."""

    def __init__(self, allow: bool):
        self.allow, self.notes = allow, []

    def __call__(self, note: str) -> None:
        if not self.allow:
            raise PlanValidationError(note + " (repairs are disabled)")
        self.notes.append(note)
        logger.info("plan repair: %s", note)


def _coerce_id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PlanValidationError(f"{where}: must be a string or an int, got {value!r:.60}")
    out = str(value).strip()
    if not out:
        raise PlanValidationError(f"{where}: is empty")
    return out


def _node_list(obj: Any, fix: _Fixer) -> list:
    if isinstance(obj, list):
        return obj
    if not isinstance(obj, Mapping):
        raise PlanValidationError(f"plan must be a JSON object with a 'nodes' list, got {type(obj).__name__}")
    if "nodes" in obj:
        key = "nodes"
    else:
        present = [k for k in NODE_LIST_ALIASES if isinstance(obj.get(k), list)]
        if len(present) > 1:
            raise PlanValidationError(f"plan has no 'nodes' and several candidate lists {present}: ambiguous")
        if not present:
            raise PlanValidationError(f"plan has no 'nodes' list (keys found: {sorted(map(str, obj))[:10]})")
        key = present[0]
        fix(f"read the node list from key {key!r} instead of 'nodes'")
    if not isinstance(obj[key], list):
        raise PlanValidationError(f"field {key!r} must be a list of nodes, got {type(obj[key]).__name__}")
    return obj[key]


def _raw_deps(raw: Mapping, nid: str, fix: _Fixer) -> list[str]:
    where = f"node {nid!r}: field 'depends_on'"
    if "depends_on" in raw:
        deps = raw["depends_on"]
    else:
        present = [k for k in DEPENDS_ALIASES if k in raw]
        if len(present) > 1:
            raise PlanValidationError(f"node {nid!r}: several dependency fields {present}: ambiguous")
        deps = raw[present[0]] if present else None
        if present:
            fix(f"node {nid!r}: read dependencies from field {present[0]!r}")
    if deps is None:
        return []
    if isinstance(deps, str):
        parts = [p.strip() for p in deps.split(",") if p.strip()]
        fix(f"{where} was the string {deps!r}; read it as the list {parts}")
        return parts
    if isinstance(deps, int) and not isinstance(deps, bool):
        fix(f"{where} was the number {deps}; read it as the list ['{deps}']")
        return [str(deps)]
    if not isinstance(deps, list):
        raise PlanValidationError(f"{where} must be a list of ids, got {type(deps).__name__}")
    return [_coerce_id(d, f"{where}[{j}]") for j, d in enumerate(deps)]


def _derive_title(description: str) -> str:
    first = re.split(r"(?<=[.!?])\s|\n", description, maxsplit=1)[0].strip()
    return first if len(first) <= _TITLE_CHARS else first[: _TITLE_CHARS - 3].rstrip() + "..."


def _find_back_edge(order: Sequence[str], children: Mapping[str, list[str]]):
    """First back edge (u, v) of a DFS over parent->child edges in node order, with its cycle."""
    color = dict.fromkeys(order, 0)  # 0 unseen, 1 on the DFS path, 2 finished
    for root in order:
        if color[root]:
            continue
        color[root], path, stack = 1, [root], [iter(children[root])]
        while stack:
            for child in stack[-1]:
                if color[child] == 1:
                    return path[-1], child, path[path.index(child):] + [child]
                if color[child] == 0:
                    color[child] = 1
                    path.append(child)
                    stack.append(iter(children[child]))
                    break
            else:
                color[path.pop()] = 2
                stack.pop()
    return None


def validate_plan(
    obj: Any, *, min_nodes: int = 2, max_nodes: int | None = 8, repair: bool = True
) -> Plan:
    """Parsed JSON -> :class:`Plan` with nodes in stable topological order (ties: input order).

    Args:
      obj: ``{"nodes": [...]}`` (or an alias, or the list itself), as parsed from JSON.
      min_nodes, max_nodes: allowed node count (max_nodes None = unbounded).
      repair: apply the repairs listed in the module docstring; if False each is an error.
    Raises: PlanValidationError naming the node and field.
    """
    _check_bounds(min_nodes, max_nodes)
    fix = _Fixer(repair)
    raw_nodes = _node_list(obj, fix)
    if not raw_nodes:
        raise PlanValidationError("plan has zero nodes")
    if len(raw_nodes) < min_nodes or (max_nodes is not None and len(raw_nodes) > max_nodes):
        raise PlanValidationError(
            f"plan has {len(raw_nodes)} nodes; allowed is {min_nodes} to {max_nodes or 'any'}")
    ids, fields = [], []
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, Mapping):
            raise PlanValidationError(f"nodes[{i}] must be an object, got {type(raw).__name__}")
        if "id" not in raw:
            raise PlanValidationError(f"nodes[{i}]: field 'id' is missing")
        nid = _coerce_id(raw["id"], f"nodes[{i}]: field 'id'")
        if nid in ids:
            raise PlanValidationError(f"nodes[{i}]: duplicate id {nid!r} (also nodes[{ids.index(nid)}])")
        ids.append(nid)
        desc = raw.get("description")
        if not isinstance(desc, str) or not desc.strip():
            raise PlanValidationError(f"node {nid!r}: field 'description' is missing, empty or not a string")
        title = raw.get("title")
        if title is not None and not isinstance(title, (str, int, float)):
            raise PlanValidationError(f"node {nid!r}: field 'title' must be a string")
        title = str(title).strip() if title is not None else ""
        if not title:
            title = _derive_title(desc.strip())
            fix(f"node {nid!r}: title missing; derived {title!r} from the description")
        fields.append((title, desc.strip(), _raw_deps(raw, nid, fix)))
    known = set(ids)
    deps: dict[str, list[str]] = {}
    for nid, (_, _, raw_deps) in zip(ids, fields):
        kept = []
        for d in raw_deps:
            if d == nid:
                fix(f"node {nid!r}: dropped dependency on itself")
            elif d not in known:
                fix(f"node {nid!r}: dropped unknown dependency {d!r}")
            elif d in kept:
                fix(f"node {nid!r}: dropped repeated dependency {d!r}")
            else:
                kept.append(d)
        deps[nid] = kept
    while True:
        children: dict[str, list[str]] = {n: [] for n in ids}
        for nid in ids:
            for d in deps[nid]:
                children[d].append(nid)
        back = _find_back_edge(ids, children)
        if back is None:
            break
        u, v, cycle = back
        deps[v].remove(u)
        fix(f"node {v!r}: dropped dependency on {u!r} to break the cycle {' -> '.join(cycle)}")
    g = nx.DiGraph()
    g.add_nodes_from(ids)
    g.add_edges_from((d, n) for n in ids for d in deps[n])
    assert nx.is_directed_acyclic_graph(g)  # the loop above removed every back edge
    rank = {n: i for i, n in enumerate(ids)}
    order = list(nx.lexicographical_topological_sort(g, key=rank.__getitem__))
    nodes = {n: PlanNode(n, f[0], f[1], tuple(deps[n])) for n, f in zip(ids, fields)}
    return Plan(tuple(nodes[n] for n in order), tuple(fix.notes))


# ---------------------------------------------------------------------------------------------
# Planning with the backbone


def single_node_plan(task_description: str, repairs: Sequence[str] = ()) -> Plan:
    """The fallback: one node whose description is the whole task."""
    task = _check_text("task_description", task_description)
    return Plan((PlanNode("n1", _derive_title(task), task, ()),), tuple(repairs))


def plan_task(
    task_description: str,
    generate_fn: GenerateFn,
    *,
    min_nodes: int = 2,
    max_nodes: int = 8,
    max_replans: int = 2,
    roles_hint: str | Sequence[str] | None = None,
    log: logging.Logger | None = None,
) -> Plan:
    """Ask the backbone for a plan; re-plan on bad output; fall back to a single node.

    ``generate_fn(messages) -> str`` is the model call (the sampler with the backbone). Each
    rejected attempt is re-asked with the rejected answer and the reason. After
    ``1 + max_replans`` failures the result is :func:`single_node_plan`. Rejections, the
    fallback and repairs are all in ``Plan.repairs`` and logged on ``log`` (default
    ``morse_jax.planner``). Exceptions raised by ``generate_fn`` itself propagate.
    """
    log = log or logger
    if not isinstance(max_replans, int) or max_replans < 0:
        raise ValueError(f"max_replans must be an int >= 0, got {max_replans!r}")
    base = planner_messages(task_description, min_nodes=min_nodes, max_nodes=max_nodes,
                            roles_hint=roles_hint)
    messages, notes = base, []
    for attempt in range(1, max_replans + 2):
        text = generate_fn(messages)
        if not isinstance(text, str):
            raise TypeError(f"generate_fn must return a str, got {type(text).__name__}")
        try:
            plan = validate_plan(extract_json_object(text, prefer_keys=("nodes", *NODE_LIST_ALIASES)),
                                 min_nodes=min_nodes, max_nodes=max_nodes)
            if any(n.description == _PLACEHOLDER for n in plan.nodes):
                raise PlanValidationError("the plan copies the placeholder example instead of planning the task")
        except ValueError as e:  # PlanParseError / PlanValidationError
            note = f"planner attempt {attempt} rejected: {e}"
            notes.append(note)
            log.warning(note)
            messages = _replan_messages(base, text, str(e))
            continue
        return dataclasses.replace(plan, repairs=(*notes, *plan.repairs))
    note = f"fell back to a single-node plan after {max_replans + 1} rejected planner attempts"
    log.warning(note)
    return single_node_plan(task_description, [*notes, note])


def load_plan_file(path: str | Path, *, min_nodes: int = 1, max_nodes: int | None = None) -> Plan:
    """A user-written plan (JSON ``{"nodes": [...]}``), validated strictly: repairs are errors.

    Raises FileNotFoundError, or PlanValidationError whose message starts with the file path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"plan file {str(path)!r} does not exist") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise PlanValidationError(f"{path}: not valid JSON: {e}") from None
    try:
        return validate_plan(obj, min_nodes=min_nodes, max_nodes=max_nodes, repair=False)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Plans with fixed nodes (SciCode sub-steps)


def _check_steps(steps: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not steps:
        raise ValueError("steps must be a non-empty sequence of (step_id, description) pairs")
    out, seen = [], set()
    for i, st in enumerate(steps):
        if not isinstance(st, (tuple, list)) or len(st) != 2:
            raise ValueError(f"steps[{i}] must be a (step_id, description) pair, got {st!r:.60}")
        sid = _check_text(f"steps[{i}] step_id", st[0])
        if sid in seen:
            raise ValueError(f"steps[{i}]: duplicate step_id {sid!r}")
        seen.add(sid)
        out.append((sid, _check_text(f"steps[{i}] description", st[1])))
    return out


def scicode_plan(steps: Sequence[tuple[str, str]]) -> Plan:
    """The chain plan for fixed steps: each step depends on the previous one."""
    return Plan.chain([PlanNode(s, _derive_title(d), d) for s, d in _check_steps(steps)])


def infer_dependencies_messages(task_description: str, steps: Sequence[tuple[str, str]]) -> list[Message]:
    """Messages asking which earlier steps each fixed step needs (the authors' SciCode prompt, adapted)."""
    task, steps = _check_text("task_description", task_description), _check_steps(steps)
    blocks = "\n\n-----\n\n".join(f"Step ID: {s}\n{d}" for s, d in steps)
    user = "\n".join([
        "The task below is already decomposed into ordered steps. Infer only the dependency links "
        "among these steps.",
        "- Do not rewrite, rename or merge steps; use only the listed step ids.",
        "- A step can depend only on steps listed before it.",
        "- Give direct prerequisites only (no redundant transitive ones); prefer a sparse DAG.",
        "Answer with one JSON object only, no markdown and no explanation, in exactly this shape:",
        '{"dependencies": [{"step": "<step id>", "depends_on": ["<step id>", "..."]}]}',
        "", "Task:", task, "", "Ordered steps:", blocks,
    ])
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def _dependency_rows(obj: Mapping) -> dict[str, Any]:
    """{step id: raw depends_on} from the accepted shapes; raises ValueError otherwise."""
    rows = obj.get("dependencies", obj.get("nodes"))
    if isinstance(rows, Mapping):
        return {str(k).strip(): v for k, v in rows.items()}
    if not isinstance(rows, list):
        raise ValueError("no 'dependencies' list or mapping")
    out = {}
    for j, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"dependencies[{j}] is not an object")
        sid = row.get("step", row.get("id"))
        if isinstance(sid, bool) or not isinstance(sid, (str, int)):
            raise ValueError(f"dependencies[{j}] has no step id")
        out[str(sid).strip()] = row.get("depends_on", [])
    return out


def parse_inferred_dependencies(text: str, steps: Sequence[tuple[str, str]]) -> Plan:
    """Plan over the fixed steps with the model's dependencies; the chain on any parse problem.

    Edge-level problems (unknown, self, later or repeated step, bad id type) drop the edge; a
    step after the first that ends with no parent is attached to its predecessor, as in the
    reference implementation, so every later step sees upstream code. All recorded in repairs.
    """
    steps = _check_steps(steps)
    order = [s for s, _ in steps]
    try:
        rows = _dependency_rows(extract_json_object(text, prefer_keys=("dependencies",)))
    except ValueError as e:
        note = f"dependency inference unusable ({e}); used the step chain"
        logger.warning(note)
        return dataclasses.replace(scicode_plan(steps), repairs=(note,))
    fix, nodes = _Fixer(True), []
    for extra in sorted(set(rows) - set(order)):
        fix(f"ignored dependencies given for unknown step {extra!r}")
    for i, (sid, desc) in enumerate(steps):
        raw = rows.get(sid, [])
        raw = [raw] if isinstance(raw, (str, int)) and not isinstance(raw, bool) else raw
        if not isinstance(raw, list):
            fix(f"step {sid!r}: depends_on is not a list; ignored")
            raw = []
        kept = []
        for d in raw:
            d = str(d).strip() if isinstance(d, (str, int)) and not isinstance(d, bool) else None
            if d in order[:i] and d not in kept:
                kept.append(d)
            else:
                fix(f"step {sid!r}: dropped dependency {d!r} (unknown, repeated, itself or a later step)")
        if i > 0 and not kept:
            kept = [order[i - 1]]
            fix(f"step {sid!r}: no earlier step given; attached to its predecessor {order[i - 1]!r}")
        nodes.append(PlanNode(sid, _derive_title(desc), desc, tuple(kept)))
    return Plan(tuple(nodes), tuple(fix.notes))


def plan_with_fixed_nodes(
    task_description: str, steps: Sequence[tuple[str, str]], generate_fn: GenerateFn
) -> Plan:
    """One model call to infer dependencies among fixed steps; the chain if that fails."""
    return parse_inferred_dependencies(generate_fn(infer_dependencies_messages(task_description, steps)), steps)


# ---------------------------------------------------------------------------------------------
# Rendering


def render_plan(plan: Plan) -> str:
    """Readable text rendering of the DAG: order, ids, titles, parents, joins, repairs."""
    n_edges = sum(len(n.depends_on) for n in plan.nodes)
    joins = [n.id for n in plan.nodes if plan.is_join(n.id)]
    lines = [f"Plan: {len(plan.nodes)} nodes, {n_edges} edges, {len(joins)} join(s)"]
    width = max(len(n.id) for n in plan.nodes) if plan.nodes else 0
    for k, n in enumerate(plan.nodes, 1):
        tag = f"   [join: merge of {', '.join(n.depends_on)}]" if plan.is_join(n.id) else ""
        lines.append(f"{k:>3}. {n.id:<{width}}  {n.title}{tag}")
        lines.append(f"     {'':<{width}}  after: {', '.join(n.depends_on) or '(root)'}")
    if plan.repairs:
        lines.append("Repairs:")
        lines.extend(f"  - {r}" for r in plan.repairs)
    return "\n".join(lines)
