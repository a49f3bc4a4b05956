"""Synthetic function-calling examples for training without BFCL leakage.

A deterministic (per seed) generator of function schemas in BFCL's schema dialect (``"type": "dict"``
at the top; string / integer / float / boolean / array / enum parameters; required and optional ones,
optional ones with a ``default``) and of requests that state every argument value, with their
reference calls. Scenarios mirror BFCL's single-turn categories:

* ``simple``: one function offered, one call;
* ``multiple``: 2-4 functions offered, one call;
* ``parallel``: one function, 2-3 calls (one request asking for several things);
* ``parallel_multiple``: 2-4 functions, 2-3 calls of different functions;
* ``irrelevance``: the offered functions cannot serve the request; reference = no call.

Function names come from this module's own word lists (invented domains such as beekeeping or
lighthouse logs, compound nouns, a verb) and are checked against every BFCL category by the test
suite, so nothing trained on here names a BFCL function. Queries are templated (varied openings,
argument phrases and connectives): in-domain language is narrower than BFCL's.

Records are plain single-turn function-calling records::

    {"id": "synthetic-0", "scenario": "simple", "query": "...", "functions": [...],
     "calls": [{"name": {"param": value}}]}

``morse_jax.tasks.bfcl.trajectories.from_function_calling`` turns them into multi-role trajectories.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

SCENARIOS = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
DEFAULT_MIX = {"simple": 0.3, "multiple": 0.25, "parallel": 0.15, "parallel_multiple": 0.15, "irrelevance": 0.15}

# --------------------------------------------------------------------------- vocabulary
# domain -> (dotted prefix, [(noun identifier, noun phrase)])
DOMAINS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "beekeeping": ("apiary", [("hive_inspection", "hive inspection"), ("honey_harvest", "honey harvest"),
                              ("queen_cell", "queen cell record"), ("swarm_alert", "swarm alert")]),
    "lighthouse": ("beacon", [("lamp_log", "lamp log"), ("keeper_shift", "keeper shift"),
                              ("fog_signal", "fog signal test"), ("lens_survey", "lens survey")]),
    "greenhouse": ("glasshouse", [("seedling_tray", "seedling tray"), ("misting_cycle", "misting cycle"),
                                  ("compost_batch", "compost batch"), ("shade_panel", "shade panel")]),
    "marina": ("harbormaster", [("berth_slot", "berth slot"), ("tide_window", "tide window"),
                                ("hull_cleaning", "hull cleaning"), ("mooring_buoy", "mooring buoy")]),
    "library": ("bookbinder", [("manuscript_scan", "manuscript scan"), ("reading_carrel", "reading carrel"),
                               ("rare_folio", "rare folio"), ("binding_repair", "binding repair")]),
    "observatory": ("stargazer", [("telescope_slot", "telescope slot"), ("meteor_tally", "meteor tally"),
                                  ("dome_rotation", "dome rotation"), ("plate_archive", "plate archive")]),
    "bakery": ("ovenworks", [("sourdough_starter", "sourdough starter"), ("proofing_rack", "proofing rack"),
                             ("flour_delivery", "flour delivery"), ("pastry_order", "pastry order")]),
    "orchard": ("grovekeeper", [("pruning_round", "pruning round"), ("cider_press", "cider press run"),
                                ("graft_record", "graft record"), ("frost_watch", "frost watch")]),
    "aquarium": ("reefhall", [("coral_tank", "coral tank"), ("feeding_round", "feeding round"),
                              ("salinity_probe", "salinity probe"), ("diver_briefing", "diver briefing")]),
    "railway_museum": ("steamyard", [("boiler_check", "boiler check"), ("heritage_ride", "heritage ride"),
                                     ("signal_lever", "signal lever"), ("coal_stock", "coal stock")]),
    "pottery": ("kilnhouse", [("glaze_batch", "glaze batch"), ("kiln_firing", "kiln firing"),
                              ("clay_reclaim", "clay reclaim"), ("wheel_booking", "wheel booking")]),
    "alpine_hut": ("ridgehut", [("bunk_reservation", "bunk reservation"), ("avalanche_bulletin", "avalanche bulletin"),
                                ("supply_drop", "supply drop"), ("rope_inventory", "rope inventory")]),
}

VERBS: list[tuple[str, list[str], str]] = [
    # (identifier, phrases, description template)
    ("schedule", ["schedule", "set up", "plan"], "Schedules a {noun}."),
    ("log", ["log", "record", "write down"], "Records a new {noun} entry."),
    ("tally", ["tally", "count up", "total"], "Tallies the {noun} figures."),
    ("reserve", ["reserve", "book", "hold"], "Reserves a {noun}."),
    ("lookup", ["look up", "find", "retrieve"], "Looks up a {noun}."),
    ("cancel", ["cancel", "call off", "drop"], "Cancels a {noun}."),
    ("estimate", ["estimate", "work out", "forecast"], "Estimates the {noun} outcome."),
    ("archive", ["archive", "file away", "store"], "Archives a {noun}."),
    ("inspect", ["inspect", "review", "audit"], "Inspects a {noun}."),
    ("notify", ["send a notice about", "alert the crew about", "announce"], "Sends a notice about a {noun}."),
]

# BFCL appends this to every Python function's description at generation time; so do we, for parity.
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
OPENINGS = ["", "Please ", "Could you ", "Can you ", "I need you to ", "Kindly ", "Would you ", "I'd like you to ",
            "Go ahead and ", "Help me "]
QUESTION_OPENINGS = {"Could you ", "Can you ", "Would you "}
CONNECTIVES = [" Also, ", " Then ", " After that, ", " Additionally, ", " And "]

FIRST_NAMES = ["Ines", "Tomasz", "Aiko", "Bram", "Odile", "Kwame", "Saoirse", "Matteo", "Leilani", "Ravi", "Yusuf",
               "Freya", "Dagny", "Emeka", "Lucja", "Anselm"]
SITES = ["Gull Point", "Ashcombe", "North Quay", "Bellrock", "Stonebridge", "Larkmoor", "Westfold", "Cairnhill",
         "Pebble Bay", "Thornwick", "Fennel Cove", "Highmarsh"]
TAG_WORDS = ["urgent", "weekly", "seasonal", "north", "south", "trial", "volunteer", "backlog", "heritage", "spare"]
COLOURS = ["amber", "teal", "crimson", "ochre", "slate", "ivory"]
PRIORITIES = ["low", "normal", "high"]
SHIFTS = ["dawn", "day", "dusk", "night"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """A parameter kind: its JSON-schema entry, a value sampler and phrasings of a value."""

    name: str
    schema: dict
    sample: Callable[[random.Random], Any]
    phrases: tuple[str, ...]  # each contains "{v}"; booleans use phrases_true / phrases_false instead
    phrases_false: tuple[str, ...] = ()

    def phrase(self, value: Any, rng: random.Random) -> str:
        if isinstance(value, bool):
            return rng.choice(self.phrases if value else self.phrases_false)
        if isinstance(value, list):
            shown = ", ".join(map(str, value[:-1])) + " and " + str(value[-1]) if len(value) > 1 else str(value[0])
        else:
            shown = str(value)
        return rng.choice(self.phrases).format(v=shown)


def _date(rng: random.Random) -> str:
    return f"2031-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _tags(rng: random.Random) -> list[str]:
    return rng.sample(TAG_WORDS, rng.randint(1, 3))


SLOTS: tuple[Slot, ...] = (
    Slot("site", {"type": "string", "description": "Name of the site, e.g. Gull Point."},
         lambda r: r.choice(SITES), ("at {v}", "for the {v} site", "over at {v}")),
    Slot("day", {"type": "string", "description": "Day in YYYY-MM-DD format."},
         _date, ("on {v}", "for {v}", "dated {v}")),
    Slot("contact", {"type": "string", "description": "First name of the person in charge."},
         lambda r: r.choice(FIRST_NAMES), ("with {v} in charge", "assigned to {v}", "under {v}'s name")),
    Slot("quantity", {"type": "integer", "description": "Number of units involved."},
         lambda r: r.randint(2, 400), ("for {v} units", "covering {v} units", "with a quantity of {v}")),
    Slot("crew_size", {"type": "integer", "description": "How many people take part."},
         lambda r: r.randint(1, 12), ("with {v} people", "for a crew of {v}", "needing {v} helpers")),
    Slot("duration_hours", {"type": "float", "description": "Duration in hours."},
         lambda r: r.choice([0.5, 1.5, 2.0, 2.5, 3.25, 4.0, 6.5]), ("lasting {v} hours", "for {v} hours")),
    Slot("budget", {"type": "float", "description": "Budget in euros."},
         lambda r: float(r.randint(10, 900)) + r.choice([0.0, 0.5, 0.25]), ("with a budget of {v} euros",
                                                                             "capped at {v} euros")),
    Slot("temperature_c", {"type": "float", "description": "Target temperature in degrees Celsius."},
         lambda r: r.choice([4.5, 12.0, 18.5, 21.0, 36.6, 220.0, 1050.0]), ("at {v} degrees Celsius",
                                                                            "targeting {v} °C")),
    Slot("notify_team", {"type": "boolean", "description": "Whether to notify the team."},
         lambda r: r.random() < 0.5, ("and let the team know", "notifying the team"),
         ("without telling the team", "with no team notification")),
    Slot("recurring", {"type": "boolean", "description": "Whether it repeats every week."},
         lambda r: r.random() < 0.5, ("repeating weekly", "as a weekly recurring item"),
         ("as a one-off", "just once")),
    Slot("tags", {"type": "array", "items": {"type": "string"}, "description": "Labels to attach."},
         _tags, ("tagged {v}", "with the labels {v}")),
    Slot("priority", {"type": "string", "enum": PRIORITIES, "description": "Priority level."},
         lambda r: r.choice(PRIORITIES), ("at {v} priority", "with priority {v}")),
    Slot("shift", {"type": "string", "enum": SHIFTS, "description": "Which shift handles it."},
         lambda r: r.choice(SHIFTS), ("during the {v} shift", "on the {v} shift")),
    Slot("colour_code", {"type": "string", "enum": COLOURS, "description": "Colour code used on the board."},
         lambda r: r.choice(COLOURS), ("colour-coded {v}", "marked {v} on the board")),
)
_SLOT_DEFAULTS = {"string": "", "integer": 0, "float": 0.0, "boolean": False, "array": []}


@dataclasses.dataclass(frozen=True)
class _Function:
    schema: dict
    verb_phrases: tuple[str, ...]
    noun_phrase: str
    slots: tuple[Slot, ...]
    required: tuple[str, ...]


def _catalogue(rng: random.Random) -> list[_Function]:
    """Every (domain, noun, verb) function with a seeded parameter list; names are unique."""
    out = []
    for domain in sorted(DOMAINS):
        prefix, nouns = DOMAINS[domain]
        for noun, noun_phrase in nouns:
            for verb, verb_phrases, desc in VERBS:
                name = f"{prefix}.{verb}_{noun}" if rng.random() < 0.5 else f"{verb}_{noun}_{domain}"
                slots = tuple(rng.sample(SLOTS, rng.randint(1, 4)))
                n_req = rng.randint(1, len(slots))
                required = tuple(s.name for s in slots[:n_req])
                props = {}
                for s in slots:
                    entry = dict(s.schema)
                    if s.name not in required:
                        t = "string" if "enum" in entry else entry["type"]
                        default = entry["enum"][0] if "enum" in entry else _SLOT_DEFAULTS[t]
                        entry["description"] += f" Default: {default!r}."
                        entry["default"] = default
                    props[s.name] = entry
                schema = {"name": name, "description": desc.format(noun=noun_phrase) + PYTHON_HINT,
                          "parameters": {"type": "dict", "properties": props, "required": list(required)}}
                out.append(_Function(schema, tuple(verb_phrases), noun_phrase, slots, required))
    return out


def _request(fn: _Function, rng: random.Random) -> tuple[str, dict]:
    """One request clause for ``fn`` and its call ``{name: {param: value}}``: every required argument
    and a random subset of the optional ones, each stated in the text."""
    args = {}
    phrases = []
    for s in fn.slots:
        if s.name in fn.required or rng.random() < 0.5:
            v = s.sample(rng)
            args[s.name] = v
            phrases.append(s.phrase(v, rng))
    rng.shuffle(phrases)
    article = "an" if fn.noun_phrase[0] in "aeiou" else "a"
    clause = f"{rng.choice(fn.verb_phrases)} {article} {fn.noun_phrase} {' '.join(phrases)}"
    return clause, {fn.schema["name"]: args}


def _sentence(clauses: list[str], rng: random.Random) -> str:
    opening = rng.choice(OPENINGS)
    end = "?" if opening in QUESTION_OPENINGS else "."
    text = opening + clauses[0] + end
    for c in clauses[1:]:
        text += rng.choice(CONNECTIVES) + c + "."
    return text[0].upper() + text[1:]


def _example(scenario: str, cat: list[_Function], rng: random.Random) -> dict:
    if scenario in ("simple", "parallel", "irrelevance"):
        offered = rng.sample(cat, 1 if scenario != "irrelevance" else rng.randint(1, 3))
    else:
        offered = rng.sample(cat, rng.randint(2, 4))
    if scenario == "simple" or scenario == "multiple":
        targets = [rng.choice(offered)]
    elif scenario == "parallel":
        targets = offered * rng.randint(2, 3)
    elif scenario == "parallel_multiple":
        targets = rng.sample(offered, min(len(offered), rng.randint(2, 3)))
    else:  # irrelevance: a request for a function of another noun that is not offered
        nouns = {f.noun_phrase for f in offered}
        targets = [rng.choice([f for f in cat if f.noun_phrase not in nouns])]
    clauses, calls = zip(*(_request(f, rng) for f in targets))
    return {"scenario": scenario, "query": _sentence(list(clauses), rng),
            "functions": [f.schema for f in offered], "calls": [] if scenario == "irrelevance" else list(calls)}


def generate(n: int, seed: int = 0, mix: dict[str, float] | None = None) -> list[dict]:
    """``n`` distinct synthetic function-calling records (distinct query + offered functions),
    deterministic for a given ``seed`` and ``mix`` (scenario -> weight; default DEFAULT_MIX).

    Raises ValueError for an unknown scenario or when ``n`` distinct records cannot be found.
    """
    rng = random.Random(seed)
    cat = _catalogue(rng)
    return distinct_records(n, DEFAULT_MIX if mix is None else mix, lambda s: _example(s, cat, rng), rng, "synthetic")


def distinct_records(n: int, mix: dict[str, float], draw: Callable[[str], dict], rng: random.Random,
                     source: str) -> list[dict]:
    """``n`` records ``draw(scenario)`` with scenarios drawn by ``mix``'s weights, the first of each
    (query, offered function names) kept, ids ``<source>-<i>``; shared by this module's and
    :mod:`~morse_jax.tasks.bfcl.questions`' ``generate``. Raises ValueError for an unknown scenario
    or when ``n`` distinct records are not found in ``20 n + 100`` draws."""
    bad = sorted(set(mix) - set(SCENARIOS))
    if bad:
        raise ValueError(f"{source}.generate: unknown scenario(s) {bad}; known: {SCENARIOS}")
    names, weights = list(mix), [mix[k] for k in mix]
    out, seen = [], set()
    for _ in range(20 * n + 100):
        if len(out) == n:
            break
        ex = draw(rng.choices(names, weights)[0])
        key = (ex["query"], tuple(f["name"] for f in ex["functions"]))
        if key not in seen:
            seen.add(key)
            out.append({"id": f"{source}-{len(out)}", **ex})
    if len(out) < n:
        raise ValueError(f"{source}.generate: only {len(out)} distinct records found for n={n}")
    return out


def catalogue_names(seed: int = 0) -> list[str]:
    """The names of every function the generator can offer for ``seed``."""
    return [f.schema["name"] for f in _catalogue(random.Random(seed))]


def main(argv: list[str] | None = None) -> None:
    """``python -m morse_jax.tasks.bfcl.synthetic --n 5000 --seed 0 --out train.jsonl [--plain]``:
    write the generated set as multi-role trajectories (morse_jax.tasks.trajectories' format), or with
    ``--plain`` as the plain function-calling records."""
    import argparse
    import json

    from morse_jax.tasks.bfcl.trajectories import from_function_calling
    from morse_jax.tasks.trajectories import write_jsonl

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain", action="store_true")
    args = ap.parse_args(argv)
    records = generate(args.n, args.seed)
    if args.plain:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    else:
        write_jsonl(args.out, [from_function_calling(r) for r in records])
    print(f"wrote {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
