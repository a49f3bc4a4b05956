"""Build and load the project's C++ XLA FFI kernels at first use (no build step at install).

A kernel source next to this file (with the headers here) is compiled once per machine and
source version into a shared library in a cache directory, then loaded and registered with XLA.
The library is built with ``-march=native``, so the cache key covers the source and headers,
flags, compiler, the CPU's model and feature flags, and the jax and jaxlib versions: a home
directory shared between different machines gets one library per machine type.

The kernels' SIMD vector width follows the target ISA (``cpu_common.h``: 64 bytes with
AVX-512F, 32 with AVX/AVX2, 16 otherwise). A width can be forced, to test every width's code on
one machine or to measure what an AVX2-only host would get: 32 builds with ``-mno-avx512f``
(AVX2 code), 16 with ``-mno-avx`` (SSE code) on x86-64; 64 adds nothing (on an AVX2 host that
is the old, spilling build). The forced width is part of the cache key.

Switches (environment):
  ``MORSE_JAX_KERNEL_CACHE``  cache directory (default ``$XDG_CACHE_HOME/morse_jax/kernels``,
                              i.e. ``~/.cache/morse_jax/kernels``).
  ``CXX``                     C++ compiler (default: the first of g++, c++, clang++ on PATH).
  ``MORSE_JAX_KERNEL_VEC_BYTES``  force the vector width of the default build: 16, 32 or 64
                              (default: the ISA's; the ``vec_bytes`` arguments below override it).

Every failure (no compiler, a compile error, a missing symbol) raises :class:`KernelBuildError`
with the compiler's output; callers decide whether that is fatal (``sampler.cpu_kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("morse_jax.kernels")
SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
VEC_BYTES = (16, 32, 64)
_X86 = ("x86_64", "amd64", "i386", "i686")
# what a forced width turns off on x86-64, so that the compiler's target matches the width
_X86_CAP = {16: ("-mno-avx",), 32: ("-mno-avx512f",), 64: ()}


class KernelBuildError(RuntimeError):
    """A native kernel could not be built or loaded (the message says why)."""


def cache_dir() -> Path:
    if os.environ.get("MORSE_JAX_KERNEL_CACHE"):
        return Path(os.environ["MORSE_JAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "morse_jax" / "kernels"


def compiler() -> str:
    if os.environ.get("CXX"):
        cxx = shutil.which(os.environ["CXX"])
        if cxx is None:
            raise KernelBuildError(f"CXX={os.environ['CXX']!r} is not an executable on PATH")
        return cxx
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    raise KernelBuildError("no C++ compiler found (tried g++, c++, clang++; set CXX to choose one)")


def _cpu_signature() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(dict.fromkeys(keep))
    except OSError:
        return platform.processor() or platform.machine()


def _jaxlib_version() -> str:
    """The FFI headers and ABI come with jaxlib, which may differ from jax's version."""
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx}: {e}") from e


def forced_vec_bytes(vec_bytes: int | None = None) -> int | None:
    """The forced vector width: ``vec_bytes`` if given, else ``MORSE_JAX_KERNEL_VEC_BYTES``, else
    None (the ISA's width). Raises ``KernelBuildError`` for another value."""
    if vec_bytes is None and os.environ.get("MORSE_JAX_KERNEL_VEC_BYTES"):
        raw = os.environ["MORSE_JAX_KERNEL_VEC_BYTES"]
        try:
            vec_bytes = int(raw)
        except ValueError:
            raise KernelBuildError(f"MORSE_JAX_KERNEL_VEC_BYTES={raw!r}: must be 16, 32 or 64") from None
    if vec_bytes is not None and vec_bytes not in VEC_BYTES:
        raise KernelBuildError(f"vector width {vec_bytes!r} bytes: must be one of {VEC_BYTES}")
    return vec_bytes


def width_flags(vec_bytes: int | None) -> tuple[str, ...]:
    """Compiler flags for a forced width (none for the ISA's own)."""
    if vec_bytes is None:
        return ()
    cap = _X86_CAP[vec_bytes] if platform.machine().lower() in _X86 else ()
    return (*cap, f"-DMORSE_VEC_BYTES={vec_bytes}")


@functools.cache
def build(name: str, vec_bytes: int | None = None) -> Path:
    """Compile ``<name>.cc`` from this directory (cached); returns the shared library's path.

    ``vec_bytes``: force the SIMD width (16, 32 or 64; None: ``MORSE_JAX_KERNEL_VEC_BYTES`` or
    the ISA's)."""
    import jax
    import jax.ffi

    flags = (*FLAGS, *width_flags(forced_vec_bytes(vec_bytes)))
    source = SOURCE_DIR / f"{name}.cc"
    if not source.is_file():
        raise KernelBuildError(f"no kernel source {source}")
    cxx = compiler()
    include = jax.ffi.include_dir()
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), _compiler_version(cxx),
                                    _cpu_signature(), jax.__version__, _jaxlib_version(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"  # flags (the forced width) are in the key
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent processes (pytest -n, multi-host
    # launchers on a shared home) never load a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{include}", f"-I{SOURCE_DIR}", str(source), "-o", tmp]
    log.info("building native kernel %s -> %s (once per machine and source version)", source.name, out)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling {source.name} failed to run: {e}") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
        raise KernelBuildError(f"compiling {source.name} failed: {first}\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def _load(name: str, vec_bytes: int | None, symbol: str):
    path = build(name, vec_bytes)
    try:
        return getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"loading {path} ({symbol}) failed: {e}") from e


def target_name(target: str, vec_bytes: int | None) -> str:
    """The custom-call name of a kernel built at a forced width (``target`` itself for the default
    build), so that one process can hold the same kernel at several widths."""
    return target if vec_bytes is None else f"{target}_v{vec_bytes}"


@functools.cache
def register(name: str, symbol: str, target: str, vec_bytes: int | None = None) -> None:
    """Build ``name``, load it and register its FFI handler ``symbol`` as the CPU custom call
    ``target_name(target, vec_bytes)`` (once per process)."""
    import jax.ffi

    handler = _load(name, vec_bytes, symbol)
    jax.ffi.register_ffi_target(target_name(target, vec_bytes), jax.ffi.pycapsule(handler), platform="cpu")


def built_vec_bytes(name: str, vec_bytes: int | None = None) -> int:
    """The vector width (bytes) the library of ``name`` was compiled with (``MorseVecBytes``)."""
    return build_fact(name, "MorseVecBytes", vec_bytes)


def build_fact(name: str, symbol: str, vec_bytes: int | None = None) -> int:
    """What the library of ``name`` (built at ``vec_bytes``) reports through its ``int symbol()``
    function: a fact of how it was compiled (``MorseVecBytes``, ``MorseBlockUnpackBytes``)."""
    fn = _load(name, vec_bytes, symbol)
    fn.restype = ctypes.c_int
    return int(fn())
