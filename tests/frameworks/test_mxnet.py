"""The MXNet face (``hipress_like.mxnet``) with real ranks, in MXNet's own environment.

Jobs run as 4 real processes, started the way users start them: with
torchrun-style environment rendezvous (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: plain subprocesses, or torchrun itself)
and with mpirun. Properties checked:

- every rank ends with bitwise-identical weights, and digits accuracy is
  within 1 point of the uncompressed run through this project, for onebit
  under PS and PowerSGD under Ring;
- a checkpoint at step k (Gluon states + compressor state) resumed in a new
  job gives the losses of the uninterrupted run, bit for bit;
- the bad inputs the PyTorch face refuses are refused the same way
  (mismatched models, unknown compressor, NaN policy, non-float gradients,
  calls in the wrong order);
- a Horovod MXNet script (mxnet_mnist.py style) runs with only its import
  switched; the example runs under torchrun and mpirun.

MXNet 1.9.1 needs numpy 1.23.5, so these tests run in their own venv:
``scripts/env_mxnet.sh --test``. Elsewhere they skip saying so.
"""
import difflib
import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_horovodrun import results_of

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
JOB = HERE / "mx_digits_job.py"
HOROVOD_STYLE = HERE / "mx_horovod_style.py"
EXAMPLE = ROOT / "examples" / "mxnet_digits.py"
BIN = Path(sys.executable).parent
INSTALL = "scripts/env_mxnet.sh --test"


def _mxnet_missing() -> str:
    """Why the MXNet tier cannot run here ('' when it can)."""
    res = subprocess.run([sys.executable, "-c", "import mxnet, hipress_like.mxnet"],
                         capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["?"])[-1][-200:]
        return f"MXNet is not importable in {sys.executable} ({last})"
    return ""


_WHY = _mxnet_missing()
needs_mxnet = pytest.mark.skipif(bool(_WHY), reason=f"{_WHY}; MXNet needs numpy 1.23.5 and "
                                 f"its own venv: run {INSTALL}")
pytestmark = [pytest.mark.frameworks, needs_mxnet]


