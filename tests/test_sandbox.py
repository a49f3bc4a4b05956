"""Sandbox for untrusted generated code: each hostile program is contained, reported, host unharmed.

Isolation tests run under bubblewrap (CI installs the Debian package ``bubblewrap``); they are
skipped only when the ``bwrap`` binary is absent, and fail if it is present but unusable.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import pytest

from morse_jax.tasks.sandbox import isolation as sandbox_isolation, process as sandbox_process, runner as sandbox
from morse_jax.tasks.sandbox.runner import Job, run_many, run_python

# Expected here: the venv's interpreter (pyenv under a 0700 /root) cannot run under a dropped uid,
# so forced rlimits mode runs as root and says so.
pytestmark = pytest.mark.filterwarnings(
    "ignore:sandbox. rlimits mode runs the child as root:RuntimeWarning")

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap not installed (apt-get install bubblewrap)")


def _host_procs_with(marker: str) -> list[int]:
    """pids of host processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture(params=[pytest.param("bwrap", marks=needs_bwrap), "rlimits"])
def mode(request):
    return request.param


# The fallback drops the uid only when the interpreter works under it; the venv's pyenv python
# under a 0700 /root does not, the system python does. Tests of that path use the system python.
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin")
needs_uid_drop_fallback = pytest.mark.skipif(
    not IS_ROOT or SYSTEM_PY is None, reason="needs root and a system python3 for the uid-drop fallback")


# ----------------------------------------------------------------------------- both modes


def test_hello_args_and_clean_result(mode):
    # A base dir of our own (pytest's tmp_path sits under a 0700 directory that a dropped uid
    # could not traverse) shows the run directory is removed afterwards.
    base = Path(tempfile.mkdtemp(prefix="sbx-base-"))
    try:
        base.chmod(0o755)
        r = run_python("import sys; print('hi', sys.argv[1:])", args=["a", "b c"], mode=mode,
                       base_dir=base)
        assert r.ok and r.returncode == 0 and r.signal is None and not r.timed_out
        assert r.stdout == "hi ['a', 'b c']\n" and r.stderr == ""
        assert r.sandboxed_with == mode
        assert list(base.iterdir()) == []
    finally:
        shutil.rmtree(base)


def test_infinite_loop_is_killed(mode):
    marker = f"loop-{uuid.uuid4().hex}"
    r = run_python("print('started', flush=True)\nwhile True:\n    pass\n", args=[marker],
                   timeout_s=1.0, mode=mode)
    assert r.timed_out and not r.ok
    assert r.signal == signal.SIGKILL and r.signal_name == "SIGKILL" and r.returncode == -9
    assert r.stdout == "started\n"  # output before the kill is kept (unbuffered child)
    assert _host_procs_with(marker) == []


def test_parent_secrets_not_inherited(mode, monkeypatch):
    monkeypatch.setenv("MORSE_SECRET_TEST", "x")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    r = run_python("import os, json; print(json.dumps(dict(os.environ)))", mode=mode)
    assert r.ok, r.stderr
    env = json.loads(r.stdout)
    assert "MORSE_SECRET_TEST" not in env and "HTTPS_PROXY" not in env
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "USER", "LOGNAME", "PWD", "MPLBACKEND",
                        "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
                        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"}
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONHASHSEED"] == "0"


def test_huge_allocation_fails_and_is_reported(mode):
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", mode=mode)  # 2 GiB limit
    assert not r.ok and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr or r.signal is not None


def test_big_file_write_is_stopped(mode):
    code = ("chunk = b'x' * (1 << 20)\n"
            "with open('big.bin', 'wb') as f:\n"
            "    for i in range(1024):\n"
            "        f.write(chunk)\n"
            "print('wrote 1 GiB')\n")
    r = run_python(code, file_size_mb=8, mode=mode)
    assert not r.ok and "wrote 1 GiB" not in r.stdout
    # Python ignores SIGXFSZ, so the write fails with EFBIG; a non-Python child would get SIGXFSZ.
    assert "File too large" in r.stderr or r.signal == signal.SIGXFSZ


def test_output_truncated_with_marker(mode):
    r = run_python("import sys\nprint('a' * 100_000)\nsys.stderr.write('e' * 5000)",
                   max_output_bytes=1000, mode=mode)
    assert r.ok
    assert r.stdout.startswith("a" * 1000) and "a" * 1001 not in r.stdout
    assert "[sandbox: stdout truncated, 99001 of 100001 bytes dropped]" in r.stdout
    assert r.stderr.startswith("e" * 1000) and "stderr truncated" in r.stderr


