"""Tests for morse_jax.kernels: the native CPU matmul, decode attention and top-k against numpy, and
the build rules.

The kernel has three code paths (dot form for 1-4 columns, 8- and 16-wide broadcast blocks,
partial blocks copied and padded) and row/K tails; the shapes below reach each of them. The SIMD
vector width is chosen per ISA at build time, so every numeric test runs the default build and
builds forced to 16, 32 and 64 bytes (SSE, AVX2 and AVX-512-width code, all runnable here).
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_block_weights as bw

from morse_jax.kernels import KernelBuildError, decode_attention, ensure_registered, matmul_cols, native, top_k, \
    unavailable_reason
from morse_jax.kernels import block_matmul as bm
from morse_jax.models.key_tiles import KEY_TILE, tile_keys

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None
                                    and shutil.which("clang++") is None, reason="no C++ compiler on this machine")


WIDTHS = [None, 16, 32, 64]  # None: the ISA's width (what the sampler uses)


@pytest.fixture(scope="module")
def kernel():
    reason = unavailable_reason()
    assert reason is None, f"the native kernel should build here: {reason}"
    return jax.jit(matmul_cols)


@pytest.fixture(scope="module", params=WIDTHS, ids=lambda w: f"vec{w or 'isa'}")
def width(request):
    """A vector width with both kernels built and registered at it."""
    if request.param is None:
        assert unavailable_reason() is None
    else:
        ensure_registered(request.param)
    return request.param


@needs_compiler
@pytest.mark.parametrize("N,K,B", [(1, 1, 1), (7, 5, 1), (64, 576, 1), (13, 17, 2), (9, 33, 3), (40, 48, 4),
                                   (9, 33, 5), (100, 40, 8), (70, 20, 12), (129, 64, 16), (65, 31, 17),
                                   (200, 64, 24), (33, 100, 33), (1000, 576, 16)]
                         # every tail of the broadcast form's row blocks (up to 8 rows) at 8 and 16 columns
                         + [(n, 37, b) for b in (8, 16) for n in (*range(1, 16), 64 + 7, 64 + 13)])
def test_matches_numpy(width, N, K, B):
    rng = np.random.default_rng(N * 1000 + K * 10 + B)
    w = rng.normal(size=(N, K)).astype(np.float32)
    x = rng.normal(size=(K, B)).astype(np.float32)
    got = np.asarray(jax.jit(lambda w, x: matmul_cols(w, x, vec_bytes=width))(w, x))
    want = w.astype(np.float64) @ x.astype(np.float64)
    assert got.shape == (N, B) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.sqrt(K) * 4)


@needs_compiler
@pytest.mark.parametrize("N,K,B", [(0, 4, 3), (5, 0, 2), (5, 4, 0)])
def test_empty_shapes(kernel, N, K, B):
    got = np.asarray(kernel(np.ones((N, K), np.float32), np.ones((K, B), np.float32)))
    assert got.shape == (N, B) and not got.any()


@needs_compiler
def test_inside_a_while_loop(kernel):
    """The custom call as a decode loop uses it: inside lax.fori_loop, on transposed operands."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(48, 48)).astype(np.float32) / 7)
    x0 = jnp.asarray(rng.normal(size=(6, 48)).astype(np.float32))

    def run(mm):
        return jax.jit(lambda w, x: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(mm(w, x.T).T), x))(w, x0)

    np.testing.assert_allclose(np.asarray(run(matmul_cols)), np.asarray(run(jnp.matmul)), atol=1e-5)


