"""CLI entry: ``python -m morse_jax.main --config configs/quickstart.py [--config.field=value ...]``.

Flags, config validation and mode dispatch only; what each mode does lives in ``morse_jax.run``.

Modes (``--config.mode``): train (then eval, checkpoint, report), eval, plan (print the DAG of
``--config.task``), solve (run ``--config.task`` end to end and print the artifacts), diagnose,
describe (what the run would do, without loading weights).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.run.session import enable_compilation_cache, quiet_logs

# Set when run as a script: why the process runs with the malloc it has (run/allocator.py).
_MALLOC_NOTE = ""

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Path to a config file.",
                                          lock_config=True)


def run(cfg) -> int:
    """Dispatch on ``config.mode`` (the config is validated)."""
    from morse_jax.parallel import barrier, is_coordinator
    from morse_jax.run.session import prepare_workdir, train_and_evaluate

    if cfg.mode == "describe":  # reads no weights and writes nothing
        from morse_jax.run.describe import describe

        print(describe(cfg))
        return 0
    t_start = time.time()
    workdir = Path(cfg.workdir).expanduser()
    lead = is_coordinator()  # process 0 of a multi-process run writes files and prints
    if lead:
        prepare_workdir(cfg, workdir)
    barrier("workdir ready")
    if cfg.system == "moragent":  # SFT -> BFCL evaluation -> report
        from morse_jax.run.moragent import run_moragent

        return run_moragent(cfg, workdir, t_start=t_start)
    if cfg.mode in ("plan", "solve"):
        from morse_jax.run.solve import solve

        return solve(cfg, plan_only=cfg.mode == "plan")
    if cfg.mode == "diagnose":
        from morse_jax.run.diagnose import run_diagnose

        return run_diagnose(cfg)
    return train_and_evaluate(cfg, workdir, lead=lead, t_start=t_start)


def main(argv):
    del argv
    cfg = _CONFIG.value
    try:
        validate_config(cfg, check_paths=cfg.mode != "describe")  # describe says what is missing
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    quiet_logs()
    if _MALLOC_NOTE:
        import logging

        from morse_jax.run.allocator import current

        logging.getLogger("morse_jax").info("malloc: %s (%s)", current(), _MALLOC_NOTE)
    from morse_jax.parallel import initialize

    # Before any other JAX use: joins a multi-process run (explicit settings or SLURM); no-op alone.
    initialize(cfg.parallel.coordinator, cfg.parallel.num_processes, cfg.parallel.process_id)
    enable_compilation_cache(cfg.compilation_cache)
    import jax

    if jax.process_index() != 0:  # one set of progress bars and prints per run
        os.environ["TQDM_DISABLE"] = "1"
        sys.stdout = open(os.devnull, "w")
    return run(cfg)


def _unknown_override(argv) -> str | None:
    """The first ``--config.a.b=`` override naming a field the config schema doesn't have."""
    from morse_jax.config.defaults import get_config as defaults

    schema = defaults()
    for arg in argv[1:]:
        if not arg.startswith("--config."):
            continue
        node, path = schema, arg[2:].split("=", 1)[0].split(".")[1:]
        for i, part in enumerate(path):
            if not hasattr(node, "keys") or part not in node:
                return "config." + ".".join(path[:i + 1])
            node = node[part]
    return None


def parse_flags(argv):
    """absl flag parsing, but a bad override is one line naming the field, not a traceback."""
    for i, arg in enumerate(argv[1:], 1):
        path = arg[len("--config="):] if arg.startswith("--config=") else None
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        if path is not None and not Path(path.split(":", 1)[0]).is_file():
            print(f"config error: --config: no such config file {path.split(':', 1)[0]!r}", file=sys.stderr)
            sys.exit(2)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # An exception inside a config file's get_config() arrives as a whole traceback.
        msg = f"{lines[0]} {lines[-1]}" if any(ln.startswith("Traceback") for ln in lines) else " ".join(lines)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        field = _unknown_override(argv)
        msg = f"{field}: unknown field" if field else f"{type(e).__name__}: {e}"
    print(f"config error: {msg}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    from morse_jax.run.allocator import reexec_with_allocator

    _MALLOC_NOTE = reexec_with_allocator()  # tcmalloc unless MORSE_JAX_MALLOC=system (run/allocator.py: why)
    app.run(main, flags_parser=parse_flags)