def _mpi_missing() -> str:
    """Why mpirun jobs cannot run here ('' when they can)."""
    if shutil.which("mpirun") is None:
        return "no mpirun (apt-get install -y openmpi-bin libopenmpi-dev)"
    res = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True)
    return "" if res.returncode == 0 else "mpi4py is not installed in this venv"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_", "HOROVOD_", "OMPI_", "PMI", "DMLC_",
                                "HIPRESS_TRANSPORT"))}
    env.update(OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1", PYTHONPATH=str(ROOT),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PATH=f"{BIN}:{os.environ['PATH']}")
    env.update(extra)
    return env


# A rendezvous that failed before any training: the free port found by _free_port()
# was taken by another job between closing and binding it (other test runs share
# this machine). Such a job is started once more, on a new port.
_RENDEZVOUS_FAILED = ("DistNetworkError", "EADDRINUSE", "address already in use")


def run(launcher: str, script: Path, *args: str, np: int = 4, timeout: float = 900,
        env: dict = None):
    """Run ``script`` on ``np`` ranks; returns (returncode, combined output).

    launcher: "env" (one subprocess per rank with torchrun's variables),
    "torchrun" (torchrun itself), "mpirun" or "horovodrun" (``--gloo``).
    ``env``: extra variables.
    """
    rc, out = _run_once(launcher, script, args, np, timeout, env or {})
    if rc and "RESULT" not in out and any(s in out for s in _RENDEZVOUS_FAILED):
        rc, out = _run_once(launcher, script, args, np, timeout, env or {})
    return rc, out


def _run_once(launcher, script, args, np, timeout, extra):
    argv = [str(script), *map(str, args)]
    if launcher == "env":
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, *argv], cwd=str(ROOT), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=_env(RANK=str(r), WORLD_SIZE=str(np), LOCAL_RANK=str(r),
                                           LOCAL_WORLD_SIZE=str(np), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, **extra))
                 for r in range(np)]
        outs, deadline = [], time.monotonic() + timeout
        try:
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    outs.append(p.communicate()[0] + "\n[killed at the timeout]")
        finally:  # also when pytest-timeout interrupts: leave no rank behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        rc = next((p.returncode for p in procs if p.returncode), 0)
        return rc, "\n".join(outs)
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), f"--nproc-per-node={np}", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", *argv]
    elif launcher == "mpirun":
        cmd = ["mpirun", "-np", str(np), "--bind-to", "none", "-x", "OMP_NUM_THREADS",
               "-x", "PYTHONPATH", "-x", "PATH", "-x", "MXNET_CPU_WORKER_NTHREADS",
               sys.executable, *argv]
    elif launcher == "horovodrun":
        cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(np), "-H", f"localhost:{np}",
               sys.executable, *argv]
    else:
        raise ValueError(launcher)
    proc = subprocess.run(cmd, cwd=str(ROOT), env=_env(**extra), text=True,
                          capture_output=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def results(out: str) -> dict:
    """``RESULT {json}`` lines by rank."""
    return results_of(out)


@functools.lru_cache(maxsize=None)
def _trained(compression: str, strategy: str, launcher: str = "env"):
    rc, out = run(launcher, JOB, "--compression", compression, "--strategy", strategy)
    res = results(out)
    assert rc == 0 and sorted(res) == [0, 1, 2, 3], f"job failed:\n{out[-4000:]}"
    return res


# -- replicas and accuracy -------------------------------------------------------------------

@pytest.mark.timeout(2400)  # several 4-rank jobs on a shared machine
@pytest.mark.parametrize("compression, strategy", [("onebit", "ps"), ("powersgd", "ring")])
def test_replicas_identical_and_accuracy_within_1pt_of_uncompressed(compression, strategy):
    base = _trained("none", "ps")
    res = _trained(compression, strategy)
    assert len({r["digest"] for r in base.values()}) == 1, f"uncompressed replicas differ: {base}"
    assert len({r["digest"] for r in res.values()}) == 1, f"replicas differ: {res}"
    assert {r["transport"] for r in res.values()} == {"TorchDistTransport"}
    # the compressor really ran: some gradient left the uncompressed allreduce lane
    assert set(res[0]["layout"].values()) - {"allreduce"}, res[0]["layout"]
    acc, ref = res[0]["acc"], base[0]["acc"]
    print(f"digits {compression}/{strategy}: {acc:.2f}% vs uncompressed {ref:.2f}%")
    assert acc >= ref - 1.0, f"{compression}/{strategy}: {acc:.2f}% vs {ref:.2f}% uncompressed"
    assert ref > 90.0, f"the uncompressed run learned too little: {ref:.2f}%"


def test_artopk_over_a_tree_from_the_mxnet_face(tmp_path):
    """``DistributedTrainer(collective="tree")`` reaches the engine: STAR-Topk's rounds run
    on the collective lane (indices down a binomial tree, values summed by a tree), and
    the replicas stay bitwise identical."""
    from hipress_like.cost_model.plan import Plan, SizeRule

    plan = tmp_path / "plan.json"
    Plan(compressor="star_topk", params={"ratio": 0.05},
         rule=SizeRule(min_compress_bytes=0)).save(plan)
    rc, out = run("env", JOB, "--compression", "star_topk", "--plan", str(plan),
                  "--collective", "tree", "--epochs", "3")
    res = results(out)
    assert rc == 0 and sorted(res) == [0, 1, 2, 3], f"job failed:\n{out[-4000:]}"
    assert len({r["digest"] for r in res.values()}) == 1, f"replicas differ: {res}"
    assert set(res[0]["layout"].values()) == {"rounds-allreduce"}, res[0]["layout"]


# -- checkpoints ------------------------------------------------------------------------------

@pytest.mark.timeout(2400)  # several 4-rank jobs on a shared machine
@pytest.mark.parametrize("compression, strategy, per_rank", [
    ("onebit", "ps", False),     # rank 0 writes every rank's compressor state
    ("powersgd", "ring", True),  # every rank writes its own
])
def test_checkpoint_at_step_k_resumes_with_the_uninterrupted_losses(
        compression, strategy, per_rank, tmp_path):
    """Bit for bit. PowerSGD's P and Q travel only by allreduce, so the engine replays
    the fused allreduces recorded at its first step; the checkpoint carries that
    schedule (a resumed engine that recorded its own would fuse, and so round its
    4-rank float sums, differently: measured, the losses parted in the last bits 2-4
    steps after the resume). Onebit's PS links are coordinated every step."""
    common = ["--compression", compression, "--strategy", strategy, "--steps", "30",
              "--save-at", "12", "--ckpt", str(tmp_path), *(["--per-rank"] if per_rank else [])]
    rc, out = run("env", JOB, *common)
    full = results(out)
    assert rc == 0 and sorted(full) == [0, 1, 2, 3], out[-4000:]
    assert (tmp_path / ("trainer0.states.hipress" if per_rank
                        else "trainer.states.hipress")).exists()
    rc, out = run("env", JOB, *common, "--resume")
    resumed = results(out)
    assert rc == 0 and sorted(resumed) == [0, 1, 2, 3], out[-4000:]
    for r in range(4):
        assert resumed[r]["first"] == 12
        assert resumed[r]["losses"] == full[r]["losses"][12:], f"rank {r}: losses differ"
        assert resumed[r]["digest"] == full[r]["digest"], f"rank {r}: final weights differ"
    if not per_rank:
        # the control: without the compressor state (onebit's error-feedback residuals)
        # the resumed run is another run
        (tmp_path / "trainer.states.hipress").unlink()
        rc, out = run("env", JOB, *common, "--resume")
        fresh = results(out)
        assert rc == 0 and "starts fresh" in out, out[-4000:]
        assert fresh[0]["losses"] != full[0]["losses"][12:]


# -- refusals ---------------------------------------------------------------------------------

REFUSALS = ("unknown_compressor", "unknown_compressor_attr", "nonfinite_policy", "strategy",
            "collective",
            "non_float_gradient", "mismatched_models", "nan_skip", "nan_skip_then_train",
            "nan_propagate", "nan_raise", "update_without_allreduce", "allreduce_twice")


def test_bad_inputs_are_refused_like_the_torch_face():
    rc, out = run("env", JOB, "--case", "refusals", timeout=600)
    assert rc == 0, out[-4000:]
    checks = re.findall(r"CHECK (\w+) (ok|FAIL) (.*)", out)
    failed = [c for c in checks if c[1] != "ok"]
    assert not failed, failed
    for name in REFUSALS:
        assert sum(c[0] == name for c in checks) == 4, f"{name}: not checked on every rank"
    msgs = {c[0]: c[2] for c in checks}
    # the same messages the PyTorch face gives, plus the Gluon parameter names
    assert "available: " in msgs["unknown_compressor"]
    assert "GradientMismatchError" in msgs["mismatched_models"]
    assert "shape (512,)" in msgs["mismatched_models"] and "(256,)" in msgs["mismatched_models"]
    assert "is 'dense" in msgs["mismatched_models"]


# -- Horovod-style script, the example, launchers -----------------------------------------------

def test_horovod_style_script_differs_from_a_horovod_script_by_its_import():
    text = HOROVOD_STYLE.read_text()
    horovod = text.replace("import hipress_like.mxnet as hvd", "import horovod.mxnet as hvd")
    diff = [d for d in difflib.unified_diff(text.splitlines(), horovod.splitlines(), lineterm="")
            if d.startswith(("+", "-")) and not d.startswith(("+++", "---"))]
    assert diff == ["-import hipress_like.mxnet as hvd", "+import horovod.mxnet as hvd"]
    assert "hipress" not in horovod.split('"""', 2)[2]  # only the docstring mentions us
    # every hvd.* it calls is horovod.mxnet's public API (horovod 0.28.1)
    used = set(re.findall(r"\bhvd\.(\w+)", text))
    horovod_mxnet = {"init", "rank", "size", "local_rank", "local_size", "broadcast_parameters",
                     "DistributedTrainer", "DistributedOptimizer", "allreduce", "allreduce_",
                     "broadcast", "broadcast_", "allgather", "Compression", "shutdown"}
    assert used and used <= horovod_mxnet, used - horovod_mxnet


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_horovod_style_script_runs_with_only_the_import_switched(launcher, tmp_path):
    if launcher == "mpirun" and _mpi_missing():
        pytest.skip(_mpi_missing())
    rc, out = run(launcher, HOROVOD_STYLE, "--epochs", "4", "--save-dir", str(tmp_path))
    assert rc == 0, out[-4000:]
    assert re.search(r"Epoch\[3\]\tTrain: accuracy=\S+\tValidation: accuracy=", out), out[-2000:]
    files = [(tmp_path / f"rank{r}.params").read_bytes() for r in range(4)]
    assert all(f == files[0] for f in files), "replicas differ"


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "horovodrun"])
def test_example_trains_under(launcher):
    if launcher == "mpirun" and _mpi_missing():
        pytest.skip(_mpi_missing())
    if launcher == "horovodrun" and _horovod_missing():
        pytest.skip(_horovod_missing())
    rc, out = run(launcher, EXAMPLE, "--epochs", "3", "--compression", "onebit", "--plan", "none")
    assert rc == 0, out[-4000:]
    accs = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", out)]
    assert len(accs) == 3 and accs[-1] > 85.0, out[-2000:]


