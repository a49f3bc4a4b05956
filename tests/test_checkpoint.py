"""Checkpoint round trips, exact resume across processes, damaged-checkpoint fallback, sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from morse_jax.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWarning,
    tree_checksums,
)

REPO = Path(__file__).resolve().parents[1]


def _labels(params):
    return {g: jax.tree.map(lambda _: g, sub) for g, sub in params.items()}


def _make_state(seed: int = 0):
    """A state shaped like the trainer's: two param groups, AdamW per group, step, keys.

    Built from numpy values: eager jax ops compile one by one and cost seconds here.
    """
    rng = np.random.default_rng(seed)

    def normal(shape, dtype=np.float32):
        return jnp.asarray(rng.standard_normal(shape).astype(dtype))

    def key_data(shape):
        return jnp.asarray(rng.integers(0, 2**32, shape, dtype=np.uint32))

    params = {
        "lora": {"A": normal((2, 3, 4)), "B": normal((2, 4, 3), jnp.bfloat16)},
        "router": {"proj": normal((5, 4)), "protos": normal((4, 4))},
    }
    tx = optax.multi_transform({"lora": optax.adamw(8e-5), "router": optax.adamw(3e-5)}, _labels)
    # Non-trivial moments and counts in place of a real update.
    opt_state = jax.tree.map(
        lambda x: normal(x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.full(x.shape, seed + 3, x.dtype), tx.init(params))
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.asarray(7, jnp.int32),
        "key": jax.random.wrap_key_data(key_data((2,))),  # typed key (threefry)
        "rbg_keys": jax.random.wrap_key_data(key_data((3, 4)), impl="rbg"),
        "raw_key": key_data((2,)),  # legacy uint32[2]
        "host": {"counts": np.arange(5, dtype=np.int32) + seed, "scale": 0.5, "epoch": 2},
    }


def _bits(x):
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def assert_trees_bitwise_equal(a, b):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        assert getattr(x, "dtype", None) == getattr(y, "dtype", None), jax.tree_util.keystr(path)
        assert np.array_equal(_bits(x), _bits(y)), jax.tree_util.keystr(path)


# --------------------------------------------------------------------------- round trip


def test_round_trip_async_with_metadata_and_keys(tmp_path):
    state = _make_state()
    meta = {"data_cursor": 12, "config": {"lr": 8e-5, "targets": ("q", "v", "o")}, "n": np.int64(3)}
    with Checkpointer(tmp_path / "ck", max_to_keep=3, async_save=True) as ck:
        ck.save(7, state, metadata=meta)
        ck.wait()
        assert ck.all_steps() == [7]
        # Abstract target (what a trainer has before loading): jax leaves come back as jax arrays.
        abstract = jax.eval_shape(lambda: _make_state())
        abstract["host"] = state["host"]
        restored, got_meta = ck.restore(target=abstract)
    assert got_meta == {"data_cursor": 12, "config": {"lr": 8e-5, "targets": ["q", "v", "o"]}, "n": 3}
    assert_trees_bitwise_equal(restored, state)
    assert isinstance(restored["opt_state"], type(state["opt_state"]))
    assert restored["key"].dtype == state["key"].dtype and restored["rbg_keys"].dtype == state["rbg_keys"].dtype
    assert restored["raw_key"].dtype == jnp.uint32 and isinstance(restored["raw_key"], jax.Array)
    assert type(restored["host"]["scale"]) is float and type(restored["host"]["epoch"]) is int
    assert isinstance(restored["host"]["counts"], np.ndarray)


def test_restore_into_concrete_target_and_keep_last_n(tmp_path):
    ck = Checkpointer(tmp_path, max_to_keep=2, async_save=False)
    states = {s: _make_state(seed=s) for s in range(1, 5)}
    for s, st in states.items():
        ck.save(s, st, metadata={"data_cursor": s})
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    got, meta = ck.restore(3, target=_make_state(seed=99))
    assert meta == {"data_cursor": 3}
    assert_trees_bitwise_equal(got, states[3])
    assert ck.metadata() == {"data_cursor": 4}
    with pytest.raises(FileNotFoundError, match="step 1"):
        ck.restore(1, target=states[1])
    ck.close()


def test_bad_inputs_are_rejected_with_the_field_named(tmp_path):
    state = _make_state()
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=0)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    with pytest.raises(ValueError, match=r"metadata\['config'\]\['dtype'\]"):
        ck.save(1, state, metadata={"config": {"dtype": jnp.float32}})
    with pytest.raises(ValueError, match="not a string"):
        ck.save(1, state, metadata={1: "x"})
    with pytest.raises(ValueError, match="step"):
        ck.save(-1, state)
    with pytest.raises(ValueError, match=r"state\['name'\]"):
        ck.save(1, {"name": "adapter", "w": jnp.ones(2)})
    ck.save(2, state)
    with pytest.raises(ValueError, match="not newer"):
        ck.save(2, state)
    # A target that disagrees with the checkpoint is a caller error, not corruption.
    wrong = _make_state()
    wrong["params"]["lora"]["A"] = jnp.zeros((2, 3, 5))
    with pytest.raises(CheckpointMismatchError, match=r"\['params'\]\['lora'\]\['A'\].*shape"):
        ck.restore(target=wrong)
    with pytest.raises(CheckpointMismatchError, match="in target only"):
        ck.restore_latest_valid({**state, "extra": jnp.ones(1)})
    raw_for_typed = {**state, "key": jax.random.PRNGKey(0)}
    with pytest.raises(CheckpointMismatchError, match="PRNG key impl"):
        ck.restore(target=raw_for_typed)
    assert ck.all_steps() == [2]  # a mismatch never quarantines
    ck.close()


# --------------------------------------------------------------------------- checksums


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.uint32, jnp.bool_])
def test_checksum_same_for_numpy_and_jax_and_sees_any_single_change(dtype):
    rng = np.random.default_rng(0)
    x = np.asarray(rng.standard_normal(37) * 50).astype(dtype)
    [c_np], [c_jax] = tree_checksums([x]), tree_checksums([jnp.asarray(x)])
    assert c_np == c_jax
    raw = x.view(np.uint8)
    for pos in (0, raw.size // 2, raw.size - 1):
        for bit in (0,) if dtype == jnp.bool_ else (0, 7):  # a bool byte holds only 0 / 1
            y = raw.copy()
            y[pos] ^= 1 << bit
            c = tree_checksums([y.view(x.dtype)])[0]
            assert c[0] != c_np[0] and c[1] != c_np[1], (pos, bit)
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    if not np.array_equal(swapped.view(np.uint8), x.view(np.uint8)):
        assert tree_checksums([swapped])[0] != c_np


# --------------------------------------------------------------------------- damaged checkpoints


def _save_three(root: Path):
    ck = Checkpointer(root, max_to_keep=5, async_save=False)
    states = {s: _make_state(seed=s) for s in (1, 2, 3)}
    for s, st in states.items():
        ck.save(s, st, metadata={"data_cursor": 10 * s})
    ck.close()
    return states


def _data_files(step_dir: Path):
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def _truncate(step_dir):
    for p in _data_files(step_dir):
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)


def _flip_one_byte(path: Path, offset: int | None = None) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2 if offset is None else offset] ^= 0x10
    path.write_bytes(bytes(b))


def _flip_byte(step_dir):
    # One byte in the middle of *every* data file. Flipping it in one file chosen by size was
    # flaky: orbax writes the same payload twice (state/d/ and ocdbt.process_0/d/, equal sizes)
    # and restores from one of them, so a flip in the copy it does not read damages nothing.
    for p in _data_files(step_dir):
        _flip_one_byte(p)


def _drop_state(step_dir):
    shutil.rmtree(step_dir / "state")


def _garbage_json(step_dir):
    (step_dir / "metadata" / "metadata").write_text('{"format": ')


def _wrong_checksum(step_dir):
    f = step_dir / "metadata" / "metadata"
    doc = json.loads(f.read_text())
    doc["leaves"][0]["checksum"][0] ^= 1
    f.write_text(json.dumps(doc))


def _emptied(step_dir):
    shutil.rmtree(step_dir)
    step_dir.mkdir()


CORRUPTIONS = [_truncate, _flip_byte, _drop_state, _garbage_json, _wrong_checksum, _emptied]


# orbax leaves un-awaited coroutines / futures behind when tensorstore fails a read; harmless here.
ORBAX_READ_NOISE = [pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
                    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
@ORBAX_READ_NOISE[0]
@ORBAX_READ_NOISE[1]
def test_damaged_latest_falls_back_to_previous_with_warning(tmp_path, corrupt):
    root = tmp_path / "ck"
    states = _save_three(root)
    corrupt(root / "3")
    # A crash in the middle of writing step 4: orbax's tmp directory, never renamed.
    shutil.copytree(root / "2", root / "4.orbax-checkpoint-tmp-1234567")
    _drop_state(root / "4.orbax-checkpoint-tmp-1234567")

    ck = Checkpointer(root, max_to_keep=5, async_save=False)
    with pytest.warns(CheckpointWarning) as rec:
        got = ck.restore_latest_valid(_make_state(seed=0))
    msgs = " | ".join(str(w.message) for w in rec)
    assert "step 3" in msgs and "4.orbax-checkpoint-tmp" in msgs
    assert got.step == 2 and got.metadata == {"data_cursor": 20}
    assert_trees_bitwise_equal(got.state, states[2])
    # The damaged step and the partial write were moved aside, so step 3 can be written again.
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("_")) == ["1", "2"]
    assert len(list((root / "_invalid").iterdir())) == 2
    ck.save(3, got.state, metadata={"data_cursor": 30})
    ck.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        again = Checkpointer(root).restore_latest_valid(_make_state(seed=0))
    assert again.step == 3


@ORBAX_READ_NOISE[0]
@ORBAX_READ_NOISE[1]
def test_a_flipped_byte_in_any_data_file_never_restores_wrong_values(tmp_path):
    """One byte flipped in one data file at a time: the restore either returns step 3 bit for bit
    (the byte was in a file or region it does not read) or falls back to step 2 with a warning —
    never step 3 with other values. At least one of the flips must be caught, else this test
    would pass with checksums switched off."""
    pristine = tmp_path / "pristine"
    states = _save_three(pristine)
    n_files, caught = len(_data_files(pristine / "3")), 0
    assert n_files >= 2
    for i in range(n_files):
        root = tmp_path / f"ck{i}"
        shutil.copytree(pristine, root)
        _flip_one_byte(_data_files(root / "3")[i])
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", CheckpointWarning)
            got = Checkpointer(root, max_to_keep=5, async_save=False).restore_latest_valid(_make_state(seed=0))
        warned = [w for w in rec if issubclass(w.category, CheckpointWarning)]
        if got.step == 3:
            assert not warned
            assert_trees_bitwise_equal(got.state, states[3])
        else:
            assert got.step == 2 and any("step 3" in str(w.message) for w in warned)
            assert_trees_bitwise_equal(got.state, states[2])
            caught += 1
    assert caught >= 1


@ORBAX_READ_NOISE[0]
@ORBAX_READ_NOISE[1]
def test_fresh_start_and_all_damaged(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert Checkpointer(tmp_path / "empty").restore_latest_valid(_make_state()) is None
    root = tmp_path / "ck"
    _save_three(root)
    for s in ("1", "2", "3"):
        _garbage_json(root / s)
    with pytest.raises(CheckpointCorruptError, match="no readable checkpoint"):
        Checkpointer(root).restore_latest_valid(_make_state())
    assert sorted(p.name for p in root.iterdir()) == ["1", "2", "3"]  # nothing moved
    with pytest.raises(CheckpointCorruptError, match="metadata unreadable"):
        Checkpointer(root).restore(target=_make_state())


# --------------------------------------------------------------------------- size / backbone


def test_backbone_is_never_written_and_checkpoint_stays_small(tmp_path):
    backbone = {"embed": jnp.ones((4096, 256)), "layers": {"w": jnp.ones((8, 256, 256))}}  # 6 MiB
    backbone_bytes = sum(x.nbytes for x in jax.tree.leaves(backbone))
    state = _make_state()
    trainable_bytes = sum(_bits(x).nbytes for x in jax.tree.leaves(state))
    ck = Checkpointer(tmp_path, async_save=False, frozen=backbone)
    with pytest.raises(ValueError, match=r"state\['params'\]\['embed'\].*backbone"):
        ck.save(1, {**state, "params": {**state["params"], "embed": backbone["embed"]}})
    ck.save(1, state)
    ck.close()
    size = sum(p.stat().st_size for p in (tmp_path / "1").rglob("*") if p.is_file())
    assert size < trainable_bytes + 256 * 1024  # arrays plus bounded orbax/JSON overhead
    assert size < backbone_bytes / 10


# --------------------------------------------------------------------------- exact resume

TOY = r'''
"""Deterministic toy trainer: MLP, two AdamW param groups, RNG key in the state, data cursor."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from morse_jax.checkpoint import Checkpointer

