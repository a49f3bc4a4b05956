"""Run untrusted generated Python code in a sandboxed child process (DESIGN §3, last bullet).

Every run gets a fresh run directory (removed afterwards), a minimal environment (no inherited
secrets, tokens or proxies), rlimits on CPU time, address space, processes, file size and open
files (set in the forked child before exec), its own session / process group, stdin closed unless
given, and is killed with its whole process group on timeout. Output is read incrementally and
truncated, so a chatty program cannot exhaust the parent's memory.

Two isolation levels (``SandboxResult.sandboxed_with``):

* ``"bwrap"`` (preferred; Debian package ``bubblewrap``): a minimal, read-only filesystem view
  -- the system libraries (``/usr`` without ``/usr/local``, the loader's files in ``/etc``), the
  interpreter's own prefixes and site-packages as it reports them (the base interpreter's
  site-packages masked), fresh ``/dev`` and ``/proc`` -- plus the run directory as the child's
  private writable ``/tmp`` (cwd and HOME ``/tmp/work``) and ``/dev/shm``; nothing else of the
  host (no home, checkout, data, caches or other environments). No network (not even loopback),
  own PID/IPC/UTS namespaces, dies with its parent. As root, bwrap runs as root without a user namespace and ``setpriv`` (util-linux) drops
  the child's real uid/gid to a per-run unprivileged uid *before* the interpreter starts: root
  ignores RLIMIT_NPROC, so only then does the process limit stop a fork bomb. (The other order,
  uid first and bwrap unprivileged, cannot reach an interpreter under a 0700 home such as pyenv
  in ``/root``.)
* ``"rlimits"`` (fallback when bwrap is missing or unusable, or ``mode="rlimits"``): the same
  limits, environment and process handling, with the uid dropped when we are root and the
  interpreter still works under it; no filesystem or network isolation. Warned about once.

Per-run uids come from ``UID_POOL``, each held through a lock file, so concurrent runs (of this
or another process) never share one: the process limit is per run, and after a run every process
of its uid is killed by one ``kill(-1, SIGKILL)`` sent *as that uid* (atomic with respect to
fork; it also catches processes that left the process group with ``setsid``).

Entry-point rule: ``code`` is written to ``entry`` (default ``main.py``); when ``code`` is None,
``files`` must contain ``entry`` (SRDD's multi-file codebases). Both at once is an error.

Limitations: RLIMIT_AS is per process (no cgroup), so ``max_processes`` processes may each use
``memory_mb``. When not root there is no per-run uid and RLIMIT_NPROC (which would count all of
the user's processes) is not set: a fork bomb is stopped by the timeout and, under bwrap, the PID
namespace. Under bwrap an exit status 129..128+NSIG is read as "killed by signal status-128",
since bwrap reports a signalled child that way.

Layout (split to keep each file under ~500 lines, one concept each): this module is the public
API (:func:`run_python`, :func:`run_many`, :func:`probe_sandbox`, :class:`Job`) and the checks
of its arguments; :mod:`~morse_jax.tasks.sandbox.isolation` builds the isolation (rlimits,
environment, bubblewrap argv, uid pool); :mod:`~morse_jax.tasks.sandbox.process` performs one
run (run directory, spawn, output pump, :class:`SandboxResult`) and the isolation probes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

from morse_jax.tasks.sandbox.isolation import INNER_WORK, UID_POOL, Kind, Limits, Mode  # noqa: F401 (documented here)
from morse_jax.tasks.sandbox.process import SandboxResult, bwrap_status, resolve_mode, run_once

__all__ = ["Job", "SandboxResult", "probe_sandbox", "run_many", "run_python"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Job:
    """The arguments of one :func:`run_python` call, for :func:`run_many`."""

    code: str | None
    files: Mapping[str, str | bytes] | None = None
    timeout_s: float = 10.0
    memory_mb: int = 2048
    stdin: str | bytes | None = None
    args: Sequence[str] = ()
    max_output_bytes: int = 64_000
    entry: str = "main.py"
    max_processes: int = 64
    file_size_mb: int = 256
    max_open_files: int = 256
    python: str | None = None
    mode: Mode = "auto"
    base_dir: str | os.PathLike | None = None


def run_python(
    code: str | None,
    *,
    files: Mapping[str, str | bytes] | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 2048,
    stdin: str | bytes | None = None,
    args: Sequence[str] = (),
    max_output_bytes: int = 64_000,
    entry: str = "main.py",
    max_processes: int = 64,
    file_size_mb: int = 256,
    max_open_files: int = 256,
    python: str | None = None,
    mode: Mode = "auto",
    base_dir: str | os.PathLike | None = None,
) -> SandboxResult:
    """Run ``python -s <entry> *args`` on ``code`` + ``files`` in a sandbox.

    Args:
      code: the main script, written to ``entry``; None when ``files`` holds ``entry``.
      files: extra files: relative POSIX path (no absolute path, no ``..``) -> str or bytes.
      timeout_s: wall-clock limit; the CPU-time rlimit is ``ceil(timeout_s) + 1`` seconds.
      memory_mb: RLIMIT_AS per process. max_processes: RLIMIT_NPROC of the run's uid (as root).
      stdin: fed to the child, then closed; None means /dev/null.
      args: argv after the entry. max_output_bytes: bytes kept per stream.
      entry: relative path of the script. file_size_mb: RLIMIT_FSIZE. max_open_files: NOFILE.
      python: absolute path of the interpreter (default ``sys.executable``).
      mode: "auto" (bwrap, else rlimits with a warning), "bwrap" (required) or "rlimits".
      base_dir: where run directories are created (default: the system temp directory).

    Returns a :class:`SandboxResult` whatever the program does. Raises ValueError / TypeError
    naming the field for bad arguments, RuntimeError when ``mode="bwrap"`` is not usable.
    """
    return _execute(Job(code, files, timeout_s, memory_mb, stdin, args, max_output_bytes, entry,
                        max_processes, file_size_mb, max_open_files, python, mode, base_dir))


def run_many(jobs: Sequence[Job | Mapping[str, Any]], *, max_workers: int | None = None,
             isolate_failures: bool = False) -> list[SandboxResult]:
    """Run jobs (``Job`` or dicts of run_python's arguments) in a bounded thread pool; results in
    the order of ``jobs``. The default is one worker per CPU: timeouts are wall-clock, so
    oversubscribed CPUs would make honest programs time out.

    ``isolate_failures``: a job whose sandbox cannot be set up or run (an OSError spawning it,
    a full disk for its run directory ...) gets a failed result (returncode -1, the reason on
    stderr, logged) instead of failing the whole batch. Bad arguments still raise.
    """
    parsed = [_as_job(j, i) for i, j in enumerate(jobs)]
    if max_workers is None:
        max_workers = os.cpu_count() or 1
    if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
        raise ValueError(f"run_many: max_workers must be a positive int, got {max_workers!r}")
    if not parsed:
        return []
    for job in parsed:
        _validate(job)
    run = _execute_isolated if isolate_failures else _execute
    with ThreadPoolExecutor(min(max_workers, len(parsed)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(run, parsed))


def _execute_isolated(job: Job) -> SandboxResult:
    try:
        return _execute(job)
    except Exception as e:  # noqa: BLE001 -- one candidate's infrastructure failure, not the batch's
        log.warning("sandbox: a run failed to execute (%s: %s); its candidate scores 0", type(e).__name__, e)
        return SandboxResult(returncode=-1, stdout="", stderr=f"[sandbox: run failed: {type(e).__name__}: {e}]",
                             timed_out=False, signal=None, signal_name=None, duration_s=0.0,
                             sandboxed_with="rlimits" if job.mode == "rlimits" else "bwrap")


def probe_sandbox(python: str | None = None) -> Kind:
    """The isolation ``mode="auto"`` gives for this interpreter (probed once, then cached)."""
    return "bwrap" if bwrap_status(_check_python(python))[0] else "rlimits"


# ----------------------------------------------------------------------------- validation


def _as_job(job: Job | Mapping[str, Any], index: int) -> Job:
    if isinstance(job, Job):
        return job
    if not isinstance(job, Mapping):
        raise TypeError(f"run_many: jobs[{index}] must be a Job or a mapping, got {type(job).__name__}")
    known = {f.name for f in dataclasses.fields(Job)}
    unknown = sorted(set(job) - known)
    if unknown:
        raise ValueError(f"run_many: jobs[{index}] has unknown fields {unknown}; known: {sorted(known)}")
    if "code" not in job:
        raise ValueError(f"run_many: jobs[{index}] needs 'code' (None when files holds the entry)")
    return Job(**job)


def _rel_path(name: Any, field: str) -> PurePosixPath:
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise ValueError(f"run_python: {field} must be a non-empty str without NUL or backslash")
    if name.startswith("/"):
        raise ValueError(f"run_python: {field} {name!r} must be a relative path, not absolute")
    if any(part in ("..", ".") for part in name.split("/")):
        raise ValueError(f"run_python: {field} {name!r} must not contain '..' or '.' components")
    return PurePosixPath(name)


def _validate(job: Job) -> tuple[dict[PurePosixPath, bytes], PurePosixPath]:
    entry = _rel_path(job.entry, "entry")
    files = {} if job.files is None else job.files
    if not isinstance(files, Mapping):
        raise TypeError(f"run_python: files must map path -> str|bytes, got {type(files).__name__}")
    layout: dict[PurePosixPath, bytes] = {}
    for name, content in files.items():
        p = _rel_path(name, f"files key {name!r}")
        if not isinstance(content, (str, bytes)):
            raise TypeError(f"run_python: files[{name!r}] must be str or bytes, got {type(content).__name__}")
        if p in layout:
            raise ValueError(f"run_python: files has two keys for the path {str(p)!r}")
        layout[p] = content.encode() if isinstance(content, str) else content
    if job.code is not None:
        if not isinstance(job.code, str):
            raise TypeError(f"run_python: code must be str or None, got {type(job.code).__name__}")
        if entry in layout:
            raise ValueError(f"run_python: code was given and files also holds the entry "
                             f"{job.entry!r}; give one or the other")
        layout[entry] = job.code.encode()
    elif entry not in layout:
        raise ValueError(f"run_python: code is None, so files must hold the entry {job.entry!r}")
    for p in layout:
        for parent in p.parents:
            if parent in layout:
                raise ValueError(f"run_python: files path {str(parent)!r} is both a file and a directory")
    if isinstance(job.args, (str, bytes)) or not all(isinstance(a, str) and "\x00" not in a
                                                     for a in job.args):
        raise TypeError("run_python: args must be a sequence of str without NUL (not one str)")
    t = job.timeout_s
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < math.inf:
        raise ValueError(f"run_python: timeout_s must be a positive finite number, got {t!r}")
    for field, lo in (("memory_mb", 32), ("max_output_bytes", 0), ("max_processes", 1),
                      ("file_size_mb", 1), ("max_open_files", 16)):
        value = getattr(job, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"run_python: {field} must be an int >= {lo}, got {value!r}")
    if job.mode not in ("auto", "bwrap", "rlimits"):
        raise ValueError(f"run_python: mode must be 'auto', 'bwrap' or 'rlimits', got {job.mode!r}")
    if job.stdin is not None and not isinstance(job.stdin, (str, bytes)):
        raise TypeError(f"run_python: stdin must be str, bytes or None, got {type(job.stdin).__name__}")
    return layout, entry


def _check_python(python: str | None) -> str:
    python = sys.executable if python is None else python
    if not isinstance(python, str) or not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise ValueError(f"run_python: python must be the absolute path of an executable, got {python!r}")
    return python


def _execute(job: Job) -> SandboxResult:
    layout, entry = _validate(job)
    stdin = job.stdin.encode() if isinstance(job.stdin, str) else job.stdin
    python = _check_python(job.python)
    base = Path(tempfile.gettempdir() if job.base_dir is None else job.base_dir)
    if not base.is_dir():
        raise ValueError(f"run_python: base_dir {str(base)!r} is not a directory")
    kind = resolve_mode(job.mode, python)
    limits = Limits(job.timeout_s, job.memory_mb, job.max_processes, job.file_size_mb,
                     job.max_open_files)
    return run_once(kind, python, layout, entry, list(job.args), stdin, job.max_output_bytes, limits,
                base.resolve())
