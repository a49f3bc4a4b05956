"""Function templates of the PyFuncs task family: small typed Python functions with random parameters.

A template is one kind of small function (string processing, parsing, list arithmetic, dict
aggregation, formatting) from one value type to another. Drawing its parameters from a seeded
``random.Random`` gives a concrete :class:`FunctionSpec`: name, signature, docstring and the
reference source. Tasks (:mod:`~morse_jax.tasks.pyfuncs.data`) chain specs whose types match.

Value types (``TYPES``): each has a Python annotation and a generator of random inputs used for
examples and hidden tests. ``numtext`` / ``pairtext`` / ``mixtext`` / ``wordtext`` strings only make sense as
the *first* input of a chain (they are produced by the template's own ``source`` generator).

Reference sources are our own code, so the trusted process runs them directly to compute the
expected outputs (:func:`reference_function`); candidates run only in the sandbox.
"""

from __future__ import annotations

import dataclasses
import random
import string
from typing import Any, Callable, Mapping

KINDS = ("string", "parsing", "list", "dict", "format")

# Words of 3-6 letters: with one length for all, a constant answer passed ``word_lengths``.
_VOCAB = ("sun", "cat", "tree", "bird", "kite", "apple", "river", "stone", "cloud", "lemon", "music", "honey",
          "bread", "ocean", "orange", "garden", "window", "pencil", "rocket", "planet")


def _text(rng: random.Random) -> str:
    words = [rng.choice(_VOCAB) for _ in range(rng.randint(2, 5))]
    words = [w.capitalize() if rng.random() < 0.3 else w.upper() if rng.random() < 0.1 else w for w in words]
    out = words[0]
    for w in words[1:]:
        out += rng.choice((" ", " ", " ", ", ", "! ", "; ")) + w
    return out + rng.choice(("", "", ".", "!", "?"))


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-9, 20) for _ in range(rng.randint(1, 7))]


def _words(rng: random.Random) -> list[str]:
    pool = rng.sample(_VOCAB, 4)  # few distinct words, so counts exceed 1
    return [rng.choice(pool) for _ in range(rng.randint(1, 6))]


def _counts(rng: random.Random) -> dict[str, int]:
    return {w: rng.randint(1, 9) for w in rng.sample(_VOCAB, rng.randint(1, 4))}


def _icounts(rng: random.Random) -> dict[int, int]:
    return {k: rng.randint(1, 9) for k in rng.sample(range(6), rng.randint(1, 4))}


# type name -> (annotation, parameter name, generator or None for source-only types)
TYPES: Mapping[str, tuple[str, str, Callable[[random.Random], Any] | None]] = {
    "text": ("str", "text", _text),
    "numtext": ("str", "text", None),
    "pairtext": ("str", "text", None),
    "mixtext": ("str", "text", None),
    "wordtext": ("str", "text", None),
    "ints": ("list[int]", "xs", _ints),
    "int": ("int", "n", lambda rng: rng.randint(-20, 150)),
    "words": ("list[str]", "words", _words),
    "counts": ("dict[str, int]", "counts", _counts),
    "icounts": ("dict[int, int]", "counts", _icounts),
    "out": ("str", "s", None),  # terminal: a formatted string, never an input
}


@dataclasses.dataclass(frozen=True)
class Template:
    """A parametrised function template.

    Attributes:
      key: unique id "kind.name" (splits hold templates out by key).
      kind: one of KINDS.
      in_type, out_type: keys of TYPES.
      name: the function name.
      params: rng -> dict of parameters, formatted into ``doc`` and ``body``.
      doc: one-paragraph specification (str.format with the parameters).
      body: reference body, indented 4 spaces (str.format with the parameters; ``{{`` for braces).
      source: rng, params -> an input, for templates that can start a chain with a source-only type.
    """

    key: str
    kind: str
    in_type: str
    out_type: str
    name: str
    params: Callable[[random.Random], dict]
    doc: str
    body: str
    source: Callable[[random.Random, dict], Any] | None = None


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """A template with its parameters drawn: everything needed to prompt for and test a function."""

    template: str
    kind: str
    in_type: str
    out_type: str
    name: str
    doc: str
    reference: str  # full source of the reference implementation
    params: tuple[tuple[str, Any], ...]

    @property
    def param(self) -> str:
        return TYPES[self.in_type][1]

    @property
    def header(self) -> str:
        """``def name(param: T) -> R:`` -- ends at the colon (the answer prefix)."""
        return f"def {self.name}({self.param}: {TYPES[self.in_type][0]}) -> {TYPES[self.out_type][0]}:"

    def make_input(self, rng: random.Random) -> Any:
        """A random input of this function's type (its template's source for source-only types)."""
        gen = TYPES[self.in_type][2]
        if gen is not None:
            return gen(rng)
        return TEMPLATES[self.template].source(rng, dict(self.params))


