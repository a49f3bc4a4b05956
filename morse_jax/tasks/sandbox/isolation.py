"""Sandbox isolation set-up: rlimits, the child's environment, the bubblewrap argv, the uid pool.

Split out of :mod:`morse_jax.tasks.sandbox.runner` (one concept per module; the policy and its
limitations are described there). Everything here *prepares* a run and starts no sandboxed
program; :mod:`~morse_jax.tasks.sandbox.process` runs one. The names without an underscore are
this package's internal API, used by ``process`` and ``runner``; code outside the package calls
the runner.

* :class:`Limits` -> the rlimits set in the forked child (:func:`rlimits_preexec`).
* :func:`child_env`: the minimal environment (no inherited secrets, tokens or proxies).
* :func:`bwrap_argv`: the bubblewrap command line: a minimal filesystem view (system
  libraries, the interpreter's prefixes and site-packages as discovered by :func:`interp_info`,
  fresh /dev and /proc, the run directory as ``/tmp``, nothing else of the host), no network.
* Per-run uids from ``UID_POOL``, each held through a lock file (:func:`acquire_uid`), and
  killed as a whole after the run (:func:`kill_uid`).
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
class Limits:
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


def rlimits_preexec(rlimits: list[tuple[int, int, int]]) -> Callable[[], None]:
    # Runs in the forked child: plain setrlimit calls only, nothing that could wait on a lock
    # another thread of the parent held at fork time.
    def apply() -> None:
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
    return apply


def child_env(python: str, home: str, tmp: str) -> dict[str, str]:
    return {
        "PATH": os.pathsep.join([os.path.dirname(python), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


_cache_lock = threading.Lock()
_cache: dict[tuple, Any] = {}  # probe results per interpreter, and which warnings were given


def cached_probe(key: tuple, compute: Callable[[], Any]) -> Any:
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    value = compute()  # outside the lock: probes run sandboxes themselves
    with _cache_lock:
        return _cache.setdefault(key, value)


def warn_once(key: str, message: str) -> None:
    with _cache_lock:
        first = ("warned", key) not in _cache
        _cache[("warned", key)] = True
    if first:
        warnings.warn(message, RuntimeWarning, stacklevel=5)  # the caller of run_python


# The host's system software (loader, libc, shared libraries, setpriv), read-only; /usr/local is
# masked (other interpreters, tools, caches live there) unless the interpreter itself lives there.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                 "/etc/localtime")
_MASKED_DIRS = ("/usr/local",)


@dataclasses.dataclass(frozen=True)
class _Interp:
    version: str  # sys.version, to check that the sandboxed interpreter is the same one
    needed: tuple[str, ...]  # what it reads: prefixes, executable dirs, site-packages
    hidden: tuple[str, ...]  # inside ``needed`` but not on its path: a base site-packages


def interp_info(python: str) -> _Interp:
    """What the interpreter needs to run, from running it as ourselves (discovered, not assumed:
    the venv may live anywhere, e.g. a CI checkout under /tmp)."""
    def compute():
        script = ("import json, site, sys, sysconfig\n"
                  "p = sysconfig.get_paths()\n"
                  "print(json.dumps([sys.version, [sys.prefix, sys.base_prefix, sys.exec_prefix, "
                  "sys.base_exec_prefix, p['stdlib'], p['platstdlib'], p['purelib'], p['platlib'], "
                  "*site.getsitepackages()], sys.path, "
                  "[sysconfig.get_paths(vars={'base': sys.base_prefix, 'platbase': sys.base_prefix})[k] "
                  "for k in ('purelib', 'platlib')]]))")
        out = subprocess.run([python, "-s", "-c", script], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"run_python: python {python!r} does not run: {out.stderr[-500:]}")
        version, paths, sys_path, base_site = json.loads(out.stdout)
        paths += [os.path.dirname(python), os.path.dirname(os.path.realpath(python))]
        needed = sorted({q for p in paths for q in (p, os.path.realpath(p)) if os.path.isdir(q)})
        on_path = {os.path.realpath(p) for p in sys_path if p}
        hidden = sorted({os.path.realpath(p) for p in base_site if os.path.isdir(p)} - on_path)
        return _Interp(version, tuple(needed), tuple(hidden))
    return cached_probe(("interp", python), compute)


def _is_under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


class _View:
    """Builds the bwrap options of a minimal filesystem: only what is bound exists."""

    def __init__(self, argv: list[str]):
        self.argv, self.made = argv, {"/"}

    def parents(self, path: str) -> None:
        # bwrap would create missing parents 0700, unreachable for the sandbox uid
        for parent in map(str, reversed(Path(path).parents)):
            if parent not in self.made:
                self.argv += ["--perms", "0755", "--dir", parent]
                self.made.add(parent)

    def add(self, option: str, src: str, dest: str) -> None:
        self.parents(dest)
        self.argv += [option, src, dest]
        self.made.add(dest)


def bwrap_argv(python: str, tmp: Path, shm: Path, uid: int | None) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap"]
    view = _View(argv)
    interp = interp_info(python)
    bound = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            view.add("--symlink", os.readlink(d), d)
        elif os.path.isdir(d):
            view.add("--ro-bind", d, d)
            bound.append(d)
    for f in _SYSTEM_FILES:
        if os.path.lexists(f):
            view.add("--ro-bind-try", f, f)
    masked = [d for d in _MASKED_DIRS if any(_is_under(d, b) for b in bound) and os.path.isdir(d)]
    for d in masked:
        argv += ["--tmpfs", d]

    def visible(p: str) -> bool:
        return any(_is_under(p, b) for b in bound) and not any(_is_under(p, m) for m in masked)

    def bind_needed(paths: Sequence[str], inside: str | None = None) -> None:
        todo = [p for p in paths if (inside is None or _is_under(p, inside)) and p != inside]
        for p in todo:
            if any(p != q and _is_under(p, q) for q in todo) or (inside is None and visible(p)):
                continue  # covered by a bind of its parent, or by the system dirs
            view.add("--ro-bind", p, p)

    outside_tmp = [p for p in interp.needed if not _is_under(p, "/tmp")]
    bind_needed(outside_tmp)
    for h in interp.hidden:  # the base interpreter's own site-packages (other environments)
        if any(_is_under(h, p) for p in interp.needed) and not any(_is_under(p, h) for p in interp.needed):
            argv += ["--tmpfs", h]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    view.made.update({"/dev", "/proc"})
    view.add("--bind", str(tmp), "/tmp")
    bind_needed(interp.needed, "/tmp")  # e.g. a checkout (and its .venv) under /tmp
    argv += ["--bind", str(shm), "/dev/shm", "--remount-ro", "/", "--chdir", INNER_WORK]
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


def acquire_uid() -> tuple[int, int]:
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
        kill_uid(uid)
        return uid, fd
    raise RuntimeError("sandbox: no free uid left in UID_POOL")


def kill_uid(uid: int) -> None:
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