N_DATA, BATCH, D_IN, D_H = 40, 8, 4, 16
DATA_X = np.random.default_rng(0).standard_normal((N_DATA, D_IN)).astype(np.float32)
DATA_Y = np.sin(DATA_X.sum(-1)).astype(np.float32)
CONFIG = {"lr_lora": 1e-2, "lr_router": 3e-3, "batch": BATCH}


def labels(p):
    return {g: jax.tree.map(lambda _: g, sub) for g, sub in p.items()}


TX = optax.multi_transform(
    {"lora": optax.adamw(CONFIG["lr_lora"], weight_decay=1e-2), "router": optax.adamw(CONFIG["lr_router"])},
    labels)


def init_state():
    k1, k2, k3, k_noise = jax.random.split(jax.random.key(0), 4)
    params = {
        "lora": {"w1": 0.5 * jax.random.normal(k1, (D_IN, D_H), jnp.float32),
                 "w2": 0.5 * jax.random.normal(k2, (D_H,), jnp.float32)},
        "router": {"b": jax.random.normal(k3, (D_H,), jnp.float32)},
    }
    return {"params": params, "opt_state": TX.init(params), "step": jnp.zeros((), jnp.int32), "key": k_noise}


@jax.jit
def train_step(state, x, y):
    key, k_drop = jax.random.split(state["key"])
    keep = jax.random.bernoulli(k_drop, 0.8, (x.shape[0], D_H))  # dropout: consumes the carried key

    def loss_fn(p):
        h = jnp.tanh(x @ p["lora"]["w1"] + p["router"]["b"]) * keep / 0.8
        return jnp.mean((h @ p["lora"]["w2"] - y) ** 2)

    grads = jax.grad(loss_fn)(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "key": key}