def _numtext(rng, p):
    return p["sep"].join(str(x) for x in _ints(rng))


def _pairtext(rng, p):
    keys = rng.sample(string.ascii_lowercase[:8], rng.randint(1, 4))
    return p["sep"].join(f"{k}{p['kv']}{rng.randint(0, 30)}" for k in keys)


def _wordtext(rng, p):
    words = [rng.choice(_VOCAB) for _ in range(rng.randint(2, 5))]
    return p["sep"].join(w.capitalize() if rng.random() < 0.3 else w for w in words)


def _mixtext(rng, p):
    parts = [rng.choice(_VOCAB) if rng.random() < 0.5 else str(rng.randint(0, 99)) for _ in range(rng.randint(2, 6))]
    return " ".join(parts)


def _pick(*options):
    return lambda rng: rng.choice(options)


_T = Template
TEMPLATE_LIST: tuple[Template, ...] = (
    # ----- string processing: text -> text
    _T("string.replace_char", "string", "text", "text", "replace_char",
       lambda r: {"a": r.choice("aeiou"), "b": r.choice("*#-_")},
       "Return text with every '{a}' replaced by '{b}'.",
       "    return text.replace({a!r}, {b!r})"),
    _T("string.remove_chars", "string", "text", "text", "remove_chars",
       lambda r: {"chars": "".join(r.sample("aeiourstln", r.randint(2, 3)))},
       "Return text with every character that is one of '{chars}' removed.",
       "    return ''.join(c for c in text if c not in {chars!r})"),
    _T("string.change_case", "string", "text", "text", "change_case",
       _pick({"op": "upper", "how": "upper case"}, {"op": "lower", "how": "lower case"},
             {"op": "swapcase", "how": "swapped case (upper to lower and lower to upper)"}),
       "Return text converted to {how}.",
       "    return text.{op}()"),
    _T("string.letters_only", "string", "text", "text", "letters_only",
       _pick({"keep": "letters and spaces", "cond": "c.isalpha() or c == ' '"},
             {"keep": "lower-case letters and spaces", "cond": "c.islower() or c == ' '"}),
       "Return text keeping only its {keep} (drop every other character).",
       "    return ''.join(c for c in text if {cond})"),
    _T("string.reverse_text", "string", "text", "text", "reverse_text",
       _pick({"what": "text reversed (last character first)", "expr": "text[::-1]"},
             {"what": "the words of text (split on whitespace) in reverse order, joined by single spaces",
              "expr": "' '.join(text.split()[::-1])"}),
       "Return {what}.",
       "    return {expr}"),
    _T("string.shorten_words", "string", "text", "text", "shorten_words",  # OOD
       lambda r: {"n": r.randint(1, 3)},
       "Return the words of text (split on whitespace) each cut to its first {n} characters, "
       "joined by single spaces.",
       "    return ' '.join(w[:{n}] for w in text.split())"),
    # ----- parsing: source strings -> values. Split-and-convert, never regular expressions: the
    # 135M model rarely writes a correct regex (calibration: parsing 3 % with re.findall templates).
    _T("parsing.split_ints", "parsing", "numtext", "ints", "parse_numbers",
       lambda r: {"sep": r.choice((",", ";", "|", "/", " "))},
       "Split text on '{sep}' and return the parts converted to int, as a list.",
       "    return [int(p) for p in text.split({sep!r})]", _numtext),
    _T("parsing.digit_words", "parsing", "mixtext", "ints", "find_numbers",
       _pick({"order": "in order", "expr": "[int(w) for w in text.split() if w.isdigit()]"},
             {"order": "sorted from smallest to largest", "expr": "sorted(int(w) for w in text.split() if w.isdigit())"}),
       "Return the words of text (text.split()) that are made only of digits (w.isdigit()), "
       "converted to int, {order}.",
       "    return {expr}", _mixtext),
    _T("parsing.split_words", "parsing", "wordtext", "words", "split_words",
       lambda r: dict(r.choice(({"how": "in lower case", "op": ".lower()"}, {"how": "as they are", "op": ""})),
                      sep=r.choice((" ", ",", ";", "-"))),
       "Split text on '{sep}' and return the list of words {how}.",
       "    return [w{op} for w in text.split({sep!r})]", _wordtext),
    _T("parsing.count_digits", "parsing", "mixtext", "int", "count_digits",
       _pick({"what": "digits (c.isdigit())", "cond": "c.isdigit()"},
             {"what": "letters (c.isalpha())", "cond": "c.isalpha()"}),
       "Return how many characters of text are {what}.",
       "    return sum(1 for c in text if {cond})", _mixtext),
    _T("parsing.parse_pairs", "parsing", "pairtext", "counts", "parse_pairs",  # OOD
       lambda r: {"sep": r.choice((",", ";", " ")), "kv": r.choice(("=", ":"))},
       "Parse text made of 'key{kv}value' items separated by '{sep}' into a dict mapping each key "
       "to its value as an int.",
       "    return {{k: int(v) for k, v in (item.split({kv!r}) for item in text.split({sep!r}))}}", _pairtext),
    # ----- list arithmetic: ints -> ints | int
    _T("list.scale_shift", "list", "ints", "ints", "scale_shift",
       lambda r: {"k": r.randint(2, 5), "b": r.randint(-5, 9)},
       "Return a new list with each element of xs multiplied by {k} and then increased by {b}.",
       "    return [x * {k} + {b} for x in xs]"),
    _T("list.keep_multiples", "list", "ints", "ints", "keep_multiples",
       lambda r: {"k": r.randint(2, 5)},
       "Return the elements of xs that are divisible by {k}, in their original order.",
       "    return [x for x in xs if x % {k} == 0]"),
    _T("list.clip_values", "list", "ints", "ints", "clip_values",
       lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(3, 12)})(r.randint(-5, 5)),
       "Return xs with every element smaller than {lo} replaced by {lo} and every element larger "
       "than {hi} replaced by {hi}.",
       "    return [min(max(x, {lo}), {hi}) for x in xs]"),
    _T("list.sum_parity", "list", "ints", "int", "sum_parity",
       _pick({"which": "even", "r": 0}, {"which": "odd", "r": 1}),
       "Return the sum of the {which} numbers in xs (0 if there are none).",
       "    return sum(x for x in xs if x % 2 == {r})"),
    _T("list.total", "list", "ints", "int", "total",
       _pick({"what": "the sum of the elements of xs", "expr": "sum(xs)"},
             {"what": "the sum of the squares of the elements of xs", "expr": "sum(x * x for x in xs)"},
             {"what": "the number of elements of xs", "expr": "len(xs)"}),
       "Return {what}.",
       "    return {expr}"),
    _T("list.count_above", "list", "ints", "int", "count_above",
       lambda r: {"t": r.randint(-3, 10)},
       "Return how many elements of xs are greater than {t}.",
       "    return sum(1 for x in xs if x > {t})"),
    _T("list.spread", "list", "ints", "int", "spread",
       lambda r: dict(r.choice(({"what": "the largest element of xs minus the smallest", "expr": "max(xs) - min(xs)"},
                                {"what": "the largest element of xs", "expr": "max(xs)"},
                                {"what": "the smallest element of xs", "expr": "min(xs)"})), d=r.randint(-1, 3)),
       "Return {what} ({d} for an empty list).",
       "    return {expr} if xs else {d}"),
    _T("list.running_total", "list", "ints", "ints", "running_total",  # OOD
       lambda r: {},
       "Return the running totals of xs: element i of the result is xs[0] + ... + xs[i].",
       "    out, acc = [], 0\n    for x in xs:\n        acc += x\n        out.append(acc)\n    return out"),
    # ----- dict aggregation: one dict comprehension or counting loop each (calibration: 0 % with
    # multiplied counts and remainder histograms).
    _T("dict.count_words", "dict", "words", "counts", "count_words",
       lambda r: {},
       "Return a dict mapping each word in words to the number of times it occurs in words.",
       "    out = {{}}\n    for w in words:\n        out[w] = out.get(w, 0) + 1\n    return out"),
    _T("dict.word_lengths", "dict", "words", "counts", "word_lengths",
       lambda r: r.choice(({"what": "len(w), its number of characters", "expr": "len(w)"},
                           (lambda c: {"what": f"w.count({c!r}), how many times '{c}' occurs in it",
                                       "expr": f"w.count({c!r})"})(r.choice("aeiolnrt")))),
       "Return a dict mapping each word w in words to {what}.",
       "    return {{w: {expr} for w in words}}"),
    _T("dict.map_numbers", "dict", "ints", "icounts", "map_numbers",
       lambda r: {"expr": r.choice(("x * {}", "x + {}")).format(r.randint(2, 5))},
       "Return a dict mapping each element x of xs to {expr}.",
       "    return {{x: {expr} for x in xs}}"),
    _T("dict.keep_frequent", "dict", "counts", "counts", "keep_frequent",
       lambda r: {"t": r.randint(2, 6)},
       "Return a dict with only the items (k, v) of counts where v >= {t}.",
       "    return {{k: v for k, v in counts.items() if v >= {t}}}"),
    _T("dict.scale_values", "dict", "counts", "counts", "scale_values",
       lambda r: {"k": r.randint(2, 5)},
       "Return a dict with the same keys as counts and every value multiplied by {k}.",
       "    return {{k: v * {k} for k, v in counts.items()}}"),
    _T("dict.count_initials", "dict", "words", "counts", "count_initials",  # OOD
       lambda r: {},
       "Return a dict mapping each first letter of the words in words to how many words start with it.",
       "    out = {{}}\n    for w in words:\n        out[w[0]] = out.get(w[0], 0) + 1\n    return out"),
    # ----- formatting: values -> a string. The spec spells out the expression (calibration: 8 %
    # with prose-only specs; answers added punctuation or repeated the value).
    _T("format.label_number", "format", "int", "out", "label_number",
       lambda r: {"prefix": r.choice(("total: ", "n=", "Result ", "value ", "count: ", "sum=", "answer: ", "x = "))},
       "Return {prefix!r} + str(n).",
       "    return {prefix!r} + str(n)"),
    _T("format.join_numbers", "format", "ints", "out", "join_numbers",
       lambda r: {"sep": r.choice((", ", "-", " ", ";"))},
       "Return the elements of xs converted with str and joined by {sep!r}.",
       "    return {sep!r}.join(str(x) for x in xs)"),
    _T("format.join_words", "format", "words", "out", "join_words",
       _pick({"sep": " ", "how": "upper case (w.upper())", "op": ".upper()"},
             {"sep": "-", "how": "upper case (w.upper())", "op": ".upper()"},
             {"sep": ", ", "how": "capitalized (w.capitalize())", "op": ".capitalize()"},
             {"sep": " ", "how": "as they are", "op": ""}),
       "Return the words, each {how}, joined by {sep!r}.",
       "    return {sep!r}.join(w{op} for w in words)"),
    _T("format.format_counts", "format", "counts", "out", "format_counts",
       lambda r: {"kv": r.choice(("=", ":", " ")), "sep": r.choice((", ", ";", " ", "|"))},
       "Return the items (k, v) of counts, in order, each written as f'{{k}}{kv}{{v}}', joined by {sep!r}.",
       "    return {sep!r}.join(f'{{k}}{kv}{{v}}' for k, v in counts.items())"),
    _T("format.wrap_text", "format", "text", "out", "wrap_text",
       lambda r: (lambda p: {"l": p[0], "r": p[1]})(r.choice(("[]", "()", "<>", "{}", "**", "__", "||", "\"\""))),
       "Return {l!r} + text + {r!r}.",
       "    return {l!r} + text + {r!r}"),
    _T("format.pad_number", "format", "int", "out", "pad_number",  # OOD
       lambda r: {"w": r.randint(3, 6)},
       "Return str(n) padded on the left with zeros to at least {w} characters (as str.zfill does).",
       "    return str(n).zfill({w})"),
)
TEMPLATES: Mapping[str, Template] = {t.key: t for t in TEMPLATE_LIST}
# Held out of train and iid tasks; every OOD task uses at least one (one per kind).
OOD_TEMPLATES = ("string.shorten_words", "parsing.parse_pairs", "list.running_total", "dict.count_initials",
                 "format.pad_number")

