"""The malloc choice (run/allocator.py): the decision from the environment, and the re-execution
that preloads tcmalloc keeping the process id and the arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from morse_jax.run import allocator
from morse_jax.run.allocator import ENV, find_library, preload_plan


def _find(path):
    return lambda name: path


def test_default_is_tcmalloc_when_installed():
    path, why = preload_plan({}, loaded="", find=_find("/x/libtcmalloc_minimal.so.4"), platform="linux")
    assert path == "/x/libtcmalloc_minimal.so.4" and "preloading" in why


def test_system_means_no_preload():
    assert preload_plan({ENV: "system"}, "", _find("/x/lib.so"), "linux")[0] is None


def test_unknown_choice_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="tcmalloc, jemalloc, system"):
        preload_plan({ENV: "tcmaloc"}, "", _find("/x/lib.so"), "linux")


def test_no_preload_when_already_mapped_or_missing_or_not_linux():
    maps = "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    assert preload_plan({ENV: "jemalloc"}, maps, _find("/x/libjemalloc.so.2"), "linux") == (None, "jemalloc already loaded")
    after = preload_plan({ENV: "jemalloc", allocator.REEXECUTED_ENV: "1"}, maps, _find("/x/libjemalloc.so.2"), "linux")
    assert after == (None, "jemalloc preloaded by re-execution")
    path, why = preload_plan({ENV: "jemalloc"}, "", _find(None), "linux")
    assert path is None and "not found" in why and "apt install libjemalloc2" in why
    assert preload_plan({}, "", _find("/x/lib.so"), "darwin")[0] is None


def test_mapped_allocator_reads_the_maps():
    assert allocator.mapped_allocator("") == "system"
    assert allocator.mapped_allocator("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libtcmalloc_minimal.so.4.5.10\n") == "tcmalloc"


def test_a_reexecuted_process_never_reexecutes_again():
    # the preload was asked for but the library is not mapped (a broken install): no loop
    path, why = preload_plan({allocator.REEXECUTED_ENV: "1"}, "", _find("/x/libtcmalloc.so.4"), "linux")
    assert path is None and "not mapped" in why


def test_find_library_looks_in_the_given_directories(tmp_path):
    assert find_library("jemalloc", [str(tmp_path)]) is None
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert find_library("jemalloc", [str(tmp_path)]) == str(tmp_path / "libjemalloc.so.2")


CHILD = """
import os, sys
print("run", os.getpid(), sys.argv[1:], flush=True)
from morse_jax.run.allocator import reexec_with_allocator, current
note = reexec_with_allocator()
print("malloc", current(), flush=True)
print("note", note, flush=True)
"""


def _run(choice: str):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.REEXECUTED_ENV)}
    env[ENV] = choice
    return subprocess.run([sys.executable, "-c", CHILD, "a", "b c"], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux") or find_library("tcmalloc") is None,
                    reason="tcmalloc not installed (apt install libtcmalloc-minimal4)")
def test_reexecution_preloads_tcmalloc_same_pid_same_arguments():
    out = _run("tcmalloc")
    assert out.returncode == 0, out.stderr
    runs = [ln for ln in out.stdout.splitlines() if ln.startswith("run ")]
    assert len(runs) == 2 and runs[0] == runs[1], out.stdout  # execve: same pid, same argv
    assert runs[0].endswith("['a', 'b c']")
    assert out.stdout.splitlines()[-2:] == ["malloc tcmalloc", "note tcmalloc preloaded by re-execution"]
    assert out.stderr == ""


def test_system_choice_runs_once_with_glibc():
    out = _run("system")
    assert out.returncode == 0, out.stderr
    assert [ln.split()[0] for ln in out.stdout.splitlines()] == ["run", "malloc", "note"]
    assert out.stdout.splitlines()[-2:] == ["malloc system", f"note {ENV}=system"]


def test_bad_choice_exits_2_with_one_line():
    out = _run("tcmaloc")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"morse_jax: {ENV}='tcmaloc': choose one of tcmalloc, jemalloc, system"]
