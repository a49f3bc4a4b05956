"""The data-only format in which values leave a sandbox (DESIGN §3: generated code is untrusted).

A sandboxed program records values (test outputs); they travel to the trusted verifier as JSON
built only from ``null``/bools/numbers/strings/lists and one-key tagged objects, so that decoding
never runs code and never unpickles anything. What it carries:

=================  ====================================================================
Python value       wire form
=================  ====================================================================
None, bool, str    as JSON; int as JSON up to ``MAX_INT_BITS`` bits
float              JSON number; nan / inf / -inf as ``{"$float": "nan"}`` etc.
complex            ``{"$complex": [re, im]}`` (each a float form)
list / tuple       JSON list / ``{"$tuple": [...]}``
dict               ``{"$dict": [[key, value], ...]}`` (keys of any carried type, order kept)
numpy array        ``{"$ndarray": [dtype.str, shape, base64 bytes]}`` for bool/int/uint/float/
                   complex dtypes (C order); str arrays and object arrays element-wise
                   (``{"$strarray"|"$objarray": [shape, [items...]]}``)
numpy scalar       ``{"$npscalar": [dtype.str, base64 bytes]}``
scipy sparse       ``{"$sparse": [format, shape, data, row, col]}`` (COO parts, any format)
sympy Symbol       ``{"$symbol": name}``; a sympy number as its complex / float / int value
=================  ====================================================================

Anything else (functions, modules, custom classes, generators ...) is refused by :func:`encode`
with a :class:`WireError` naming the type: the test then fails with that reason. Subclasses of
carried types are sent as their base type (an ndarray subclass that lies about ``==`` arrives as
a plain ndarray).

:func:`decode` is the trusted side: it checks every shape, dtype, length, nesting depth and the
total size (``max_bytes``) before it builds a value, and it only calls numpy / scipy / sympy
constructors. This module has no imports from morse_jax on purpose: the sandbox harness ships its
source text into the sandbox (``SOURCE``) so both sides use this one implementation.
"""

from __future__ import annotations

import base64
import json
import math

MAX_DEPTH = 64  # nesting of lists / tuples / dicts
MAX_INT_BITS = 13_000  # ~3900 digits; Python refuses str(int) beyond 4300 digits by default
MAX_NDIM = 32
_NUMERIC_KINDS = "biufc"


class WireError(ValueError):
    """A value that the data-only format cannot carry, or malformed / oversized wire data."""


# ============================================================================ encode (sandbox side)


def _float(x):
    x = float(x)
    if math.isnan(x):
        return {"$float": "nan"}
    if math.isinf(x):
        return {"$float": "inf" if x > 0 else "-inf"}
    return x


def _np():
    import sys
    return sys.modules.get("numpy")  # never import numpy for a program that did not


def encode(value, _depth=0):
    """A JSON-compatible, data-only form of ``value``; raises :class:`WireError` for other types."""
    if _depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH} levels")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if isinstance(value, bool):
        return bool(value)
    np = _np()
    if np is not None:
        if isinstance(value, np.ndarray):
            return _encode_array(np, value, _depth)
        if isinstance(value, np.generic):
            arr = np.asarray(value)
            if arr.dtype.kind in _NUMERIC_KINDS:
                return {"$npscalar": [arr.dtype.str, base64.b64encode(arr.tobytes()).decode()]}
            if arr.dtype.kind in "US":
                return str(arr.item())
            raise WireError(f"numpy scalar of dtype {arr.dtype} cannot leave the sandbox")
    if isinstance(value, int):
        value = int(value)
        if value.bit_length() > MAX_INT_BITS:
            raise WireError(f"int of more than {MAX_INT_BITS} bits")
        return value
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, complex):
        return {"$complex": [_float(value.real), _float(value.imag)]}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, _depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, list):
        return [encode(v, _depth + 1) for v in list.__iter__(value)]
    if isinstance(value, dict):
        return {"$dict": [[encode(k, _depth + 1), encode(v, _depth + 1)]
                          for k, v in dict.items(value)]}
    import sys
    sps = sys.modules.get("scipy.sparse")
    if sps is not None and sps.issparse(value):
        coo = value.tocoo()
        return {"$sparse": [str(value.format), [int(n) for n in value.shape],
                            _encode_array(np, np.asarray(coo.data), _depth),
                            _encode_array(np, np.asarray(coo.row, dtype=np.int64), _depth),
                            _encode_array(np, np.asarray(coo.col, dtype=np.int64), _depth)]}
    sympy = sys.modules.get("sympy")
    if sympy is not None and isinstance(value, sympy.Basic):
        if isinstance(value, sympy.Symbol):
            return {"$symbol": str(value.name)}
        if getattr(value, "is_number", False) and not value.free_symbols:
            if value.is_Integer:
                return encode(int(value), _depth)
            c = complex(value)
            return encode(c.real if c.imag == 0 else c, _depth)
    raise WireError(f"a value of type {t.__module__}.{t.__qualname__} cannot leave the sandbox "
                    "(the data-only format carries None, bool, int, float, complex, str, list, "
                    "tuple, dict, numpy arrays and scalars, scipy sparse matrices, sympy symbols)")


