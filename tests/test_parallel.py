"""morse_jax.parallel: mesh, sharding rules, sharded jit equivalence, multi-process runs, memory plan.

Sharded runs need several devices, and XLA's host device count is fixed when jax starts, so they
run in subprocesses: ``parallel_equivalence.py`` (8 forced CPU devices; single-device vs mesh
results) and ``parallel_two_process_step.py`` started by ``launch/local_multiprocess.sh`` (two
processes joined by jax.distributed on localhost). Rule tests use a shape-only mesh in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from morse_jax.models import ModelConfig, num_params
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.parallel import (
    PRESETS,
    broadcast_from_coordinator,
    initialize,
    logical_spec,
    make_mesh,
    memory_plan,
    memory_table,
    param_specs,
    resolve_mesh_shape,
    run_on_coordinator,
    shard_params,
    slurm_settings,
)
from morse_jax.parallel.distributed import decode_payload, encode_payload
from morse_jax.parallel.mesh import device_grid
from morse_jax.parallel.sharding import RULES, cache_shardings, param_logical_axes

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
LAUNCH = REPO / "launch" / "local_multiprocess.sh"
CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


class ShapeMesh:
    """The part of a Mesh the rules read: axis sizes."""

    def __init__(self, data: int, fsdp: int, tensor: int):
        self.shape = {"data": data, "fsdp": fsdp, "tensor": tensor}


def _shapes(cfg):
    from morse_jax.models import param_shapes

    return jax.tree.map(lambda s: np.zeros(s, np.float32), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))


# --------------------------------------------------------------------------- mesh


def test_resolve_mesh_shape_fills_and_rejects():
    assert resolve_mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    assert resolve_mesh_shape((1, 4, 2), 8) == (1, 4, 2)
    with pytest.raises(ValueError, match=r"parallel.mesh.*does not divide"):
        resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match=r"parallel.mesh.*part of the 8"):
        resolve_mesh_shape((2, 2, 1), 8)
    with pytest.raises(ValueError, match=r"parallel.mesh.*does not divide"):
        resolve_mesh_shape((3, 1, 1), 8)
    with pytest.raises(ValueError, match="at most one entry may be -1"):
        resolve_mesh_shape((-1, -1, 1), 8)
    with pytest.raises(ValueError, match="3 entries"):
        resolve_mesh_shape((8, 1), 8)
    with pytest.raises(ValueError, match=">= 1 or -1"):
        resolve_mesh_shape((0, -1, 1), 8)


def test_make_mesh_on_this_process():
    n = jax.device_count()
    mesh = make_mesh((-1, 1, 1))
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.shape == (n, 1, 1)
    with pytest.raises(ValueError, match="parallel.mesh"):
        make_mesh((n + 1, 1, 1))


def _fake_devices(n_proc: int, per: int):
    return [types.SimpleNamespace(id=p * per + i, process_index=p) for p in range(n_proc) for i in range(per)]


def test_device_grid_keeps_tensor_inside_a_process():
    # 2 processes x 4 devices; (2,2,2): data spans the processes, fsdp and tensor stay local
    grid = device_grid((2, 2, 2), _fake_devices(2, 4))
    procs = np.vectorize(lambda d: d.process_index)(grid)
    assert (procs[0] == 0).all() and (procs[1] == 1).all()
    # (1,4,2): fsdp's outer factor spans processes, tensor pairs are local
    procs = np.vectorize(lambda d: d.process_index)(device_grid((1, 4, 2), _fake_devices(2, 4)))
    assert procs[0].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    # (1,1,8) on 2 processes: the tensor axis must cross hosts; its outer half is process 0
    procs = np.vectorize(lambda d: d.process_index)(device_grid((1, 1, 8), _fake_devices(2, 4)))
    assert procs[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="different device counts"):
        device_grid((5, 1, 1), _fake_devices(2, 4)[:5])


# --------------------------------------------------------------------------- sharding rules


def test_backbone_rules_on_a_full_mesh():
    specs = param_specs(ShapeMesh(2, 2, 2), _shapes(CFG), CFG)
    layer = specs["layers"][0]
    assert specs["embed"] == P("tensor", "fsdp") and specs["lm_head"] == P("fsdp", "tensor")
    assert layer["q"]["kernel"] == P(None, "fsdp", "tensor")  # [L, d, H*D]: layer axis replicated
    assert layer["k"]["kernel"] == P(None, "fsdp", "tensor")
    assert layer["o"]["kernel"] == P(None, "tensor", "fsdp")
    assert layer["down"]["kernel"] == P(None, "tensor", "fsdp")
    assert layer["attn_norm"] == P() and specs["final_norm"] == P()


def test_rules_replicate_what_does_not_divide():
    odd = ModelConfig(family="llama", vocab_size=97, hidden_size=30, intermediate_size=64, num_layers=1, num_heads=3,
                      num_kv_heads=1, head_dim=8)
    mesh = ShapeMesh(1, 4, 2)
    specs = param_specs(mesh, _shapes(odd), odd)
    assert specs["embed"] == P()  # vocab 97 % 2, hidden 30 % 4: both replicated
    assert specs["layers"][0]["gate"]["kernel"] == P(None, None, "tensor")  # MLP 64 still splits
    # q's width 24 divides 2 but 3 heads do not: with the config no head is cut in half
    assert specs["layers"][0]["q"]["kernel"] == P()
    assert param_specs(mesh, _shapes(odd))["layers"][0]["q"]["kernel"] == P(None, None, "tensor")
    # batches fall back from (data, fsdp) to one axis to replicated
    m = ShapeMesh(4, 2, 1)
    assert logical_spec(m, ("batch", None), (16, 5)) == P(("data", "fsdp"))
    assert logical_spec(m, ("batch", None), (12, 5)) == P("data")
    assert logical_spec(m, ("batch", None), (6, 5)) == P("fsdp")
    assert logical_spec(m, ("batch", None), (3, 5)) == P()
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_spec(m, ("heads_typo",), (4,))
    assert set(RULES) >= {"batch", "vocab", "embed", "heads", "kv_heads", "mlp"}


def test_unrolled_fused_and_cache_rules():
    mesh = ShapeMesh(2, 2, 2)
    assert param_logical_axes((jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(0),
                               jax.tree_util.SequenceKey(3), jax.tree_util.DictKey("up"),
                               jax.tree_util.DictKey("kernel")), 2) == ("embed", "mlp")
    fused = {"embed": np.zeros((64, 32)), "head": np.zeros((64, 32)), "final_norm": np.zeros(32),
             "layers": ({"qkv": {"w": np.zeros((64, 32))}, "o": {"w": np.zeros((32, 32))},
                         "gu": {"w": np.zeros((128, 32))}, "down": {"w": np.zeros((32, 64))},
                         "attn_norm": np.zeros(32)},)}
    specs = param_specs(mesh, fused, CFG)
    assert specs["layers"][0]["qkv"]["w"] == P("tensor", "fsdp") and specs["layers"][0]["o"]["w"] == P("fsdp", "tensor")
    assert specs["head"] == P("tensor", "fsdp")
    from morse_jax.models import init_cache
    from morse_jax.models.decode import init_decode_cache

    dc = jax.eval_shape(lambda: init_decode_cache(CFG, 4, 16))  # k: [B*K=8, D, S]
    sh = jax.tree.map(lambda s: s.spec, cache_shardings(_named(mesh), dc, CFG))
    assert sh["k"][0] == P(("data", "fsdp", "tensor")) and sh["valid"] == P(("data", "fsdp"))
    mc = jax.eval_shape(lambda: init_cache(CFG, _shapes(CFG), 4, 16))  # [L, B, S, K, D]
    sh = jax.tree.map(lambda s: s.spec, cache_shardings(_named(mesh), mc, CFG))
    assert sh["layers"][0]["k"] == P(None, ("data", "fsdp"), None, "tensor") and sh["index"] == P()


def _named(shape_mesh):
    """NamedSharding needs a real Mesh; an abstract one of the same axis sizes carries no devices."""
    from jax.sharding import AbstractMesh, AxisType

    s = shape_mesh.shape
    return AbstractMesh((s["data"], s["fsdp"], s["tensor"]), ("data", "fsdp", "tensor"),
                        axis_types=(AxisType.Auto,) * 3)


def test_shard_params_places_on_a_mesh():
    mesh = make_mesh((-1, 1, 1))
    tree = {"embed": np.ones((64, 32), np.float32), "final_norm": np.ones(32, np.float32)}
    placed = shard_params(mesh, tree, CFG)
    assert isinstance(placed["embed"], jax.Array) and placed["embed"].sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(placed["embed"]), tree["embed"])
    tied = shard_params(mesh, {"embed": tree["embed"], "head": tree["embed"]}, CFG)
    assert tied["embed"] is tied["head"]  # one device copy of a shared leaf


# --------------------------------------------------------------------------- distributed helpers


def test_initialize_single_process_and_bad_settings():
    assert initialize().source in ("single", "already")
    assert initialize("localhost:1234", 1, 0).num_processes == 1  # one process: nothing to join
    with pytest.raises(ValueError, match="parallel.coordinator must be set"):
        initialize("", 2, 0)
    with pytest.raises(ValueError, match="host:port"):
        initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"parallel.process_id must be in \[0, 2\)"):
        initialize("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="parallel.num_processes"):
        initialize("localhost:1234", 0, 0)


def test_slurm_settings_from_environment():
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "8",
           "SLURM_STEP_NODELIST": "gpu[007-010,12],cpu1"}
    addr, n, pid = slurm_settings(env)
    assert addr == f"gpu007:{4242 % 4096 + 61440}" and (n, pid) == (8, 3)
    assert slurm_settings({**env, "SLURM_STEP_NODELIST": "nodeA,nodeB", "MORSE_COORDINATOR_PORT": "5000"})[0] == \
        "nodeA:5000"
    assert slurm_settings({**env, "SLURM_NTASKS": "1"}) is None
    assert slurm_settings({}) is None
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST"):
        slurm_settings({k: v for k, v in env.items() if k != "SLURM_STEP_NODELIST"})


def test_run_on_coordinator_single_process():
    assert run_on_coordinator(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        run_on_coordinator(lambda: 1 / 0)


def test_broadcast_payload_round_trip_keeps_types():
    obj = {"plan": {"nodes": ["a", "b"], "edges": [(0, 1)]}, "r": np.array([[0.5, 1.0]], np.float32),
           "ids": np.arange(3, dtype=np.int64), "mask": np.array([True, False]), "s": np.float32(2.5), "none": None}
    for got in (decode_payload(encode_payload(obj)), broadcast_from_coordinator(obj)):
        assert got["plan"] == obj["plan"] and isinstance(got["plan"]["edges"][0], tuple)
        for k in ("r", "ids", "mask"):
            assert got[k].dtype == obj[k].dtype and np.array_equal(got[k], obj[k])
        assert isinstance(got["s"], np.float32) and got["s"] == 2.5 and got["none"] is None
    for bad in ({1: "int key"}, {"x": {1, 2}}, {"a": jax.numpy.ones(2)}):
        with pytest.raises(TypeError, match="broadcast_from_coordinator"):
            encode_payload(bad)


# --------------------------------------------------------------------------- memory plan


def test_memory_plan_components():
    spec = ExpertBankSpec()
    cfg = PRESETS["Llama-3.1-8B"]
    one = memory_plan(cfg, spec, batch=4, cache_len=(2048, 4096), mesh_shape=(1, 1, 1), dtype="bfloat16")
    assert one.components["backbone"] == num_params(cfg) * 2
    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert one.kv_cache[(16, 4096)] == 2 * L * 16 * 4096 * K * D * 2
    fsdp = memory_plan(cfg, spec, batch=4, cache_len=4096, mesh_shape=(1, 4, 1))
    assert 0.25 <= fsdp.components["backbone"] / one.components["backbone"] < 0.26  # norms stay replicated
    assert fsdp.kv_cache[(16, 4096)] == one.kv_cache[(16, 4096)] / 4
    data = memory_plan(cfg, spec, batch=4, cache_len=4096, mesh_shape=(4, 1, 1))
    assert data.components["backbone"] == one.components["backbone"]  # data parallel: full replicas
    assert data.components["update activations"] < one.components["update activations"] / 3
    # AdamW: two states per trainable parameter; SGD none
    assert one.components["optimizer states"] == 2 * one.components["experts + router"]
    assert memory_plan(cfg, spec, "sgd").components["optimizer states"] == 0
    assert "peak (update)" in one.format(141e9) and "GB" in one.format()
    with pytest.raises(ValueError, match="optimizer"):
        memory_plan(cfg, spec, "adagrad")
    with pytest.raises(ValueError, match="mesh_shape"):
        memory_plan(cfg, spec, mesh_shape=(-1, 1, 1))


def test_memory_table_rows():
    table = memory_table(seq_len=2048, cache_len=2048).splitlines()
    assert len(table) == 2 + 3 * 4 and table[0].startswith("| model |")
    assert all(row.count("|") == table[0].count("|") for row in table)


# --------------------------------------------------------------------------- sharded == single device


def _run_equivalence(meshes, sampler_sizes="8"):
    # LLVM -O0: compiles ~40 % faster; the SPMD partitioning under test is an HLO pass before it.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(TESTS / "parallel_equivalence.py"), "--meshes", *meshes,
                           "--sampler-sizes", sampler_sizes], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_mesh(r):
    specs = r["specs"]
    # the work really was split: weights over fsdp/tensor where the mesh has them, batch over data
    d, f, t = r["mesh"]
    entries = [None, "fsdp" if f > 1 else None, "tensor" if t > 1 else None]
    while entries and entries[-1] is None:
        entries.pop()
    want_q = P(*entries)
    assert specs["q_kernel"] == str(want_q) and specs["frozen_q_kernel"] == str(want_q)
    if d > 1:
        assert "data" in specs["logits"]  # batch rows split
    assert r["logits_max_abs"] < 2e-5 * max(r["logits_scale"], 1.0)
    assert r["sampler_tokens_equal"] and r["sampler_n_tokens"] > 0
    assert r["sampler_logprob_max_abs"] < 1e-4
    assert r["sampler_states_max_abs"] < 1e-4
    # One AdamW step moves every leaf by ~lr (1e-2); the sharded step agrees to 0.1 % of that.
    assert r["update_step_min_of_max"] > 5e-3
    assert r["update_param_max_abs"] < 2e-5
    for name, (ref, got) in r["update_metrics"].items():
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-5), name
    assert r["update_states_param_max_abs"] < 2e-5
    assert r["update_states_vs_whole_max_abs"] < 2e-5


def test_sharded_equals_single_device_on_2x2x2():
    out = _run_equivalence(["2,2,2"])
    assert out["devices"] == 8
    _check_mesh(out["meshes"][0])


@pytest.mark.slow
def test_sharded_equals_single_device_on_8x1x1_and_1x4x2():
    # sampler sizes 8 and 3: 3 rows pad to a batch bucket of 4, which data=8 does not divide
    # (replicated rows), and which fsdp=4 does
    out = _run_equivalence(["8,1,1", "1,4,2"], sampler_sizes="8,3")
    for r in out["meshes"]:
        _check_mesh(r)


# --------------------------------------------------------------------------- two processes


def _launch(tmp_path, mode: str, n: int, d: int, timeout: int):
    out = tmp_path / f"out_{n}"
    env = {**os.environ, "MORSE_ENTRY": f"{sys.executable} {TESTS / 'parallel_two_process_step.py'} "
                                        f"--mode {mode} --out {out}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # the launcher adds the device count
    proc = subprocess.run(["bash", str(LAUNCH), "-n", str(n), "-d", str(d), "-l", str(tmp_path / f"logs_{n}")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    logs = "".join(p.read_text()[-3000:] for p in sorted((tmp_path / f"logs_{n}").glob("*.log")))
    assert proc.returncode == 0, proc.stderr[-2000:] + logs
    return [dict(np.load(out / f"process_{i}.npz")) for i in range(n)]


def test_two_processes_broadcast_and_sharded_logits(tmp_path):
    p0, p1 = _launch(tmp_path, "logits", n=2, d=2, timeout=300)
    assert int(p0["process_count"]) == 2 and int(p0["device_count"]) == 4
    assert bool(p0["broadcast_ok"]) and bool(p1["broadcast_ok"])
    assert str(p0["logits_spec"]) == str(P("data", None, "tensor"))  # data across processes, tensor within
    np.testing.assert_array_equal(p0["logits"], p1["logits"])
    np.testing.assert_allclose(p0["logits"], p0["reference"], atol=2e-5, rtol=0)
    # a routing draw through replicated_jit: same on both processes, same as on one device
    np.testing.assert_array_equal(p0["route_members"], p1["route_members"])
    np.testing.assert_array_equal(p0["route_members"], p0["route_members_ref"])
    np.testing.assert_allclose(p0["route_probs"], p0["route_probs_ref"], atol=1e-6)


@pytest.mark.slow
def test_two_processes_one_update_step_equals_single_process(tmp_path):
    p0, p1 = _launch(tmp_path, "step", n=2, d=2, timeout=600)
    (ref,) = _launch(tmp_path, "step", n=1, d=1, timeout=600)
    assert int(p0["process_count"]) == 2 and int(ref["process_count"]) == 1 and int(p0["n_seqs"]) > 0
    keys = [k for k in p0 if k.startswith("trainable")]
    assert len(keys) == 9
    for k in keys + ["tokens", "rewards"]:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)  # same program, same inputs: bit-identical
    np.testing.assert_array_equal(p0["tokens"], ref["tokens"])
    np.testing.assert_array_equal(p0["rewards"], ref["rewards"])
    for k in keys:  # lr 1e-2; AdamW's first step amplifies float noise in near-zero gradients
        np.testing.assert_allclose(p0[k], ref[k], atol=5e-5, rtol=0, err_msg=k)


def test_launcher_rejects_bad_counts():
    proc = subprocess.run(["bash", str(LAUNCH), "-n", "0"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "-n must be a positive integer" in proc.stderr


# --------------------------------------------------------------------------- launch scripts


def test_launch_scripts_parse():
    for name in ("local_multiprocess.sh", "single_gpu.sh", "slurm_multihost.sbatch", "xla_gpu_flags.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / "launch" / name)], capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr)


def test_xla_gpu_preset_flags_are_known_to_xla():
    # XLA aborts on an unknown flag; this jaxlib's XLA parses the GPU debug options on CPU too.
    script = (f"source {REPO / 'launch' / 'xla_gpu_flags.sh'} && JAX_PLATFORMS=cpu {sys.executable} -c "
              "'import jax, os; jax.numpy.zeros(2).block_until_ready(); print(os.environ[\"XLA_FLAGS\"])'")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in proc.stdout


def _args_printer(tmp_path) -> str:
    script = tmp_path / "print_args.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], "
                      "'cuda': os.environ.get('CUDA_VISIBLE_DEVICES')}))\n")
    return f"{sys.executable} {script}"


def test_slurm_script_passes_coordinator_and_ranks(tmp_path):
    # Stand-ins for scontrol and srun: srun runs the task command once per rank, in order.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho gpu007\necho gpu008\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for ((r = 0; r < SLURM_NTASKS; r++)); do SLURM_PROCID=$r SLURM_LOCALID=$((r % 2)) \"$@\" || exit $?; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "4",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_SUBMIT_DIR": str(REPO),
           "MORSE_ENTRY": _args_printer(tmp_path), "MORSE_PROCESS_PER_GPU": "1", "MORSE_VENV": str(tmp_path / "none")}
    env.pop("SLURM_GPUS_PER_TASK", None)
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm_multihost.sbatch"), "--config", "configs/x.py"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["argv"][-1] for r in runs] == [f"--config.parallel.process_id={i}" for i in range(4)]
    for r in runs:
        assert r["argv"][:2] == ["--config", "configs/x.py"]
        assert f"--config.parallel.coordinator=gpu007:{77 % 4096 + 61440}" in r["argv"]
        assert "--config.parallel.num_processes=4" in r["argv"]
    assert [r["cuda"] for r in runs] == ["0", "1", "0", "1"]  # one GPU per process


def test_single_gpu_script_pins_one_device(tmp_path):
    env = {**os.environ, "MORSE_ENTRY": _args_printer(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "single_gpu.sh"), "--gpu", "3", "--config", "c.py"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cuda"] == "3" and out["argv"] == ["--config", "c.py", "--config.parallel.mesh=(1, 1, 1)"]


@pytest.mark.gguf
def test_main_job_evaluates_on_a_two_device_mesh(tmp_path):
    """The main job on 2 host devices (mesh data=2): plan, sharded sampling with experts, verify,
    report. Regression: the optimization barrier around top-k inside the sampler's lax.cond made
    XLA's SPMD partitioner abort ("optimization_barrier ... cannot be downcasted to
    GetTupleElement") on the SmolLM2 sampler; tiny models did not trigger it."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "morse_jax.main", "--config", "configs/quickstart.py",
                        "--config.mode=eval", f"--config.workdir={tmp_path / 'run'}",
                        f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.eval_ids=('19',)",
                        "--config.rollout.eval_max_new_tokens=8", "--config.rollout.max_attempts=1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "data=2" in r.stdout + r.stderr and (tmp_path / "run" / "report.md").is_file()


