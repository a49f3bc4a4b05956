"""Reward hacking: wrong solutions to SciCode step 1.1 that attack the verifier score 0.

Each candidate below computes a wrong answer (or none) and tries one way to be scored right
anyway: patching the comparison or builtins, reaching the expected values (frames, gc, files,
the harness's own state), returning objects whose equality or array conversion lies, forging or
truncating the report, exiting early, exhausting limits so the comparison is skipped, or
skipping the comparison with a tracer. On the verifier before issue 17 (targets and comparison
inside the candidate's process) the first four scored 1.0 or partial credit. The right answer
still scores 1.0 in the same batch.

All candidates go through one ``verify_many`` call (one sandbox run each), so the whole suite
costs about as much as a dozen step verifications.
"""

from __future__ import annotations

import numpy as np
import pytest

from morse_jax.tasks.sandbox import record as sandbox_record, wire_format
from morse_jax.tasks.scicode import family as sc

LIMITS = sc.ExecLimits(timeout_s=30.0, test_timeout_s=3.0, memory_mb=2048, max_output_bytes=1 << 20)
WRONG = "    return np.zeros_like(b)\n"  # what each attacker would compute without the attack
HEADER = "def cg(A, b, x, tol):\n"

ATTACKS = {
    # --- patching comparison functions or builtins
    "patch_np_allclose": "np.allclose = lambda *a, **k: True\nnp.isclose = lambda *a, **k: True\n"
                         + HEADER + WRONG,
    "patch_numpy_module_globally": ("import numpy, numpy.core.numeric as _n\n"
                                    "for m in (numpy, _n):\n    m.allclose = lambda *a, **k: True\n"
                                    "    m.array_equal = lambda *a, **k: True\n" + HEADER + WRONG),
    "patch_builtins": ("import builtins\nbuiltins.bool = lambda *a: True\nbuiltins.all = lambda *a: True\n"
                       "builtins.AssertionError = type('Nope', (Exception,), {})\n" + HEADER + WRONG),
    "patch_wire_encoder": ("import sys\n"
                           "def cg(A, b, x, tol):\n"
                           "    w = sys.modules.get('morse_wire')\n"
                           "    if w is not None:\n"
                           "        w.encode = lambda v, _d=0: {'$float': 'nan'}\n"
                           "    return np.zeros_like(b)\n"),
    # --- reaching the expected values
    "walk_frames": ("import sys\n"
                    "def cg(A, b, x, tol):\n"
                    "    f = sys._getframe(1)\n"
                    "    while f is not None:\n"
                    "        for name in ('target', 'targets', 'blobs', 'expected', 'job'):\n"
                    "            v = f.f_locals.get(name, f.f_globals.get(name))\n"
                    "            if isinstance(v, np.ndarray) and v.shape == b.shape:\n"
                    "                return v\n"
                    "        f = f.f_back\n"
                    "    return np.zeros_like(b)\n"),
    "scan_gc": ("import gc\n"
                "def cg(A, b, x, tol):\n"
                "    for o in gc.get_objects():\n"
                "        if isinstance(o, dict):\n"
                "            for v in list(o.values()):\n"
                "                if isinstance(v, np.ndarray) and v.shape == b.shape and v is not b and v is not x \\\n"
                "                        and v.dtype == float and np.abs(A @ v - b).max() < 1e-3:\n"
                "                    return v\n"
                "    return np.zeros_like(b)\n"),
    "read_files": ("import os, glob, json\n"  # CACHE_DIR: the verifier's real target cache
                   "def cg(A, b, x, tol):\n"
                   "    for root in ['CACHE_DIR', os.path.expanduser('~/.cache'), '/tmp', '/var/tmp', os.getcwd()]:\n"
                   "        for p in sorted(glob.glob(os.path.join(root, '**', 'test*-*.json'), recursive=True)):\n"
                   "            v = json.load(open(p))['$ndarray']\n"
                   "            import base64\n"
                   "            return np.frombuffer(base64.b64decode(v[2]), dtype=v[0]).reshape(v[1])\n"
                   "    return np.zeros_like(b)\n"),
    # --- objects whose equality or array conversion lies
    "lying_ndarray_subclass": ("class Liar(np.ndarray):\n"
                               "    def __eq__(self, o): return True\n"
                               "    __ne__ = lambda self, o: False\n"
                               "    def __array_function__(self, func, types, args, kwargs): return True\n"
                               "    def __array_ufunc__(self, *a, **k): return True\n"
                               "    def __bool__(self): return True\n"
                               + HEADER + "    return np.zeros_like(b).view(Liar)\n"),
    "lying_array_like": ("class Liar:\n"
                         "    def __eq__(self, o): return True\n"
                         "    def __array__(self, dtype=None, copy=None): return np.zeros(7)\n"
                         "    def __len__(self): return 7\n"
                         "    def __bool__(self): return True\n"
                         + HEADER + "    return Liar()\n"),
    "lying_float_subclass": ("class F(float):\n"
                             "    def __eq__(self, o): return True\n"
                             "    def __sub__(self, o): return 0.0\n"
                             "    __rsub__ = __sub__\n"
                             + HEADER + "    return [F(0.0)] * len(b)\n"),
    # --- forging or truncating the report protocol
    "forge_report_guessed_nonce": ("import sys, os\n"
                                   "for tag in ('@@SCICODE 0000 ', '@@RECORD 0000 '):\n"
                                   "    sys.__stdout__.write(tag + '{\"program\": true, \"error\": \"\"}\\n')\n"
                                   "    for k in range(3):\n"
                                   "        sys.__stdout__.write(tag + '{\"case\": %d, \"test\": %d, \"error\": \"\", \"events\": []}\\n' % (k, k))\n"
                                   "sys.__stdout__.flush()\nos._exit(0)\n" + HEADER + WRONG),
    "forge_report_real_nonce": ("import sys, os, gc, json\n"
                                "def cg(A, b, x, tol):\n"
                                "    tag = None\n"
                                "    f = sys._getframe()\n"
                                "    while f is not None:\n"
                                "        tag = f.f_locals.get('tag', tag)\n"
                                "        f = f.f_back\n"
                                "    if tag:\n"
                                "        for k in range(3):\n"
                                "            sys.__stdout__.write('\\n' + tag + json.dumps({'case': k, 'error': '', 'events': []}) + '\\n')\n"
                                "        sys.__stdout__.flush()\n"
                                "        os._exit(0)\n"
                                "    return np.zeros_like(b)\n"),
    "truncate_report": ("import sys, os\n"
                        "def cg(A, b, x, tol):\n"
                        "    sys.__stdout__.write('\\n@@RECORD ')\n"
                        "    sys.__stdout__.flush()\n"
                        "    os._exit(0)\n"),
    # --- exiting early with success
    "sys_exit_zero": HEADER + "    raise SystemExit(0)\n",
    "os_exit_zero_at_import": "import os\nos._exit(0)\n" + HEADER + WRONG,
    "kill_own_process_group": ("import os, signal\n" + HEADER +
                               "    os.killpg(0, signal.SIGKILL)\n"),
    # --- exhausting limits so that the comparison is skipped
    "infinite_loop": HEADER + "    while True:\n        pass\n",
    "memory_exhaustion": HEADER + "    hog = [bytearray(1 << 26) for _ in range(10 ** 6)]\n    return b\n",
    "flood_stdout": ("import os\n" + HEADER +
                     "    for _ in range(512):\n        os.write(1, b'x' * 65536)\n    return np.zeros_like(b)\n"),
    "huge_recorded_value": HEADER + "    return [np.zeros_like(b)] * 50000\n",
    "deeply_nested_value": HEADER + "    v = np.zeros_like(b)\n    for _ in range(5000):\n        v = [v]\n    return v\n",
    # --- skipping the comparison
    "tracer_disables_the_recorder": ("import sys\n"
                                     "def _tr(frame, event, arg):\n"
                                     "    if frame.f_code.co_filename.startswith('case'):\n"
                                     "        frame.f_globals['__record__'] = lambda *a, **k: None\n"
                                     "    return None\n"
                                     "sys.settrace(_tr)\n" + HEADER + WRONG),
    "unpicklable_return_type": HEADER + "    return (lambda: b)\n",
}