@pytest.mark.timeout(2400)  # several 4-rank jobs on a shared machine
def test_example_checkpoint_resume(tmp_path):
    rc, out = run("torchrun", EXAMPLE, "--epochs", "2", "--compression", "powersgd",
                  "--strategy", "ring", "--plan", "none", "--checkpoint", str(tmp_path))
    assert rc == 0, out[-4000:]
    rc, out = run("torchrun", EXAMPLE, "--epochs", "3", "--compression", "powersgd",
                  "--strategy", "ring", "--plan", "none", "--checkpoint", str(tmp_path),
                  "--resume")
    assert rc == 0 and "resumed after epoch 2" in out and re.search(r"epoch  3 ", out), \
        out[-3000:]


def test_distributed_optimizer_keeps_replicas_identical():
    rc, out = run("env", JOB, "--case", "optimizer", "--steps", "40")
    res = results(out)
    assert rc == 0 and sorted(res) == [0, 1, 2, 3], out[-4000:]
    assert len({r["digest"] for r in res.values()}) == 1, res


def _horovod_missing() -> str:
    """Why horovodrun cannot launch here ('' when it can). It only launches and
    rendezvouses (the face reads HOROVOD_RANK and friends; the engine rides Horovod's
    PyTorch ops or gloo), so Horovod built with PyTorch into this venv is enough:
    Horovod's own MXNet ops are not needed."""
    if (BIN / "horovodrun").exists():
        return ""
    return (f"Horovod is not installed in {BIN.parent} (MXNet's numpy pin keeps it apart "
            "from the main .venv); build it into this environment with "
            f"HIPRESS_VENV={BIN.parent} scripts/env_horovod.sh")