TINY_QUICKSTART = ["--config", "configs/quickstart.py", "--config.fresh=True", "--config.train.steps=1",
                   "--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)", "--config.data.tasks_per_step=1",
                   "--config.rollout.routes=2", "--config.rollout.candidates=2", "--config.rollout.max_attempts=1",
                   "--config.rollout.max_new_tokens=48", "--config.rollout.eval_max_new_tokens=48"]


def _checksums(text: str) -> dict[int, str]:
    import re

    return {int(p): c for p, c in re.findall(r"trainable checksum \(process (\d+)\): ([0-9a-f]+)", text)}


@pytest.mark.slow
@pytest.mark.gguf
def test_two_process_quickstart_step_matches_single_process(tmp_path):
    """launch/local_multiprocess.sh: two CPU processes run one step of the quickstart loop (plan,
    route, sharded generate, verify on process 0, HGRPO update, checkpoint, eval, report); both end
    with the same trainable params, equal to a one-process run of the same config."""
    logs = tmp_path / "logs"
    r = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", "2", "-d", "1", "-l", str(logs),
                        "--", *TINY_QUICKSTART, f"--config.workdir={tmp_path / 'mp'}",
                        f"--config.data.cache_dir={tmp_path / 'cache'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=1800,
                       # this interpreter's environment, venv activated or not
                       env={**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                   os.environ.get("PATH", "")])})
    assert r.returncode == 0, r.stderr[-4000:]
    multi = {**_checksums((logs / "process_0.log").read_text()), **_checksums((logs / "process_1.log").read_text())}
    assert set(multi) == {0, 1} and multi[0] == multi[1]
    assert (tmp_path / "mp" / "report.md").is_file() and (tmp_path / "mp" / "checkpoints" / "1").is_dir()
    single = subprocess.run([sys.executable, "-m", "morse_jax.main", *TINY_QUICKSTART,
                             f"--config.workdir={tmp_path / 'one'}", f"--config.data.cache_dir={tmp_path / 'cache'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert single.returncode == 0, single.stderr[-4000:]
    assert _checksums(single.stderr)[0] == multi[0]