def test_rejects_bad_operands():
    with pytest.raises(ValueError, match="float32"):
        matmul_cols(jnp.ones((4, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        matmul_cols(jnp.ones((4, 3)), jnp.ones((4, 2)))


def test_build_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("MORSE_JAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(KernelBuildError, match="CXX='no-such-compiler-xyz'"):
        native.build.__wrapped__("cpu_matmul")
    monkeypatch.setenv("CXX", "false")  # runs, fails: the error carries the command
    with pytest.raises(KernelBuildError, match="compiling cpu_matmul.cc failed"):
        native.build.__wrapped__("cpu_matmul")
    assert not list(tmp_path.glob("*.so")), "a failed build must not leave a library behind"
    with pytest.raises(KernelBuildError, match="no kernel source"):
        native.build.__wrapped__("no_such_kernel")


@needs_compiler
def test_build_is_cached_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("MORSE_JAX_KERNEL_CACHE", str(tmp_path))
    first = native.build.__wrapped__("cpu_matmul")
    assert first.parent == tmp_path and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert native.build.__wrapped__("cpu_matmul") == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setattr(native, "_cpu_signature", lambda: "another machine")
    assert native.build.__wrapped__("cpu_matmul") != first  # -march=native: one library per CPU type


def test_forced_width_has_its_own_library_and_flags(monkeypatch, tmp_path):
    """A forced width is its own cache entry, built with the flags that make the compiler's target
    match it (a stand-in compiler records the command line: no real compile needed)."""
    log = tmp_path / "cmds"
    fake = tmp_path / "fake-cxx"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nfor a; do [ "$prev" = -o ] && : > "$a"; prev=$a; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("MORSE_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.delenv("MORSE_JAX_KERNEL_VEC_BYTES", raising=False)
    isa = native.build.__wrapped__("cpu_matmul")
    forced = {w: native.build.__wrapped__("cpu_matmul", w) for w in (16, 32, 64)}
    assert len({isa, *forced.values()}) == 4, "every width has its own library"
    monkeypatch.setenv("MORSE_JAX_KERNEL_VEC_BYTES", "32")
    assert native.build.__wrapped__("cpu_matmul") == forced[32]  # the switch forces the default build
    builds = [ln for ln in log.read_text().splitlines() if "cpu_matmul.cc" in ln]
    assert len(builds) == 4 and "MORSE_VEC_BYTES" not in builds[0]
    for line, w in zip(builds[1:], (16, 32, 64)):
        assert f"-DMORSE_VEC_BYTES={w}" in line.split()
        if platform.machine().lower() in ("x86_64", "amd64"):
            cap = {16: ["-mno-avx"], 32: ["-mno-avx512f"], 64: []}[w]
            assert [f for f in line.split() if f.startswith("-mno-")] == cap


def isa_vec_bytes() -> int | None:
    """The width cpu_common.h should pick from -march=native here, read from /proc/cpuinfo
    (None where that cannot be read: not x86 Linux)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").is_file():
        return None
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    return 64 if "avx512f" in flags else 32 if "avx" in flags else 16


@needs_compiler
@pytest.mark.parametrize("name", ["cpu_matmul", "decode_attention", "topk", "block_matmul"])
def test_vector_width_follows_the_isa_or_the_switch(name):
    """The default build uses the ISA's widest vectors (AVX-512F: 64 bytes, AVX/AVX2: 32, else 16);
    a forced width is what the library was compiled with."""
    want = isa_vec_bytes()
    if want is not None:
        assert native.built_vec_bytes(name) == want
    for w in (16, 32, 64):
        assert native.built_vec_bytes(name, w) == w


def test_bad_vector_width_is_rejected(monkeypatch):
    with pytest.raises(KernelBuildError, match="must be one of"):
        native.build.__wrapped__("cpu_matmul", 24)
    monkeypatch.setenv("MORSE_JAX_KERNEL_VEC_BYTES", "wide")
    with pytest.raises(KernelBuildError, match="MORSE_JAX_KERNEL_VEC_BYTES='wide'"):
        native.build.__wrapped__("cpu_matmul")


# --------------------------------------------------------------------------- decode attention


def attention_reference(q, keys, values, mask, scale):
    """float64 numpy: softmax over the allowed slots, as morse_jax.models.decode._attend."""
    N, G, D = q.shape
    B = mask.shape[0]
    m = np.repeat(mask, N // B, axis=0)[:, None, :]
    s = np.einsum("ngd,nds->ngs", q.astype(np.float64), keys.astype(np.float64)) * scale
    s = np.where(m, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ngs,nsd->ngd", p, values.astype(np.float64))


@needs_compiler
@pytest.mark.parametrize("B,K,G,D,S", [(1, 3, 3, 64, 384), (4, 3, 3, 64, 40), (2, 2, 4, 8, 32), (3, 1, 5, 20, 50),
                                       (2, 2, 1, 256, 70), (2, 2, 6, 100, 129), (1, 1, 1, 1, 1)])
def test_attention_matches_numpy(width, B, K, G, D, S):
    """Masks with a left pad, holes (a sliding window, invalid slots) and an unwritten tail; scores
    large enough that the softmax normaliser matters."""
    rng = np.random.default_rng(B * 100 + G * 10 + D)
    q = rng.normal(size=(B * K, G, D)).astype(np.float32)
    keys = rng.normal(size=(B * K, D, S)).astype(np.float32)
    values = rng.normal(size=(B * K, S, D)).astype(np.float32)
    mask = np.zeros((B, S), bool)
    for b in range(B):
        lo, hi = int(rng.integers(0, max(1, S // 3))), S - int(rng.integers(0, max(1, S // 4)))
        mask[b, lo:hi] = True
        mask[b, rng.integers(lo, hi, size=S // 10)] = False
        mask[b, hi - 1] = True
    scale = 2.0 / np.sqrt(D)
    got = np.asarray(jax.jit(lambda *a: decode_attention(*a, scale, vec_bytes=width))(q, tile_keys(keys), values,
                                                                                     mask))
    np.testing.assert_allclose(got, attention_reference(q, keys, values, mask, scale), rtol=0, atol=2e-6)


@needs_compiler
def test_attention_ignores_masked_slots_and_zeroes_empty_rows(width):
    """Huge values in masked slots do not reach the output, slots past the last valid one are
    never read (NaN there stays out); a row with no valid slot (padding) gives zeros."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(4, 2, 16)).astype(np.float32)
    keys = rng.normal(size=(4, 16, 24)).astype(np.float32)
    values = rng.normal(size=(4, 24, 16)).astype(np.float32)
    mask = np.zeros((2, 24), bool)
    mask[0, 3:10] = True
    keys[:2, :, 10:], values[:2, 10:], keys[:2, :, :3], values[:2, :3] = np.nan, np.nan, 1e30, 1e30
    got = np.asarray(jax.jit(lambda *a: decode_attention(*a, 0.25, vec_bytes=width))(q, tile_keys(keys), values,
                                                                                    mask))
    np.testing.assert_allclose(got[:2], attention_reference(q[:2], keys[:2, :, 3:10], values[:2, 3:10],
                                                            mask[:1, 3:10], 0.25), atol=2e-6)
    assert not got[2:].any()


@needs_compiler
def test_attention_skips_whole_tiles_before_the_first_valid_slot(width):
    """A row whose first valid slot lies past whole key tiles (left padding, a refilled slot)
    never reads those tiles (NaN there stays out), and its output is bitwise what the same row
    gives with those tiles cut off the cache (same lanes, exact zeros added)."""
    T = KEY_TILE
    rng = np.random.default_rng(1)
    B, K, G, D, S = 3, 2, 3, 24, 5 * T
    q = rng.normal(size=(B * K, G, D)).astype(np.float32)
    keys = rng.normal(size=(B * K, D, S)).astype(np.float32)
    values = rng.normal(size=(B * K, S, D)).astype(np.float32)
    mask = np.zeros((B, S), bool)
    firsts = (2 * T + 3, 2 * T, T - 1)  # inside tile 2, at its start, inside tile 0
    for b, first in enumerate(firsts):
        mask[b, first:S - 4] = True
    run = jax.jit(lambda *a: decode_attention(*a, 0.5, vec_bytes=width))
    skipped = 2 * T  # whole tiles before row 0's and row 1's first valid slot
    keys[:2 * K, :, :skipped], values[:2 * K, :skipped] = np.nan, np.nan
    got = np.asarray(run(q, tile_keys(keys), values, mask))
    np.testing.assert_allclose(got, attention_reference(np.nan_to_num(q), np.nan_to_num(keys),
                                                        np.nan_to_num(values), mask, 0.5), rtol=0, atol=2e-6)
    cut = np.asarray(run(q[:2 * K], tile_keys(keys[:2 * K, :, skipped:]), values[:2 * K, skipped:],
                         mask[:2, skipped:]))
    np.testing.assert_array_equal(got[:2 * K], cut)


def test_attention_rejects_bad_operands():
    q, k, v, m = jnp.ones((4, 2, 8)), jnp.ones((4, 1, 8, 16)), jnp.ones((4, 16, 8)), jnp.ones((2, 16), bool)
    with pytest.raises(ValueError, match="T a multiple of 16"):
        decode_attention(q, jnp.ones((4, 8, 16)), v, m, 1.0)  # the untiled [N, D, S]
    with pytest.raises(ValueError, match="T a multiple of 16"):
        decode_attention(q, jnp.ones((4, 2, 8, 8)), v, m, 1.0)
    with pytest.raises(ValueError, match="float32"):
        decode_attention(q.astype(jnp.bfloat16), k, v, m, 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        decode_attention(q, k, v, m.astype(jnp.float32), 1.0)
    with pytest.raises(ValueError, match="expects q"):
        decode_attention(q, k, v[:, :8], m, 1.0)
    with pytest.raises(ValueError, match="multiple of B"):
        decode_attention(q, k, v, jnp.ones((3, 16), bool), 1.0)


# --------------------------------------------------------------------------- top-k


def top_k_reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """From the definition: per row, the k entries first in IEEE total order descending (NaN above
    +inf, +0 above -0), equal entries by the lower index."""
    def total_order(v: np.float32) -> int:
        b = int(np.array(v, np.float32).view(np.uint32))
        return (b ^ 0xFFFFFFFF) if b & 0x80000000 else (b | 0x80000000)

    ids = np.array([sorted(range(x.shape[1]), key=lambda i: (-total_order(row[i]), i))[:k] for row in x], np.int32)
    return np.take_along_axis(x, ids, axis=1), ids


def logits_like(rng, B, V):
    """A peaked head over a normal bulk, like a language model's logits at temperature 0.7."""
    x = rng.normal(size=(B, V)).astype(np.float32) * 2.5
    x[np.arange(B)[:, None], rng.integers(0, V, size=(B, 5))] += 12.0
    return x


@needs_compiler
@pytest.mark.parametrize("B,V,k", [(16, 4096, 256), (3, 1000, 7), (2, 63, 63), (4, 65, 10), (1, 200, 1),
                                   (2, 129, 3), (1, 70, 2)])
def test_top_k_matches_the_definition_and_lax(width, B, V, k):
    """Row lengths off the 64-entry blocks, k above the number of blocks (V = 63, 65, 129 with k
    3 or 10: the whole-row path), k = 1."""
    x = logits_like(np.random.default_rng(V + k), B, V)
    vals, ids = jax.jit(lambda x: top_k(x, k, vec_bytes=width))(x)
    want_vals, want_ids = top_k_reference(x, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(vals), want_vals)
    lax_vals, lax_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(lax_ids))


@needs_compiler
def test_top_k_ties_signed_zeros_infinities_and_nan(width):
    """Exact ties at the k-th place go to the lower indices; +0 ranks above -0; a row with a NaN
    puts it first; -inf rows and a lone finite value."""
    rng = np.random.default_rng(1)
    tied = np.round(rng.normal(size=(2, 3000))).astype(np.float32)  # many equal values, -0.0 among them
    zeros = np.tile(np.array([0.0, -0.0, 1.0, -0.0, 0.0, -1.0], np.float32), (1, 50))
    special = rng.normal(size=(2, 3000)).astype(np.float32)
    special[0, 17], special[1, 3], special[1, 9] = np.nan, np.inf, -np.inf
    lone = np.full((1, 640), -np.inf, np.float32)
    lone[0, 100] = 1.0
    for x, k in [(tied, 300), (tied, 1), (zeros, 200), (special, 50), (lone, 64)]:
        vals, ids = jax.jit(lambda x: top_k(x, k, vec_bytes=width))(x)
        want_vals, want_ids = top_k_reference(x, k)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_array_equal(np.asarray(vals), want_vals)  # (NaN == NaN for this assertion)


def test_top_k_rejects_bad_operands():
    with pytest.raises(ValueError, match="float32"):
        top_k(jnp.ones((2, 8), jnp.bfloat16), 2)
    with pytest.raises(ValueError, match="float32"):
        top_k(jnp.ones((8,)), 2)
    with pytest.raises(ValueError, match="k must be"):
        top_k(jnp.ones((2, 8)), 9)


# --------------------------------------------------------------------------- block_matmul


@needs_compiler
def test_block_unpack_runs_at_the_builds_own_width(width):
    """The block kernel unpacks with intrinsics of its build's vector width or with plain loops,
    never with another width's: an AVX2 unpack (256-bit stores) read back as 512-bit vectors misses
    store forwarding (Q4_1 3.4x slower at width 64 than at 32, 2026-12-07). Where the CPU has the
    width's instructions, the intrinsics are used."""
    built = native.built_vec_bytes("block_matmul", width)
    unpack = bm.unpack_simd_bytes(width)
    assert unpack in (0, built), f"a {built}-byte build unpacks {unpack}-byte vectors"
    isa = {64: "avx512f", 32: "avx2"}.get(built)
    if platform.machine().lower() in ("x86_64", "amd64") and isa and isa in _cpu_flags():
        assert unpack == built, f"the {built}-byte build has {isa} but unpacks with plain loops"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@needs_compiler
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k,b", [(1, 32, 1), (77, 576, 1), (33, 64, 2), (130, 1536, 3), (64, 96, 4)])
def test_block_matmul_matches_the_definition(width, kind, n, k, b):
    raw = bw.random_blocks(kind, n, k, seed=n + k + b)
    w = jax.tree.map(jnp.asarray, bm.from_gguf_blocks(raw, kind))
    x = np.random.default_rng(b).standard_normal((k, b)).astype(np.float32)
    got = np.asarray(jax.jit(lambda w, x: bm.block_matmul_cols(w, x, vec_bytes=width))(w, jnp.asarray(x)))
    want = bw.dequantize_by_definition(raw, kind) @ x.astype(np.float64)
    assert got.shape == (n, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