@pytest.fixture(scope="module")
def step11(tmp_path_factory):
    p = {q.problem_id: q for q in sc.load_problems("package:dev")}["1"]
    targets = sc.RebuiltTargets(tmp_path_factory.mktemp("integrity-cache"))
    fam = sc.SciCodeFamily(targets, limits=LIMITS)
    task = sc.problem_to_task(p)
    return p, fam, task, fam.fixed_plan(task).node("1.1")


def _artifact(p, code):
    return sc.join_program(sc.gold_upstream(p, "1.1"), "1.1", code)


# The attacks the issue measured on the old verifier (1.0 or partial credit), plus forging with
# the real nonce and disabling the recorder: the fast subset of the default test set.
FAST = ("patch_np_allclose", "walk_frames", "lying_ndarray_subclass", "scan_gc", "forge_report_real_nonce",
        "tracer_disables_the_recorder", "read_files")


def _score_attacks(step11, names):
    p, fam, task, nd = step11
    cache = str(fam.targets.cache_dir)
    fam.targets.step_targets(p, p.step("1.1"))  # the target cache exists on the host
    arts = [_artifact(p, p.step("1.1").ground_truth)] + [_artifact(p, ATTACKS[n].replace("CACHE_DIR", cache))
                                                         for n in names]
    res = fam.verify_many(task, nd, arts, max_workers=2)
    assert res[0].gate and res[0].reward == 1.0, res[0]
    scored = {n: (r.gate, r.reward) for n, r in zip(names, res[1:])}
    assert {n: s for n, s in scored.items() if s[1] != 0.0} == {}
    assert all(gate for gate, _ in scored.values()), scored  # they were run, not stopped by the gate