def _encode_array(np, value, depth):
    arr = np.ascontiguousarray(np.asarray(value).view(np.ndarray))
    if arr.ndim > MAX_NDIM:
        raise WireError(f"array with more than {MAX_NDIM} dimensions")
    shape = [int(n) for n in arr.shape]
    if arr.dtype.kind in _NUMERIC_KINDS:
        if arr.dtype.fields is not None or arr.dtype.subdtype is not None:
            raise WireError(f"structured array of dtype {arr.dtype} cannot leave the sandbox")
        return {"$ndarray": [arr.dtype.str, shape, base64.b64encode(arr.tobytes()).decode()]}
    if arr.dtype.kind in "US":
        return {"$strarray": [shape, [str(x) for x in arr.reshape(-1).tolist()]]}
    if arr.dtype.kind == "O":
        return {"$objarray": [shape, [encode(x, depth + 1) for x in arr.reshape(-1)]]}
    raise WireError(f"array of dtype {arr.dtype} cannot leave the sandbox")


def dumps(value) -> str:
    """``encode`` then one line of JSON (no NaN literals: they are tagged)."""
    return json.dumps(encode(value), allow_nan=False, separators=(",", ":"))


# ============================================================================ decode (trusted side)


class _Budget:
    def __init__(self, max_bytes):
        self.left = max_bytes

    def take(self, n, what):
        self.left -= n
        if self.left < 0:
            raise WireError(f"recorded values exceed the size limit (at {what})")