def test_stdin_passed_or_closed(mode):
    r = run_python("import sys; print(sys.stdin.read().upper())", stdin="hello\nworld", mode=mode)
    assert r.stdout == "HELLO\nWORLD\n"
    big = "z" * 300_000  # larger than a pipe buffer: written incrementally
    r = run_python("import sys; print(len(sys.stdin.read()))", stdin=big, mode=mode)
    assert r.stdout == "300000\n"
    r = run_python("import sys; print(repr(sys.stdin.read()))", mode=mode)
    assert r.stdout == "''\n"


def test_multifile_codebase_and_binary_files(mode):
    files = {
        "main.py": "from pkg.util import f\nprint(f(), open('data/blob.bin', 'rb').read())\n",
        "pkg/__init__.py": "",
        "pkg/util.py": "def f():\n    return 42\n",
        "data/blob.bin": b"\x00\x01\xff",
    }
    r = run_python(None, files=files, mode=mode)
    assert r.ok, r.stderr
    assert r.stdout == "42 b'\\x00\\x01\\xff'\n"
    r = run_python("import helper; print(helper.X)", files={"helper.py": "X = 'side'"}, mode=mode)
    assert r.stdout == "side\n"


def test_killed_by_signal_is_reported(mode):
    r = run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", mode=mode)
    assert r.signal == signal.SIGTERM and r.signal_name == "SIGTERM" and r.returncode == -15
    assert not r.timed_out
    r = run_python("import sys; sys.exit(3)", mode=mode)
    assert r.returncode == 3 and r.signal is None


def test_numpy_scipy_sympy_and_multiprocessing_work(mode):
    r = run_python("import multiprocessing as mp, numpy, scipy.linalg, sympy\n"
                   "if __name__ == '__main__':\n"
                   "    with mp.Pool(2) as pool:  # needs a writable /dev/shm\n"
                   "        squares = pool.map(abs, [-1, -2])\n"
                   "    print(numpy.linalg.det(numpy.eye(3)), sympy.Symbol('x') + 1, squares)\n",
                   mode=mode)
    assert r.ok, r.stderr
    assert r.stdout == "1.0 x + 1 [1, 2]\n"


# ----------------------------------------------------------------------------- bwrap isolation


@needs_bwrap
def test_writes_outside_the_run_dir_fail():
    name = f"sbx-escape-{uuid.uuid4().hex}"
    targets = [REPO / name, Path("/var/tmp") / name, Path("/tmp") / name]
    code = ("import sys\n"
            "for t in sys.argv[1:]:\n"
            "    try:\n"
            "        open(t, 'w').write('pwned')\n"
            "        print('wrote', t)\n"
            "    except OSError as e:\n"
            "        print('denied', t, type(e).__name__)\n")
    try:
        r = run_python(code, args=[str(t) for t in targets], mode="bwrap")
        assert r.ok, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("denied") and lines[1].startswith("denied")
        # /tmp inside is the run's private directory: the write succeeds there, not on the host
        for t in targets:
            assert not t.exists(), f"sandboxed code created {t} on the host"
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@needs_bwrap
def test_no_network_no_home_unprivileged():
    code = ("import os, socket\n"
            "try:\n"
            "    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
            "    print('net: open')\n"
            "except OSError:\n"
            "    print('net: blocked')\n"
            "print('uid', os.getuid(), os.geteuid())\n"
            "print('cwd', os.getcwd(), os.environ['HOME'])\n"
            "print('secrets', [p for p in os.listdir('/root')"
            " if p not in ('.pyenv', '.local')])\n")
    r = run_python(code, mode="bwrap")
    assert r.ok, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "net: blocked"
    if IS_ROOT:
        uid = int(out[1].split()[1])
        assert uid in sandbox.UID_POOL and out[1] == f"uid {uid} {uid}"
    assert out[2] == f"cwd {sandbox.INNER_WORK} {sandbox.INNER_WORK}"
    assert out[3] == "secrets []"  # only the interpreter's own prefix is bound under the home