def batch(cursor):
    idx = (cursor * BATCH + np.arange(BATCH)) % N_DATA
    return DATA_X[idx], DATA_Y[idx]


def run(workdir, total_steps):
    """Train to ``total_steps``, resuming from / saving to ``workdir`` when given."""
    state, cursor, resumed = init_state(), 0, None
    ck = None
    if workdir is not None:
        ck = Checkpointer(workdir, max_to_keep=2)
        got = ck.restore_latest_valid(jax.eval_shape(init_state))
        if got is not None:
            state, cursor, resumed = got.state, got.metadata["data_cursor"], got.step
            assert got.metadata["config"] == CONFIG
    while int(state["step"]) < total_steps:
        state = train_step(state, *batch(cursor))
        cursor += 1
    if ck is not None:
        ck.save(int(state["step"]), state, metadata={"data_cursor": cursor, "config": CONFIG})
        ck.close()
    return state, cursor, resumed


if __name__ == "__main__":
    workdir, total, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    state, cursor, resumed = run(workdir, total)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = {jax.tree_util.keystr(p): np.asarray(jax.random.key_data(x) if x.dtype == state["key"].dtype else x)
              for p, x in flat}
    np.savez(out, **leaves)
    print(json.dumps({"resumed_from": resumed, "cursor": cursor}))
