"""Run untrusted generated Python code in a sandboxed child process (DESIGN §3, last bullet).

Every run gets a fresh run directory (removed afterwards), a minimal environment (no inherited
secrets, tokens or proxies), rlimits on CPU time, address space, processes, file size and open
files (set in the forked child before exec), its own session / process group, stdin closed unless
given, and is killed with its whole process group on timeout. Output is read incrementally and
truncated, so a chatty program cannot exhaust the parent's memory.

Two isolation levels (``SandboxResult.sandboxed_with``):

* ``"bwrap"`` (preferred; Debian package ``bubblewrap``): read-only bind of ``/``, fresh ``/dev``
  and ``/proc``, the parent's home (``/root``) replaced by an empty tmpfs into which only the
  interpreter's own prefix is re-bound, the run directory as the child's private writable
  ``/tmp`` (cwd and HOME ``/tmp/work``), no network, own PID/IPC/UTS namespaces, dies with its
  parent. As root, bwrap runs as root without a user namespace and ``setpriv`` (util-linux) drops
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
import selectors
import shutil
import signal as signal_mod
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Literal, Mapping, Sequence

__all__ = ["Job", "SandboxResult", "probe_sandbox", "run_many", "run_python"]

UID_POOL = range(100_000, 104_096)  # unprivileged uids for sandboxed children (none in passwd)
INNER_WORK = "/tmp/work"  # cwd and HOME of the child under bwrap
_MIB = 1 << 20
_DRAIN_GRACE_S = 0.5  # wait for pipes still open after the child is gone, then give up
_CHUNK = 1 << 16

Mode = Literal["auto", "bwrap", "rlimits"]
Kind = Literal["bwrap", "rlimits"]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
      returncode: exit status; ``-N`` when killed by signal N (subprocess convention).
      stdout, stderr: UTF-8 text (errors replaced), each cut to ``max_output_bytes`` bytes and
        then followed by a ``[sandbox: ... truncated ...]`` marker line when cut.
      timed_out: the wall-clock timeout or the CPU-time limit (SIGXCPU) ended the run.
      signal, signal_name: the terminating signal (9, "SIGKILL"), None on a normal exit.
      duration_s: wall-clock seconds from spawn to reaping.
      sandboxed_with: "bwrap" or "rlimits" (module docstring).
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    signal: int | None
    signal_name: str | None
    duration_s: float
    sandboxed_with: Kind

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


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
             ) -> list[SandboxResult]:
    """Run jobs (``Job`` or dicts of run_python's arguments) in a bounded thread pool; results in
    the order of ``jobs``. The default is one worker per CPU: timeouts are wall-clock, so
    oversubscribed CPUs would make honest programs time out.
    """
    parsed = [_as_job(j, i) for i, j in enumerate(jobs)]
    if max_workers is None:
        max_workers = os.cpu_count() or 1
    if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
        raise ValueError(f"run_many: max_workers must be a positive int, got {max_workers!r}")
    if not parsed:
        return []
    with ThreadPoolExecutor(min(max_workers, len(parsed)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(_execute, parsed))


def probe_sandbox(python: str | None = None) -> Kind:
    """The isolation ``mode="auto"`` gives for this interpreter (probed once, then cached)."""
    return "bwrap" if _bwrap_status(_check_python(python))[0] else "rlimits"


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
    kind = _resolve_mode(job.mode, python)
    limits = _Limits(job.timeout_s, job.memory_mb, job.max_processes, job.file_size_mb,
                     job.max_open_files)
    return _run(kind, python, layout, entry, list(job.args), stdin, job.max_output_bytes, limits,
                base.resolve())


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


def _bwrap_status(python: str) -> tuple[bool, str]:
    """(usable, why not): does bwrap (+ setpriv as root) run this interpreter correctly?"""
    def compute():
        if shutil.which("bwrap") is None:
            return False, "bwrap not found on PATH (Debian/Ubuntu package: bubblewrap)"
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            return False, "setpriv not found on PATH (package: util-linux)"
        return _probe("bwrap", python)
    return _cached(("bwrap", python), compute)


def _drop_uid_ok(python: str) -> bool:
    """rlimits mode as root: does the interpreter work unchanged under a pool uid? Not when it
    lives under a 0700 home: the loader then silently falls back to the system's libpython."""
    return _cached(("drop", python), lambda: _probe("rlimits", python)[0])


def _probe(kind: Kind, python: str) -> tuple[bool, str]:
    version = _interp_info(python)[0]
    main = PurePosixPath("main.py")
    try:
        res = _run(kind, python, {main: b"import sys; sys.stdout.write(sys.version)"}, main, [],
                   None, 10_000, _Limits(30.0, 1024, 16, 1, 64), Path(tempfile.gettempdir()),
                   probing=True)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"{kind} probe did not start: {e}"
    if res.ok and res.stdout == version:
        return True, ""
    return False, (f"{kind} probe: rc={res.returncode} stdout={res.stdout[-200:]!r} "
                   f"stderr={res.stderr.strip()[-500:]!r}")


def _resolve_mode(mode: Mode, python: str) -> Kind:
    if mode == "rlimits":
        return "rlimits"
    ok, why = _bwrap_status(python)
    if ok:
        return "bwrap"
    if mode == "bwrap":
        raise RuntimeError(f"run_python: mode='bwrap' but bubblewrap is not usable: {why}")
    _warn_once("fallback", f"sandbox: bubblewrap unusable ({why}); falling back to rlimits: "
                           "no filesystem or network isolation")
    return "rlimits"


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


# ----------------------------------------------------------------------------- one run


def _run(kind: Kind, python: str, layout: Mapping[PurePosixPath, bytes], entry: PurePosixPath,
         args: list[str], stdin: bytes | None, max_output_bytes: int, limits: _Limits, base: Path,
         probing: bool = False) -> SandboxResult:
    # Run root R, removed afterwards: R/tmp is the child's TMPDIR (its /tmp under bwrap),
    # R/tmp/work its cwd and HOME, R/shm its /dev/shm (multiprocessing needs a writable one).
    is_root = os.geteuid() == 0
    drop = is_root and (kind == "bwrap" or probing or _drop_uid_ok(python))
    if is_root and not drop:
        _warn_once("root", "sandbox: rlimits mode runs the child as root (the interpreter does "
                           "not work under an unprivileged uid): no process limit applies")
    if drop and kind == "rlimits":
        for d in [base, *base.parents]:  # the child resolves its cwd's absolute path
            if not os.stat(d).st_mode & stat.S_IXOTH:
                raise ValueError(f"run_python: base_dir {str(base)!r} is not reachable by an "
                                 f"unprivileged uid ({str(d)!r} lacks o+x)")
    uid, lock_fd = _acquire_uid() if drop else (None, None)
    try:
        run_root = Path(tempfile.mkdtemp(prefix="morse-sbx-", dir=base))
        try:
            tmp, shm = run_root / "tmp", run_root / "shm"
            work = tmp / "work"
            work.mkdir(parents=True)
            shm.mkdir()
            for rel, content in layout.items():
                target = work.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            if uid is not None:
                for dirpath, _, filenames in os.walk(run_root):
                    os.chown(dirpath, uid, uid)
                    for f in filenames:
                        os.chown(os.path.join(dirpath, f), uid, uid)
            os.chmod(run_root, 0o755)
            py_argv = [python, "-s", str(entry), *args]  # relative: cwd is the work dir
            if kind == "bwrap":
                argv = _bwrap_argv(python, tmp, shm, uid) + py_argv
                env, cwd, ids = _child_env(python, INNER_WORK, "/tmp"), "/", {}
            else:
                argv, env, cwd = py_argv, _child_env(python, str(work), str(tmp)), str(work)
                ids = {} if uid is None else dict(user=uid, group=uid, extra_groups=[])
            return _spawn_and_wait(argv, env, cwd, ids, limits.rlimits(with_nproc=uid is not None),
                                   stdin, limits.timeout_s, max_output_bytes, kind, uid)
        finally:
            shutil.rmtree(run_root, onerror=_force_remove)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # frees the uid; _spawn_and_wait killed its processes


def _force_remove(func, path, exc_info) -> None:
    # Not root: the program may have left read-only directories; open them up and retry once.
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _spawn_and_wait(argv, env, cwd, ids, rlimits, stdin, timeout_s, limit, kind, uid,
                    ) -> SandboxResult:
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, close_fds=True,
        start_new_session=True, preexec_fn=_preexec(rlimits), **ids)
    pump, wall_timeout = None, False
    try:
        pump = _Pump(proc, stdin, limit)
        wall_timeout = pump.until_exit(start + timeout_s)
    finally:
        # The leader is not reaped yet (only waitid(WNOWAIT) looked at it), so its pgid cannot
        # have been recycled: killing the group cannot hit a stranger.
        try:
            os.killpg(proc.pid, signal_mod.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            _kill_uid(uid)  # stragglers that left the group (setsid) and may hold our pipes
        if pump is not None:
            pump.drain(time.monotonic() + _DRAIN_GRACE_S)
        rc = proc.wait()
        if pump is not None:
            pump.close()
    duration = time.monotonic() - start
    sig = -rc if rc < 0 else None
    if sig is None and kind == "bwrap" and 128 < rc < 128 + signal_mod.NSIG:
        sig, rc = rc - 128, 128 - rc  # bwrap reports "killed by signal N" as status 128+N
    name = None
    if sig is not None:
        try:
            name = signal_mod.Signals(sig).name
        except ValueError:
            name = f"SIG{sig}"
    return SandboxResult(
        returncode=rc, stdout=pump.text("stdout"), stderr=pump.text("stderr"),
        timed_out=wall_timeout or sig == signal_mod.SIGXCPU, signal=sig, signal_name=name,
        duration_s=duration, sandboxed_with=kind)


class _Pump:
    """Feeds stdin and reads stdout/stderr without blocking, keeping ``limit`` bytes of each."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes | None, limit: int):
        self.proc, self.limit = proc, limit
        self.sel = selectors.DefaultSelector()
        self.bufs = {"stdout": bytearray(), "stderr": bytearray()}
        self.totals = {"stdout": 0, "stderr": 0}
        for name in self.bufs:
            fd = getattr(proc, name).fileno()
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)
        self.data, self.pos = memoryview(stdin or b""), 0
        if proc.stdin is not None:
            if stdin:
                os.set_blocking(proc.stdin.fileno(), False)
                self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
            else:
                proc.stdin.close()
        try:  # readable once the child exits: no polling latency
            self.pidfd: int | None = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            self.pidfd = None

    def until_exit(self, deadline: float) -> bool:
        """Pump until the child exits (False) or the deadline passes (True)."""
        while os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            now = time.monotonic()
            if now >= deadline:
                return True
            self._step(min(deadline - now, 1.0 if self.pidfd is not None else 0.01))
        return False

    def drain(self, deadline: float) -> None:
        self._close_pidfd()
        while any(k.data in self.bufs for k in self.sel.get_map().values()):
            now = time.monotonic()
            if now >= deadline:
                return
            self._step(deadline - now)

    def _step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.data == "stdin":
                self._write(key.fd)
            elif key.data in self.bufs:
                self._read(key.fd, key.data)

    def _read(self, fd: int, name: str) -> None:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(fd)
            return
        self.totals[name] += len(chunk)
        room = self.limit - len(self.bufs[name])
        if room > 0:
            self.bufs[name] += chunk[:room]

    def _write(self, fd: int) -> None:
        try:
            self.pos += os.write(fd, self.data[self.pos:self.pos + _CHUNK])
            done = self.pos >= len(self.data)
        except BlockingIOError:
            return
        except OSError:  # the child closed stdin or exited: it does not want the rest
            done = True
        if done:
            self.sel.unregister(fd)
            self.proc.stdin.close()

    def text(self, name: str) -> str:
        out = self.bufs[name].decode("utf-8", errors="replace")
        dropped = self.totals[name] - len(self.bufs[name])
        if dropped > 0:
            out += f"\n[sandbox: {name} truncated, {dropped} of {self.totals[name]} bytes dropped]\n"
        return out

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            self.sel.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None

    def close(self) -> None:
        self._close_pidfd()
        self.sel.close()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()
