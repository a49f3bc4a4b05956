"""One sandboxed run: the run directory, spawning, the output pump, reaping, the result.

Split out of :mod:`morse_jax.tasks.sandbox.runner` (one concept per module; the policy and its
limitations are described there), which re-exports :class:`SandboxResult`. The isolation
pieces (argv, environment, rlimits, uids) come from :mod:`~morse_jax.tasks.sandbox.isolation`.

The probes that decide which isolation works (:func:`bwrap_status`, :func:`drop_uid_ok`,
:func:`resolve_mode`) live here because a probe is itself one sandboxed run. The names without
an underscore are this package's internal API, used by :mod:`~morse_jax.tasks.sandbox.runner`;
code outside the package calls the runner.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal as signal_mod
import stat
import subprocess
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Mapping

from morse_jax.tasks.sandbox.isolation import (INNER_WORK, Kind, Limits, Mode, acquire_uid, bwrap_argv,
                                               cached_probe, child_env, interp_info, kill_uid, rlimits_preexec,
                                               warn_once)

_DRAIN_GRACE_S = 0.5  # wait for pipes still open after the child is gone, then give up
_CHUNK = 1 << 16


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
      sandboxed_with: "bwrap" or "rlimits" (see :mod:`morse_jax.tasks.sandbox.runner`).
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


# ----------------------------------------------------------------------------- isolation probes


def bwrap_status(python: str) -> tuple[bool, str]:
    """(usable, why not): does bwrap (+ setpriv as root) run this interpreter correctly?"""
    def compute():
        if shutil.which("bwrap") is None:
            return False, "bwrap not found on PATH (Debian/Ubuntu package: bubblewrap)"
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            return False, "setpriv not found on PATH (package: util-linux)"
        return _probe("bwrap", python)
    return cached_probe(("bwrap", python), compute)


def drop_uid_ok(python: str) -> bool:
    """rlimits mode as root: does the interpreter work unchanged under a pool uid? Not when it
    lives under a 0700 home: the loader then silently falls back to the system's libpython."""
    return cached_probe(("drop", python), lambda: _probe("rlimits", python)[0])


def _probe(kind: Kind, python: str) -> tuple[bool, str]:
    version = interp_info(python).version
    main = PurePosixPath("main.py")
    try:
        res = run_once(kind, python, {main: b"import sys; sys.stdout.write(sys.version)"}, main, [],
                   None, 10_000, Limits(30.0, 1024, 16, 1, 64), Path(tempfile.gettempdir()),
                   probing=True)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"{kind} probe did not start: {e}"
    if res.ok and res.stdout == version:
        return True, ""
    return False, (f"{kind} probe: rc={res.returncode} stdout={res.stdout[-200:]!r} "
                   f"stderr={res.stderr.strip()[-500:]!r}")


def resolve_mode(mode: Mode, python: str) -> Kind:
    if mode == "rlimits":
        return "rlimits"
    ok, why = bwrap_status(python)
    if ok:
        return "bwrap"
    if mode == "bwrap":
        raise RuntimeError(f"run_python: mode='bwrap' but bubblewrap is not usable: {why}")
    warn_once("fallback", f"sandbox: bubblewrap unusable ({why}); falling back to rlimits: "
                           "no filesystem or network isolation")
    return "rlimits"


# ----------------------------------------------------------------------------- one run


def run_once(kind: Kind, python: str, layout: Mapping[PurePosixPath, bytes], entry: PurePosixPath,
             args: list[str], stdin: bytes | None, max_output_bytes: int, limits: Limits, base: Path,
         probing: bool = False) -> SandboxResult:
    # Run root R, removed afterwards: R/tmp is the child's TMPDIR (its /tmp under bwrap),
    # R/tmp/work its cwd and HOME, R/shm its /dev/shm (multiprocessing needs a writable one).
    is_root = os.geteuid() == 0
    drop = is_root and (kind == "bwrap" or probing or drop_uid_ok(python))
    if is_root and not drop:
        warn_once("root", "sandbox: rlimits mode runs the child as root (the interpreter does "
                           "not work under an unprivileged uid): no process limit applies")
    if drop and kind == "rlimits":
        for d in [base, *base.parents]:  # the child resolves its cwd's absolute path
            if not os.stat(d).st_mode & stat.S_IXOTH:
                raise ValueError(f"run_python: base_dir {str(base)!r} is not reachable by an "
                                 f"unprivileged uid ({str(d)!r} lacks o+x)")
    uid, lock_fd = acquire_uid() if drop else (None, None)
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
                argv = bwrap_argv(python, tmp, shm, uid) + py_argv
                env, cwd, ids = child_env(python, INNER_WORK, "/tmp"), "/", {}
            else:
                argv, env, cwd = py_argv, child_env(python, str(work), str(tmp)), str(work)
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
        start_new_session=True, preexec_fn=rlimits_preexec(rlimits), **ids)
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
            kill_uid(uid)  # stragglers that left the group (setsid) and may hold our pipes
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
        """Read the pipes to their end; past ``deadline`` only what is already in them.

        The deadline bounds the wait for pipes a straggler still holds open, never the reading
        of what the child wrote before it exited: under load this thread can be descheduled past
        the deadline before its first read, and giving up then returned an exited child's run as
        ok with its output missing (seen in CI: 1 of 50 concurrent runs, empty stdout).
        """
        self._close_pidfd()
        hard_stop = deadline + 10 * _DRAIN_GRACE_S  # a writer that was not killed cannot hold us
        while any(k.data in self.bufs for k in self.sel.get_map().values()):
            now = time.monotonic()
            if now >= hard_stop:
                return
            served = self._step(max(0.0, deadline - now))
            if not served and now >= deadline:  # nothing left in the pipes, and no more waiting
                return

    def _step(self, timeout: float) -> bool:
        """Serve the ready pipes, waiting up to ``timeout`` s; False if none was ready."""
        ready = self.sel.select(timeout)
        for key, _ in ready:
            if key.data == "stdin":
                self._write(key.fd)
            elif key.data in self.bufs:
                self._read(key.fd, key.data)
        return bool(ready)

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
