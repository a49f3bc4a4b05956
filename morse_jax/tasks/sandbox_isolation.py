"""Sandbox isolation set-up: rlimits, the child's environment, the bubblewrap argv, the uid pool.

Split out of :mod:`morse_jax.tasks.sandbox` (one concept per module; the policy and its
limitations are described there). Everything here *prepares* a run and starts no sandboxed
program; :mod:`~morse_jax.tasks.sandbox_process` runs one.

* :class:`_Limits` -> the rlimits set in the forked child (:func:`_preexec`).
* :func:`_child_env`: the minimal environment (no inherited secrets, tokens or proxies).
* :func:`_bwrap_argv`: the bubblewrap command line (read-only ``/``, tmpfs homes with the
  interpreter's own prefix re-bound, the run directory as ``/tmp``, no network).
* Per-run uids from ``UID_POOL``, each held through a lock file (:func:`_acquire_uid`), and
  killed as a whole after the run (:func:`_kill_uid`).
* ``_cache``: probe results per interpreter and the warnings already given (process-wide state;
  tests that reset it patch it here).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import pwd
import random
import resource
import shutil
import signal as signal_mod
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

UID_POOL = range(100_000, 104_096)  # unprivileged uids for sandboxed children (none in passwd)
INNER_WORK = "/tmp/work"  # cwd and HOME of the child under bwrap
_MIB = 1 << 20

Mode = Literal["auto", "bwrap", "rlimits"]
Kind = Literal["bwrap", "rlimits"]


# ----------------------------------------------------------------------------- isolation set-up


@dataclasses.dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_processes: int
    file_size_mb: int
    max_open_files: int

    def rlimits(self, with_nproc: bool) -> list[tuple[int, int, int]]:
        cpu = math.ceil(self.timeout_s) + 1  # SIGXCPU at the soft limit, SIGKILL 1 s later
        want = [(resource.RLIMIT_CPU, cpu, cpu + 1),
                (resource.RLIMIT_AS, self.memory_mb * _MIB, self.memory_mb * _MIB),
                (resource.RLIMIT_FSIZE, self.file_size_mb * _MIB, self.file_size_mb * _MIB),
                (resource.RLIMIT_NOFILE, self.max_open_files, self.max_open_files),
                (resource.RLIMIT_CORE, 0, 0)]
        if with_nproc:
            want.append((resource.RLIMIT_NPROC, self.max_processes, self.max_processes))
        out = []
        for res, soft, hard in want:  # never ask for more than the parent's own hard limit
            cur_hard = resource.getrlimit(res)[1]
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
            out.append((res, min(soft, hard), hard))
        return out


def _preexec(rlimits: list[tuple[int, int, int]]) -> Callable[[], None]:
    # Runs in the forked child: plain setrlimit calls only, nothing that could wait on a lock
    # another thread of the parent held at fork time.
    def apply() -> None:
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
    return apply


def _child_env(python: str, home: str, tmp: str) -> dict[str, str]:
    return {
        "PATH": os.pathsep.join([os.path.dirname(python), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


_cache_lock = threading.Lock()
_cache: dict[tuple, Any] = {}  # probe results per interpreter, and which warnings were given


def _cached(key: tuple, compute: Callable[[], Any]) -> Any:
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    value = compute()  # outside the lock: probes run sandboxes themselves
    with _cache_lock:
        return _cache.setdefault(key, value)


def _warn_once(key: str, message: str) -> None:
    with _cache_lock:
        first = ("warned", key) not in _cache
        _cache[("warned", key)] = True
    if first:
        warnings.warn(message, RuntimeWarning, stacklevel=5)  # the caller of run_python


def _interp_info(python: str) -> tuple[str, list[str]]:
    """(sys.version, directories the interpreter needs), from running it as ourselves."""
    def compute():
        script = ("import json, os, sys; print(json.dumps([sys.version, sys.prefix, "
                  "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))")
        out = subprocess.run([python, "-s", "-c", script], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"run_python: python {python!r} does not run: {out.stderr[-500:]}")
        version, *paths = json.loads(out.stdout)
        paths += [os.path.dirname(python), os.path.dirname(os.path.realpath(python))]
        return version, sorted({q for p in paths for q in (p, os.path.realpath(p)) if os.path.isdir(q)})
    return _cached(("interp", python), compute)


def _is_under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _rebind_inside(argv: list[str], top: str, needed: Sequence[str]) -> None:
    """Make the interpreter's directories under ``top`` visible again after ``top`` was replaced
    (a tmpfs home, the run's private /tmp): read-only binds, parents created 0755."""
    inside = [p for p in needed if _is_under(p, top) and p != top]
    made = {top}
    for p in inside:
        if any(p != q and _is_under(p, q) for q in inside):
            continue
        for parent in map(str, reversed(Path(p).parents)):
            if _is_under(parent, top) and parent not in made:
                # bwrap would create it 0700, unreachable for the sandbox uid
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", p, p]


def _bwrap_argv(python: str, tmp: Path, shm: Path, uid: int | None) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc"]
    needed = _interp_info(python)[1]
    homes = {"/root", os.path.expanduser("~")}  # keys, tokens, caches live there
    for home in sorted(h for h in homes if h != "/" and os.path.isdir(h) and not os.path.islink(h)):
        argv += ["--tmpfs", home]
        _rebind_inside(argv, home, needed)
    argv += ["--bind", str(tmp), "/tmp", "--bind", str(shm), "/dev/shm"]
    _rebind_inside(argv, "/tmp", needed)  # e.g. a checkout (and its .venv) under /tmp
    argv += ["--chdir", INNER_WORK]
    if uid is None:
        argv += ["--unshare-all"]
    else:  # no user namespace, or setpriv could not switch to an unmapped uid
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup-try"]
    argv += ["--die-with-parent", "--new-session", "--"]
    if uid is not None:
        argv += [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
                 "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv


# ----------------------------------------------------------------------------- uid pool


def _acquire_uid() -> tuple[int, int]:
    """(uid, lock fd) of a pool uid no other run holds; a crashed holder's leftovers are killed."""
    lock_dir = Path(tempfile.gettempdir()) / f"morse-sandbox-uids-{os.geteuid()}"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(lock_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RuntimeError(f"sandbox: uid lock directory {lock_dir} is not private to us")
    rng = random.SystemRandom()
    for _ in range(4 * len(UID_POOL)):
        uid = rng.choice(UID_POOL)
        try:
            pwd.getpwuid(uid)
            continue  # a real account: never run code as it, never kill its processes
        except KeyError:
            pass
        fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _kill_uid(uid)
        return uid, fd
    raise RuntimeError("sandbox: no free uid left in UID_POOL")


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: kill(-1) sent as that uid reaches exactly those."""
    if uid not in UID_POOL or uid == os.getuid():
        raise AssertionError(f"refusing to kill all processes of uid {uid}")

    def kill_all() -> None:
        try:
            os.kill(-1, signal_mod.SIGKILL)
        except OSError:
            pass

    subprocess.run([shutil.which("true") or "/bin/true"], user=uid, group=uid, extra_groups=[],
                   preexec_fn=kill_all, env={}, cwd="/", stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=30)
