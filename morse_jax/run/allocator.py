"""A malloc that keeps freed memory: re-execute the process with tcmalloc (or jemalloc) preloaded.

Why: XLA:CPU gives each run of a compiled program fresh temporary buffers (an update step's
attention residuals, MLP activations, logit chunks: ~3 GB per ``bench/train_step.py`` update),
and glibc's malloc serves blocks above its mmap threshold (at most 32 MiB) with ``mmap`` and hands
them back to the kernel on ``free``. Every run then first-touches every page of them again: 0.76 M
page faults per update, each a zeroed page from the kernel. With tcmalloc the pages stay in the
process and are reused (~9 K faults per update), and the update no longer slows down when another
process (a transformers peer, a sandboxed test run) used the memory in between.
Measured in README "Performance" (``bench/train_step.py``, ``MORSE_JAX_MALLOC=system`` vs default).

The choice is the environment variable ``MORSE_JAX_MALLOC``: ``tcmalloc`` (default), ``jemalloc``
or ``system`` (glibc, no re-execution). A library is preloaded only by re-executing the process
(``LD_PRELOAD`` is read by the dynamic loader at start-up), so the entry points call
:func:`reexec_with_allocator` first thing (``morse_jax.main``, the ``bench/`` scripts); ``execve``
keeps the process id, so launchers and schedulers see no new process. Child processes inherit the
preload through the environment. Linux only; where the library is not installed (Debian:
``apt install libtcmalloc-minimal4`` / ``libjemalloc2``) the process goes on with the system
malloc, and ``morse_jax.main`` logs which malloc it runs with and why.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

ENV = "MORSE_JAX_MALLOC"
CHOICES = ("tcmalloc", "jemalloc", "system")
# Set in the re-executed process, so a library that failed to load cannot cause a loop.
REEXECUTED_ENV = "MORSE_JAX_MALLOC_REEXECUTED"
SONAMES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "jemalloc": ("libjemalloc.so.2",)}
SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
               "/usr/local/lib")


def find_library(name: str, search_dirs: Sequence[str] = SEARCH_DIRS) -> str | None:
    """Path of the first installed shared object of allocator ``name`` (a key of ``SONAMES``)."""
    for d in search_dirs:
        for so in SONAMES[name]:
            if (Path(d) / so).is_file():
                return str(Path(d) / so)
    return None


def preload_plan(env: Mapping[str, str], loaded: str, find: Callable[[str], str | None],
                 platform: str = sys.platform) -> tuple[str | None, str]:
    """(library to preload or None, why) for the environment ``env`` and the process's mapped
    files ``loaded`` (the text of /proc/self/maps). Raises ValueError for an unknown choice."""
    choice = env.get(ENV, "tcmalloc").strip().lower() or "tcmalloc"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={env[ENV]!r}: choose one of {', '.join(CHOICES)}")
    if choice == "system":
        return None, f"{ENV}=system"
    if not platform.startswith("linux"):
        return None, f"{platform}: preloading is Linux-only"
    if mapped_allocator(loaded) == choice:
        return None, f"{choice} preloaded by re-execution" if env.get(REEXECUTED_ENV) else f"{choice} already loaded"
    if env.get(REEXECUTED_ENV):
        return None, f"{choice} was preloaded but is not mapped: system malloc"
    path = find(choice)
    if path is None:
        return None, (f"{choice} not found in {', '.join(SEARCH_DIRS)}: system malloc (Debian: apt install "
                      f"{'libtcmalloc-minimal4' if choice == 'tcmalloc' else 'libjemalloc2'})")
    return path, f"preloading {path}"


def reexec_with_allocator(argv: Sequence[str] | None = None) -> str:
    """Re-execute this Python process with the allocator of ``MORSE_JAX_MALLOC`` preloaded, or
    return why not (system malloc chosen, already loaded, not Linux, library missing), for the
    caller to log once logging is set up (``morse_jax.main`` does); nothing is printed, so a
    config error stays one line. An unknown ``MORSE_JAX_MALLOC`` exits with status 2 and one line.
    Call before anything heavy is imported. ``argv``: the interpreter arguments to run again
    (default: this process's, ``sys.orig_argv`` without the interpreter)."""
    try:
        loaded = Path("/proc/self/maps").read_text()
    except OSError:
        loaded = ""
    try:
        path, why = preload_plan(os.environ, loaded, find_library)
    except ValueError as e:  # a typo in the variable: one line, like a config error
        print(f"morse_jax: {e}", file=sys.stderr)
        sys.exit(2)
    if path is None:
        return why
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    env[REEXECUTED_ENV] = "1"
    args = list(sys.orig_argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


def mapped_allocator(loaded: str) -> str:
    """``tcmalloc``, ``jemalloc`` or ``system``: which allocator the mapped files ``loaded`` (the
    text of /proc/<pid>/maps) hold."""
    return next((name for name, sonames in SONAMES.items() if any(so in loaded for so in sonames)), "system")


def current() -> str:
    """The allocator this process runs with (for logs): :func:`mapped_allocator` of its maps."""
    try:
        return mapped_allocator(Path("/proc/self/maps").read_text())
    except OSError:
        return "system"