'''


def _start_script(script: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def _run_script(script: Path, *args) -> dict:
    return _finish(_start_script(script, *args))


def test_exact_resume_across_processes_is_bitwise_equal(tmp_path):
    """k steps + checkpoint here; k more in a new process == 2k uninterrupted steps, bit for bit."""
    k = 5
    script = tmp_path / "toy_train.py"
    script.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("toy_train", script)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)

    work = tmp_path / "work"
    halfway, cursor, resumed_from = toy.run(work, k)
    assert (cursor, resumed_from) == (k, None)
    # The resumed half runs in a fresh interpreter (nothing shared but the checkpoint directory)
    # while this process computes the uninterrupted reference.
    proc = _start_script(script, work, 2 * k, tmp_path / "resumed.npz")
    uninterrupted, cursor, _ = toy.run(None, 2 * k)
    assert cursor == 2 * k
    assert _finish(proc) == {"resumed_from": k, "cursor": 2 * k}

    resumed = np.load(tmp_path / "resumed.npz")
    flat = jax.tree_util.tree_flatten_with_path(uninterrupted)[0]
    assert sorted(resumed.files) == sorted(jax.tree_util.keystr(p) for p, _ in flat)
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        assert np.array_equal(resumed[name], _bits(x)), name
    # Guard against a vacuous pass: training moved the params between k and 2k.
    w1 = "['params']['lora']['w1']"
    assert not np.array_equal(np.asarray(halfway["params"]["lora"]["w1"]), resumed[w1])


# --------------------------------------------------------------------------- sharded restore

SHARDED = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from morse_jax.checkpoint import Checkpointer, CheckpointMismatchError

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
sh = lambda *spec: NamedSharding(mesh, P(*spec))
w = jax.device_put(jnp.arange(8 * 8, dtype=jnp.float32).reshape(8, 8), sh("data", "model"))
v = jax.device_put(jnp.arange(6, dtype=jnp.float32), sh("model"))
keys = jax.device_put(jax.random.split(jax.random.key(0), 8), sh("data"))
ck = Checkpointer(sys.argv[1])
ck.save(1, {"w": w, "v": v, "keys": keys})
ck.wait()
# Restore on a different layout than the one saved.
target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sh(None, "data")),
          "v": jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh()),
          "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=sh("model"))}
got, _ = ck.restore(target=target)
assert got["w"].sharding == target["w"].sharding, got["w"].sharding
assert got["v"].sharding == target["v"].sharding, got["v"].sharding
assert got["keys"].sharding.spec == target["keys"].sharding.spec, got["keys"].sharding
assert np.array_equal(np.asarray(got["w"]), np.asarray(w)) and np.array_equal(np.asarray(got["v"]), np.asarray(v))
assert np.array_equal(np.asarray(jax.random.key_data(got["keys"])), np.asarray(jax.random.key_data(keys)))
# A layout that cannot hold the array (6 rows over 4 devices) is the caller's error, not damage.
bad = {**target, "v": jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh("data"))}
try:
    ck.restore_latest_valid(bad)
except CheckpointMismatchError as e:
    assert "['v']" in str(e) and "sharding" in str(e), e
else:
    raise AssertionError("an indivisible target sharding was accepted")
assert ck.all_steps() == [1]
ck.close()
print('{"ok": true}')
'''


def test_sharded_save_restores_into_target_layout(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(textwrap.dedent(SHARDED))
    assert _run_script(script, tmp_path / "ck") == {"ok": True}
