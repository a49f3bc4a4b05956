"""config.compilation_cache: a second process loads the first one's compiled program instead of
compiling it again (what makes a rerun, a resume or the next seed skip step 1's compiles)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from morse_jax.config.defaults import get_config
from morse_jax.run.session import enable_compilation_cache

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from jax import monitoring
    from morse_jax.run.session import enable_compilation_cache

    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    enable_compilation_cache(sys.argv[1], min_compile_seconds=0.0)

    def f(x):
        for i in range(30):
            x = jnp.tanh(x @ x) + i
        return x

    y = jax.jit(f)(jnp.eye(8))
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"), "sum": float(y.sum())}))
""")


def _run_child(cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(cache)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    first = _run_child(cache)
    assert first["hits"] == 0
    assert any(cache.iterdir()), "the first process stored nothing"
    second = _run_child(cache)
    assert second["hits"] >= 1
    assert second["sum"] == first["sum"]  # the loaded program computes the same thing


def test_empty_path_turns_the_cache_off_and_the_default_is_a_user_cache_dir():
    assert enable_compilation_cache("") is None
    assert get_config().compilation_cache.startswith("~/")