def test_known_attacks_score_zero_and_the_right_answer_one(step11):
    _score_attacks(step11, FAST)


@pytest.mark.slow
def test_every_attack_scores_zero_and_the_right_answer_one(step11):
    """~1 min on 2 cores: every class (timeouts, memory, output floods included)."""
    _score_attacks(step11, [n for n in ATTACKS if n not in FAST])


def test_targets_never_enter_the_sandbox(step11, monkeypatch):
    """Whatever the verifier sends into the sandbox, no expected value is in it."""
    from morse_jax.tasks.sandbox import runner as sandbox

    p, fam, task, nd = step11
    targets = fam.targets.step_targets(p, p.step("1.1"))
    sent = []
    real = sandbox.run_many
    monkeypatch.setattr(sandbox, "run_many", lambda jobs, **kw: (sent.extend(jobs), real(jobs, **kw))[1])
    assert fam.verify_many(task, nd, [_artifact(p, p.step("1.1").ground_truth)])[0].reward == 1.0
    (job,) = sent
    payload = job.code + "".join(v if isinstance(v, str) else v.decode("latin-1") for v in job.files.values())
    for t in targets:
        for fmt in (repr, str, wire_format.dumps, lambda a: a.tobytes().decode("latin-1"),
                    lambda a: wire_format.encode(a)["$ndarray"][2]):
            assert fmt(t) not in payload
        for x in t:  # no single expected number either
            assert len(repr(float(x))) < 8 or repr(float(x)) not in payload


def test_lies_cannot_cross_the_wire_format():
    """The trusted side builds plain values whatever the sandbox side claims."""
    class Liar(np.ndarray):
        def __eq__(self, other):
            return True

    back = wire_format.loads(wire_format.dumps(np.zeros(3).view(Liar)))
    assert type(back) is np.ndarray and not np.allclose(back, np.ones(3))
    for bad, why in [('{"$ndarray": ["<f8", [3], "AAAA"]}', "bytes"),
                     ('{"$ndarray": ["O", [1], ""]}', "not carried"),
                     ('{"$ndarray": ["<f8", [1000000000000], ""]}', "size limit"),
                     ('{"$pickle": "gASVAAAA"}', "unknown wire tag"),
                     ('NaN', "bare NaN"),
                     ('{"$sparse": ["csr", [2, 2], {"$ndarray": ["<f8", [1], "AAAAAAAA8D8="]}, '
                      '{"$ndarray": ["<i8", [1], "BQAAAAAAAAA="]}, {"$ndarray": ["<i8", [1], "AAAAAAAAAAA="]}]}',
                      "out of range"),
                     ("[" * 200 + "]" * 200, "nested")]:
        with pytest.raises(wire_format.WireError, match=why):
            wire_format.loads(bad)
    with pytest.raises(wire_format.WireError, match="cannot leave the sandbox"):
        wire_format.dumps(object())


def test_check_outputs_compares_outside():
    """The one function for hidden input/output tests: values come back, comparison is here."""
    prog = ("import numpy as np\n"
            "np.allclose = lambda *a, **k: True\n"
            "def solve(n):\n    return np.arange(n) * 2.0\n")
    res = sandbox_record.check_outputs(prog, ["solve(3)", "solve(2)", "undefined(1)"],
                                       [np.array([0.0, 2.0, 4.0]), np.array([0.0, 3.0]), 1])
    assert [r.passed for r in res] == [True, False, False]
    assert "NameError" in res[2].reason