def loads(text: str, max_bytes: int = 64 << 20):
    """Decode one :func:`dumps` line into trusted Python / numpy / scipy / sympy values."""
    if not isinstance(text, str):
        raise WireError(f"wire data must be str, got {type(text).__name__}")
    if len(text) > max_bytes:
        raise WireError(f"wire data of {len(text)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise WireError(f"malformed wire data: {e}") from None
    return decode(obj, max_bytes)


def _no_constant(name):
    raise WireError(f"bare {name} is not valid wire data (floats are tagged)")


def decode(obj, max_bytes: int = 64 << 20):
    """The value of a decoded JSON wire object (see the module table); :class:`WireError` if malformed."""
    return _decode(obj, 0, _Budget(max_bytes))


def _decode(obj, depth, budget):
    if depth > MAX_DEPTH + 2:
        raise WireError("wire data nested too deeply")
    budget.take(8, "an item")
    if obj is None or isinstance(obj, (bool, str)):
        if isinstance(obj, str):
            budget.take(len(obj), "a string")
        return obj
    if isinstance(obj, int):
        if obj.bit_length() > MAX_INT_BITS:
            raise WireError("int too large")
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, list):
        return [_decode(v, depth + 1, budget) for v in obj]
    if not isinstance(obj, dict) or len(obj) != 1:
        raise WireError(f"malformed wire data: expected one tagged object, got {type(obj).__name__}")
    (tag, body), = obj.items()
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise WireError(f"malformed $float {body!r}")
        return float(body)
    if tag == "$complex":
        re, im = _pair(body, tag)
        return complex(_real(re, depth, budget), _real(im, depth, budget))
    if tag == "$tuple":
        return tuple(_decode(v, depth + 1, budget) for v in _list(body, tag))
    if tag == "$dict":
        out = {}
        for item in _list(body, tag):
            k, v = _pair(item, tag)
            k = _decode(k, depth + 1, budget)
            try:
                hash(k)
            except TypeError:
                raise WireError(f"unhashable dict key of type {type(k).__name__}") from None
            out[k] = _decode(v, depth + 1, budget)
        return out
    if tag == "$ndarray":
        return _array(body, budget)
    if tag == "$npscalar":
        dtype, data = _pair(body, tag)
        return _array([dtype, [], data], budget)[()]
    if tag in ("$strarray", "$objarray"):
        import numpy as np
        shape, items = _pair(body, tag)
        shape = _shape(shape)
        items = _list(items, tag)
        if len(items) != math.prod(shape):
            raise WireError(f"{tag}: {len(items)} items for shape {shape}")
        if tag == "$strarray":
            if not all(isinstance(x, str) for x in items):
                raise WireError("$strarray items must be strings")
            budget.take(sum(len(x) for x in items), tag)
            return np.array(items, dtype=str).reshape(shape)
        out = np.empty(len(items), dtype=object)
        for i, x in enumerate(items):
            out[i] = _decode(x, depth + 1, budget)
        return out.reshape(shape)
    if tag == "$sparse":
        import scipy.sparse as sps
        body = _list(body, tag)
        if len(body) != 5 or not isinstance(body[0], str):
            raise WireError("malformed $sparse")
        fmt, shape = body[0], _shape(body[1])
        data, row, col = (_array(_list(_tagged(b, "$ndarray"), tag), budget) for b in body[2:])
        if len(shape) != 2 or not (data.ndim == row.ndim == col.ndim == 1) or \
                not (len(data) == len(row) == len(col)) or row.dtype.kind not in "iu" or \
                col.dtype.kind not in "iu":
            raise WireError("malformed $sparse parts")
        if len(row) and (row.min() < 0 or col.min() < 0 or row.max() >= shape[0] or col.max() >= shape[1]):
            raise WireError("$sparse indices out of range")
        if fmt not in ("coo", "csr", "csc", "bsr", "dia", "dok", "lil"):
            raise WireError(f"unknown sparse format {fmt!r}")
        return sps.coo_matrix((data, (row, col)), shape=tuple(shape)).asformat(fmt)
    if tag == "$symbol":
        if not isinstance(body, str):
            raise WireError("malformed $symbol")
        import sympy
        return sympy.Symbol(body)
    raise WireError(f"unknown wire tag {tag!r}")


def _tagged(obj, tag):
    if not isinstance(obj, dict) or set(obj) != {tag}:
        raise WireError(f"expected a {tag} object")
    return obj[tag]


def _list(obj, tag):
    if not isinstance(obj, list):
        raise WireError(f"malformed {tag}: expected a list")
    return obj


def _pair(obj, tag):
    obj = _list(obj, tag)
    if len(obj) != 2:
        raise WireError(f"malformed {tag}: expected two items")
    return obj


def _real(obj, depth, budget):
    v = _decode(obj, depth + 1, budget)
    if type(v) not in (int, float):
        raise WireError("complex parts must be numbers")
    return v


def _shape(shape):
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or \
            not all(type(n) is int and 0 <= n < 1 << 40 for n in shape):
        raise WireError(f"malformed array shape {shape!r}")
    return shape


def _array(body, budget):
    import numpy as np
    body = _list(body, "$ndarray")
    if len(body) != 3 or not isinstance(body[0], str) or not isinstance(body[2], str):
        raise WireError("malformed $ndarray")
    try:
        dtype = np.dtype(body[0])
    except TypeError:
        raise WireError(f"bad dtype {body[0]!r}") from None
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"dtype {dtype} is not carried")
    shape = _shape(body[1])
    n_bytes = math.prod(shape) * dtype.itemsize
    budget.take(n_bytes, "an array")
    try:
        raw = base64.b64decode(body[2], validate=True)
    except ValueError:
        raise WireError("malformed base64 array data") from None
    if len(raw) != n_bytes:
        raise WireError(f"array data of {len(raw)} bytes for shape {shape} and dtype {dtype}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # writable, owns its memory


def _source() -> str:
    import pathlib
    return pathlib.Path(__file__).read_text(encoding="utf-8")


SOURCE = _source()  # shipped into the sandbox as a module file by the harnesses