def test_horovodrun(tmp_path):
    """A Horovod MXNet script, import switched, under horovodrun: one world of four."""
    if _horovod_missing():
        pytest.skip(_horovod_missing())
    rc, out = run("horovodrun", HOROVOD_STYLE, "--epochs", "2", "--save-dir", str(tmp_path))
    assert rc == 0, out[-4000:]
    assert re.search(r"Epoch\[1\]\tTrain: accuracy=\S+\tValidation: accuracy=", out), out[-2000:]
    # four ranks of one world (a rank alone would be rank 0 of 1 and save rank0 only)
    files = [(tmp_path / f"rank{r}.params").read_bytes() for r in range(4)]
    assert all(f == files[0] for f in files), "replicas differ"


# -- one process: collectives and state files ----------------------------------------------------

@pytest.fixture(scope="module")
def single():
    """One rank in this process (no launcher variables): ``hvd.init()`` makes a world of one."""
    import hipress_like.mxnet as hvd

    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK")}
    hvd.init()
    yield hvd
    hvd.shutdown()
    os.environ.update(saved)


def test_collectives_on_one_rank(single):
    import mxnet as mx
    import numpy as np

    hvd = single
    x = mx.nd.array([1.0, 2.0, 3.0])
    assert hvd.allreduce(x).asnumpy().tolist() == [1.0, 2.0, 3.0]
    assert hvd.allreduce(x, op=hvd.Sum).context == x.context
    assert hvd.allgather(mx.nd.array([[1, 2]], dtype="int32")).dtype == np.int32
    y = mx.nd.array([5.0])
    assert hvd.broadcast_(y, root_rank=0) is y
    assert hvd.broadcast_object({"epoch": 3}) == {"epoch": 3}
    assert hvd.allgather_object("a") == ["a"]
    with pytest.raises(TypeError, match="NDArray"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_parameters({"x": x}, root_rank=3)
    with pytest.raises(ValueError, match="DistributedTrainer"):
        hvd.DistributedOptimizer(mx.optimizer.SGD(), compression=hvd.Compression.onebit)


def test_horovod_mxnet_calls_on_one_rank(single):
    """horovod.mxnet's calls beyond the collectives (adapters/mxnet/horovod_calls.py):
    results on one rank, fp16 compression of NDArrays, and refusals that Horovod
    scripts catch as RuntimeError (horovod.mxnet raises MXNetError, one)."""
    import mxnet as mx
    import numpy as np

    hvd = single
    x = mx.nd.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert hvd.reducescatter(x, op=hvd.Sum).asnumpy().tolist() == x.asnumpy().tolist()
    assert [a.shape for a in hvd.grouped_allgather([x, x[0]])] == [(3, 2), (2,)]
    out, received = hvd.alltoall(x, splits=[3])
    assert out.asnumpy().tolist() == x.asnumpy().tolist() and received.asnumpy().tolist() == [3]
    with pytest.raises(RuntimeError, match="alltoall") as info:
        hvd.alltoall(x, splits=mx.nd.array([5], dtype="int32"))  # more rows than there are
    assert isinstance(info.value, (hvd.MXNetCallError, ValueError))
    for dtype in ("float16", "float32", "float64", "uint8", "int32"):
        t = mx.nd.ones((17, 3), dtype=dtype)
        wire, ctx = hvd.Compression.fp16.compress(t)
        assert wire.dtype == (np.float16 if dtype.startswith("float") else np.dtype(dtype))
        back = hvd.Compression.fp16.decompress(wire, ctx)
        assert back.dtype == np.dtype(dtype) and back.asnumpy().tolist() == t.asnumpy().tolist()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0),
                                   process_set=hvd.global_process_set)
    w, g = mx.nd.ones((2,)), mx.nd.array([0.5, 0.25])
    opt.update(0, w, g, opt.create_state(0, w))
    assert w.asnumpy().tolist() == [0.5, 0.75]