@needs_bwrap
def test_minimal_view_hides_host_files_checkout_and_loopback():
    """Generated code cannot open a world-readable file made outside the sandbox, cannot list
    the project checkout, cannot reach a listener on 127.0.0.1; numpy/scipy/sympy still import."""
    import socket

    secret_dir = Path(tempfile.mkdtemp(prefix="sbx-host-", dir="/var/tmp"))
    secret = secret_dir / "data.jsonl"
    secret.write_text("expected values\n")
    os.chmod(secret_dir, 0o755)
    os.chmod(secret, 0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = ("import os, socket, sys\n"
            "import numpy, scipy.sparse, sympy\n"
            "def probe(what, f):\n"
            "    try:\n"
            "        f()\n"
            "        print(what, 'REACHED')\n"
            "    except OSError as e:\n"
            "        print(what, 'denied', type(e).__name__)\n"
            "probe('file', lambda: open(sys.argv[1]).read())\n"
            "try:\n"
            "    print('checkout', 'LISTED', ' '.join(sorted(os.listdir(sys.argv[2]))))\n"
            "except OSError as e:\n"
            "    print('checkout', 'denied', type(e).__name__)\n"
            "probe('readme', lambda: open(os.path.join(sys.argv[2], 'README.md')).read())\n"
            "probe('passwd', lambda: open('/etc/passwd').read())\n"
            "probe('loopback', lambda: socket.create_connection(('127.0.0.1', int(sys.argv[3])), timeout=2))\n"
            "print('root', sorted(os.listdir('/')))\n")
    try:
        r = run_python(code, args=[str(secret), str(REPO), str(port)], mode="bwrap")
        assert r.ok, r.stderr
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        for what in ("file", "readme", "passwd", "loopback"):
            assert lines[what].startswith("denied"), (what, lines[what])
        # A venv inside the checkout (as `make` creates it) must be bound, so its parent directory
        # exists in the sandbox as a bare mount point: the listing may show the venv's own
        # directory and nothing else of the checkout.
        if lines["checkout"].startswith("LISTED"):
            shown = set(lines["checkout"].split()[1:])
            venv_dirs = {Path(p).relative_to(REPO).parts[0] for p in {sys.prefix, sys.exec_prefix}
                         if Path(p).is_relative_to(REPO)}
            assert shown <= venv_dirs, ("checkout", sorted(shown - venv_dirs))
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
        # only system dirs, the interpreter's place and the run's own /tmp, /dev, /proc exist
        assert "var" not in lines["root"] and "home" not in lines["root"], lines["root"]
    finally:
        listener.close()
        shutil.rmtree(secret_dir)


@needs_bwrap
@pytest.mark.skipif(not IS_ROOT, reason="a per-run process limit needs root to drop to a pool uid")
def test_process_limit_caps_forks():
    marker = f"nproc-{uuid.uuid4().hex}"
    code = ("import os, time\n"
            "n = 0\n"
            "while n < 1000:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    n += 1\n"
            "print(n)\n")
    r = run_python(code, args=[marker], max_processes=16, timeout_s=10, mode="bwrap")
    assert r.ok, r.stderr
    assert 1 <= int(r.stdout) < 16  # the parent itself counts against the limit
    assert _host_procs_with(marker) == []  # the sleeping children died with the run


@needs_bwrap
@pytest.mark.skipif(not IS_ROOT, reason="a per-run process limit needs root to drop to a pool uid")
def test_fork_bomb_is_contained():
    marker = f"bomb-{uuid.uuid4().hex}"
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(code, args=[marker], timeout_s=2.0, mode="bwrap")
    assert r.timed_out and r.signal is not None
    assert _host_procs_with(marker) == []
    # the host can still spawn processes
    assert subprocess.run(["true"], check=False).returncode == 0


def test_output_of_an_exited_child_is_read_even_past_the_drain_deadline():
    """What an exited child left in its pipes is read even when the drain starts past its
    deadline (the reading thread descheduled under load). Before the fix the drain gave up
    unread and the run came back ok with its output missing (CI: one of
    test_many_concurrent_runs_keep_order's 50 runs had an empty stdout)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('o' * 50000 + 'END'); "
                             "sys.stderr.write('e' * 3000)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.wait()  # exited: all its output sits in the pipes, unread
    pump = sandbox_process._Pump(proc, None, 100_000)
    try:
        pump.drain(time.monotonic() - 1.0)
        assert pump.text("stdout") == "o" * 50000 + "END"
        assert pump.text("stderr") == "e" * 3000
    finally:
        pump.close()


@needs_bwrap
def test_many_concurrent_runs_keep_order():
    jobs = [Job(code="import sys; print(int(sys.argv[1]) ** 2)", args=[str(i)], mode="bwrap")
            for i in range(50)]
    jobs[7] = dict(code="import sys; print(sys.stdin.read() * 2)", stdin="ab", mode="bwrap")
    results = run_many(jobs, max_workers=8)
    assert len(results) == 50 and all(r.ok for r in results), [r.stderr for r in results if not r.ok]
    assert results[7].stdout == "abab\n"
    assert [r.stdout for i, r in enumerate(results) if i != 7] == [
        f"{i * i}\n" for i in range(50) if i != 7]


@pytest.mark.parametrize("isolation", [
    pytest.param(dict(mode="bwrap"), marks=[needs_bwrap], id="bwrap"),
    pytest.param(dict(mode="rlimits", python=SYSTEM_PY), marks=[needs_uid_drop_fallback],
                 id="rlimits-uid")])
def test_processes_escaping_the_session_are_killed(isolation):
    marker = f"escape-{uuid.uuid4().hex}"
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()  # leaves the process group that a timeout kill targets\n"
            "    time.sleep(60)\n"
            "    os._exit(0)\n"
            "print('parent done')\n")
    r = run_python(code, args=[marker], **isolation)
    assert r.ok and r.stdout == "parent done\n", r.stderr
    assert _host_procs_with(marker) == []


@needs_uid_drop_fallback
def test_fallback_drops_uid_and_limits_processes():
    assert sandbox_process.drop_uid_ok(SYSTEM_PY)
    code = ("import os, time\n"
            "print(os.getuid(), os.geteuid(), os.getgroups())\n"
            "n = 0\n"
            "while n < 1000:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    n += 1\n"
            "print(n)\n")
    r = run_python(code, max_processes=16, mode="rlimits", python=SYSTEM_PY)
    assert r.ok and r.sandboxed_with == "rlimits", r.stderr
    ids, n = r.stdout.splitlines()
    uid = int(ids.split()[0])
    assert uid in sandbox.UID_POOL and ids == f"{uid} {uid} []"
    assert 1 <= int(n) < 16


def test_auto_mode_falls_back_with_one_warning(monkeypatch):
    # the probe cache lives where cached_probe reads it
    monkeypatch.setattr(sandbox_isolation, "_cache", {("bwrap", sys.executable): (False, "probe says no")})
    with pytest.warns(RuntimeWarning, match="probe says no"):
        r = run_python("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and r.sandboxed_with == "rlimits"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*probe says no.*")
        assert run_python("print(1)").sandboxed_with == "rlimits"  # no second warning


# ----------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.py", "a/../../x.py", "a/./b.py", "", "a\x00b"])
def test_bad_file_paths_rejected(name):
    with pytest.raises(ValueError, match="files key"):
        run_python("print(1)", files={name: "x"})


def test_bad_arguments_rejected_with_field_name():
    with pytest.raises(ValueError, match="entry"):
        run_python("print(1)", files={"main.py": "print(2)"})  # both code and files[entry]
    with pytest.raises(ValueError, match="entry"):
        run_python(None, files={"other.py": ""})
    with pytest.raises(ValueError, match="entry"):
        run_python("print(1)", entry="../main.py")
    with pytest.raises(ValueError, match="both a file and a directory"):
        run_python("print(1)", files={"a": "x", "a/b.py": "y"})
    with pytest.raises(TypeError, match=r"files\['x.py'\]"):
        run_python("print(1)", files={"x.py": 3})
    with pytest.raises(TypeError, match="args"):
        run_python("print(1)", args="abc")
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("print(1)", memory_mb=1.5)
    with pytest.raises(ValueError, match="mode"):
        run_python("print(1)", mode="docker")
    with pytest.raises(ValueError, match="python"):
        run_python("print(1)", python="python3")
    with pytest.raises(ValueError, match=r"jobs\[1\] has unknown fields \['cmd'\]"):
        run_many([Job(code="print(1)"), {"code": "x", "cmd": "y"}])


def test_forced_bwrap_without_bwrap_raises(monkeypatch):
    monkeypatch.setattr(sandbox_isolation, "_cache", {})
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="bwrap not found"):
        run_python("print(1)", mode="bwrap")


@needs_bwrap
def test_interpreter_under_tmp_is_visible_in_the_sandbox(tmp_path):
    # Regression: a checkout (and its .venv) under /tmp was hidden by the run's private /tmp,
    # so bwrap was judged unusable and the sandbox fell back to rlimits only.
    venv = Path(tempfile.mkdtemp(dir="/tmp", prefix="sbx_venv_"))
    venv.chmod(0o755)  # like a checkout; mkdtemp's 0700 would shut out the sandbox uid anyway
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        python = str(venv / "bin" / "python")
        r = run_python("import sys; print(sys.prefix)", python=python, mode="bwrap")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(venv)
    finally:
        shutil.rmtree(venv, ignore_errors=True)