assert len(TEMPLATES) == len(TEMPLATE_LIST), "duplicate template key"
assert len({t.name for t in TEMPLATE_LIST}) == len(TEMPLATE_LIST), "duplicate function name"
assert all(t.kind in KINDS and t.in_type in TYPES and t.out_type in TYPES for t in TEMPLATE_LIST)
assert all(t.source is not None for t in TEMPLATE_LIST if TYPES[t.in_type][2] is None), "source-only type without source"


def draw_spec(template: Template, rng: random.Random) -> FunctionSpec:
    """The template with its parameters drawn from ``rng``."""
    p = template.params(rng)
    return FunctionSpec(template.key, template.kind, template.in_type, template.out_type, template.name,
                        template.doc.format(**p), f"{_header(template)}\n{template.body.format(**p)}\n",
                        tuple(sorted(p.items())))


def _header(t: Template) -> str:
    return f"def {t.name}({TYPES[t.in_type][1]}: {TYPES[t.in_type][0]}) -> {TYPES[t.out_type][0]}:"


def reference_function(source: str, name: str) -> Callable:
    """The function ``name`` defined by trusted reference ``source`` (our own code, not a model's)."""
    ns: dict = {}
    exec(compile(source, f"<reference {name}>", "exec"), ns)  # noqa: S102 -- trusted template code
    return ns[name]