def _tiny(hvd, **kw):
    import mxnet as mx
    from mxnet import autograd, gluon

    mx.random.seed(0)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Xavier())
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                plan=None, **kw)
    for _ in range(2):
        with autograd.record():
            loss = (net(mx.nd.ones((2, 4))) ** 2).sum()
        loss.backward()
        tr.step(2)
    return net, tr


def test_state_files_round_trip_and_refuse_another_ranks_state(single, tmp_path):
    import torch

    hvd = single
    net, tr = _tiny(hvd, compression="onebit")
    fname = str(tmp_path / "t.states")
    tr.save_states(fname)
    hip = torch.load(fname + hvd.STATE_SUFFIX, weights_only=True)
    assert hip["rank"] == 0 and hip["world_size"] == 1 and hip["engine"]["step"] == 2
    _, tr2 = _tiny(hvd, compression="onebit")
    tr2.load_states(fname)
    assert tr2.engine.step == 2
    hip["rank"] = 3
    torch.save(hip, fname + hvd.STATE_SUFFIX)
    with pytest.raises(ValueError, match=r"rank 3.*all_ranks=True"):
        tr2.load_states(fname)
    hip["world_size"] = 8
    torch.save(hip, fname + hvd.STATE_SUFFIX)
    with pytest.warns(UserWarning, match="8 ranks"):
        tr2.load_states(fname)
    os.remove(fname + hvd.STATE_SUFFIX)
    with pytest.warns(UserWarning, match="starts fresh"):
        tr2.load_states(fname)
    tr.close()
    tr2.close()


def test_float16_parameters_are_reduced_in_float32(single):
    """A float16 weight's gradient goes to the engine as float32 and comes back cast.
    (MXNet's CPU build has no float16 Dense/Conv; elementwise ops are enough here.)"""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    hvd = single
    w = gluon.Parameter("w", shape=(4,), dtype="float16", init=mx.init.One())
    w.initialize(ctx=mx.cpu())
    tr = hvd.DistributedTrainer([w], "sgd", {"learning_rate": 0.5}, plan=None)
    assert tr.engine.layout()["0"]["compress"] is False
    with autograd.record():
        loss = (w.data() * mx.nd.array([1, 2, 3, 4], dtype="float16")).sum()
    loss.backward()
    tr.step(1)
    assert w.data().dtype == np.float16
    assert w.data().asnumpy().tolist() == [0.5, 0.0, -0.5, -1.0]  # 1 - 0.5 * grad
    tr.close()
