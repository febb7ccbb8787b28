"""TensorFlow training benchmark: the TF face vs TensorFlow's MultiWorkerMirroredStrategy,
and the TF face's overhead over the PyTorch face.

Every configuration runs the same job: 4 ranks train bench/train.py's
VGG-style model (three 3x3 convolutions 32/64/512 with 2x2 max-pooling on
32x32 inputs, FC 8192 -> 2560 -> 2048 -> 10: 26.6M parameters), written in
Keras, on scikit-learn's digits upsampled to 32x32, a random batch of 8 per
rank per step, SGD with momentum, for a fixed number of steps. Reported: the
median step time over the timed steps (after warm-up) and the CPU time one
rank spends per step.

Configurations:
  tf-floor          each rank steps its own optimizer, no communication
  tf-mwms           tf.distribute.MultiWorkerMirroredStrategy (RING collectives,
                    gRPC), a custom ``strategy.run`` loop (Keras 3 ``fit`` fails
                    under MWMS: ENVIRONMENT.md); Keras's optimizer all-reduces
  tf-hp-none        hipress_like.tensorflow.DistributedOptimizer, Compression.none
                    (every gradient in the engine's allreduce lane)
  tf-hp-<s>-<c>     the same with compressor c under strategy s (ps, ring):
                    onebit, powersgd (rank 4), powersgd1 (rank 1); the engine's
                    default plan (gradients from 1 MB up are compressed)
  torch-hp-none     the PyTorch face (bench/train.py's hp-none row: the same
                    model shape in torch, the same data and batch)
  torch-floor       bench/train.py's floor row

TensorFlow rows run with ``TF_ENABLE_ONEDNN_OPTS=1`` unless it is set (TF's
default is off on CPUs without AVX-512, where its Eigen kernels are ~3.5x
slower on this model than oneDNN's). The TF rows train inside ``tf.function``
(the DistributedOptimizer's path in ``model.fit``: ``tf.py_function`` hands
each gradient to the engine).

Two phases, one run:
  1. the speed goal: tf-floor, tf-mwms and the tf-hp rows on ``--netem``'s
     emulated 1 Gbit/s links (namespaces h0..h3, bench/netem.py; needs root),
     or loopback without ``--netem``. Goal: the best tf-hp row at least 2x
     faster per step than tf-mwms.
  2. the overhead goal, always on loopback: tf-hp-none against torch-hp-none
     (and both floors). Goal: tf-hp-none within 1.2x of torch-hp-none.

    python bench/train_tf.py --netem          # the headline run (root)
    python bench/train_tf.py --steps 10       # loopback only, quicker

Needs the TensorFlow environment (scripts/env_tensorflow.sh). Writes
results/train_tf_vgg[_netem].json. Timing lives here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # netem.py, train.py

TF_HP = ("tf-hp-ps-onebit", "tf-hp-ring-onebit", "tf-hp-ps-powersgd", "tf-hp-ring-powersgd",
         "tf-hp-ring-powersgd1")
PHASE1 = ("tf-floor", "tf-mwms", "tf-hp-none", *TF_HP)
PHASE2 = ("tf-floor", "tf-hp-none", "torch-floor", "torch-hp-none")
PARAMS = {"powersgd1": ("powersgd", {"rank": 1})}
MWMS_PORT = 29870  # gRPC port of every worker in the namespaces (loopback: + rank)


# -- one rank ---------------------------------------------------------------------------------

def _digits32():
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = tf.image.resize(d.images.astype("float32")[..., None] / 16.0, (32, 32),
                        method="bilinear").numpy()
    xtr, _, ytr, _ = train_test_split(x, d.target.astype("int64"), test_size=0.2,
                                      random_state=0, stratify=d.target)
    return np.ascontiguousarray(xtr), ytr


def vgg_style(num_classes=10, in_channels=1):
    """bench/train.py's VGG-style CNN in Keras (26.6M parameters, 99% in the FC layers)."""
    import keras

    layers = [keras.Input((32, 32, in_channels))]
    for c in (32, 64, 512):
        layers += [keras.layers.Conv2D(c, 3, padding="same", activation="relu"),
                   keras.layers.MaxPooling2D(2)]
    layers += [keras.layers.Flatten(), keras.layers.Dense(2560, activation="relu"),
               keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers)


def _mwms_config(rank, size):
    """TF_CONFIG for this rank: namespace addresses under netem, loopback ports otherwise."""
    import netem as nm

    if os.environ.get("MASTER_ADDR") == nm.MASTER_ADDR:
        hosts = [f"{nm.host_address(i)}:{MWMS_PORT}" for i in range(size)]
    else:
        base = int(os.environ["MWMS_BASE_PORT"])
        hosts = [f"127.0.0.1:{base + i}" for i in range(size)]
    return json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": rank}})


def worker(cfg):
    """Run one TF configuration on this rank; rank 0 writes the result."""
    name = cfg["config"]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if name == "tf-mwms":  # before TensorFlow starts: the strategy reads it at creation
        os.environ["TF_CONFIG"] = _mwms_config(rank, size)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow's pip build turns its oneDNN kernels on by default only on CPUs with
    # AVX-512/AMX; on an AVX2 CPU its own Eigen kernels run this model ~3.5x slower
    # than with oneDNN (measured: ~600 against ~160 ms of CPU per step, one thread),
    # slower than torch. Every TF row (MWMS too) gets oneDNN, unless the caller says no.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = None
    if name == "tf-mwms":
        comm = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    hvd = None
    if name.startswith("tf-hp-"):
        import hipress_like.tensorflow as hvd

        hvd.init()
    xtr, ytr = _digits32()
    keras.utils.set_random_seed(0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum" if strategy else "sum_over_batch_size")
    global_batch = cfg["batch"] * size

    def build():
        model = vgg_style()
        opt = keras.optimizers.SGD(cfg["lr"], momentum=0.9)
        if hvd is not None:
            comp = name[len("tf-hp-"):]
            strat, comp = ("ps", "none") if comp == "none" else comp.split("-", 1)
            comp, params = PARAMS.get(comp, (comp, {}))
            opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.get(comp, **params),
                                           strategy=strat, plan=None)
        return model, opt

    if strategy is not None:
        with strategy.scope():
            model, opt = build()

        @tf.function
        def step(x, y):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True)) / global_batch
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces
                return loss
            return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                   strategy.run(replica, args=(x, y)), axis=None)
    else:
        model, opt = build()
        if hvd is not None:
            hvd.broadcast_variables(model.variables, root_rank=0)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    times, losses = [], []
    total = cfg["warmup"] + cfg["steps"]
    for s in range(total):
        if s == cfg["warmup"]:
            cpu0 = time.process_time()
        g = np.random.default_rng(cfg["seed"] * 100003 + s * size + rank)
        idx = g.integers(0, len(xtr), cfg["batch"])
        x, y = tf.constant(xtr[idx]), tf.constant(ytr[idx])
        t0 = time.perf_counter()
        loss = float(step(x, y))  # float(): the step has finished
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    timed = times[cfg["warmup"]:]
    result = {"config": name, "rank": rank, "size": size,
              "ms_per_step": statistics.median(timed) * 1e3, "ms_steps": [t * 1e3 for t in timed],
              "cpu_ms_per_step": (time.process_time() - cpu0) / len(timed) * 1e3,
              "final_loss": statistics.mean(losses[-5:]),
              "params_m": sum(int(np.prod(v.shape)) for v in model.trainable_variables) / 1e6}
    if hvd is not None:
        layout = opt.engine.layout()
        result["compressed"] = sorted(n for n, v in layout.items() if v["compress"])
        result["staging_fresh"] = opt._hp_sync._staging.fresh
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(result, f)
    if hvd is not None:
        hvd.barrier()
        hvd.shutdown()
        if rank == 0:  # rank 0 hosts the rendezvous store: let the others leave it first
            time.sleep(2.0)
    sys.stdout.flush()
    os._exit(0)  # gRPC (MWMS) threads can keep a finished worker alive: leave now


# -- the parent ---------------------------------------------------------------------------------

def launch(cfg, nprocs, netem, timeout):
    """Start ``nprocs`` ranks of one configuration; rank 0's result dict."""
    import train

    if cfg["config"].startswith("torch-"):  # bench/train.py's own rows, loopback
        tcfg = dict(cfg, config=cfg["config"][len("torch-"):], model="vgg")
        return dict(train.launch(tcfg, nprocs, False, timeout), config=cfg["config"])
    fd, path = tempfile.mkstemp(prefix="hp-train-tf-", suffix=".json")
    os.close(fd)
    cfg = dict(cfg, result=path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    pypath = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    try:
        if netem:
            import netem as nm

            rcs = [nm.run_in_namespaces(nprocs, cmd, env={"PYTHONPATH": pypath},
                                        port=train._free_port(), timeout=timeout)]
        else:
            os.environ["MWMS_BASE_PORT"] = str(train._free_port() + 100)
            rcs = train._run_local(cmd, nprocs, pypath, timeout)
        with open(path) as f:
            text = f.read()
        if not text:
            raise RuntimeError(f"{cfg['config']}: ranks exited with {rcs} and no result")
        return json.loads(text)
    finally:
        os.unlink(path)


def _run(ns, names, netem):
    rows = []
    for c in names:
        cfg = dict(config=c, steps=ns.steps, warmup=ns.warmup, batch=ns.batch, lr=ns.lr,
                   seed=ns.seed)
        t0 = time.perf_counter()
        try:
            r = launch(cfg, ns.nprocs, netem, ns.timeout)
        except Exception as e:  # one failing row must not hide the others
            print(f"  {c:<22} FAILED: {e}", flush=True)
            continue
        rows.append(r)
        print(f"  {c:<22} {r['ms_per_step']:8.0f} ms/step  CPU {r['cpu_ms_per_step']:6.0f} "
              f"ms/rank  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _table(title, rows, ref):
    print(f"\n{title}")
    print(f"{'configuration':<22} {'ms/step':>9} {'x ' + ref:>14} {'CPU ms/rank':>12} "
          f"{'final loss':>11}")
    base = next((r["ms_per_step"] for r in rows if r["config"] == ref), None)
    for r in rows:
        x = f"{r['ms_per_step'] / base:.2f}" if base else "-"
        print(f"{r['config']:<22} {r['ms_per_step']:9.0f} {x:>14} "
              f"{r.get('cpu_ms_per_step', float('nan')):12.0f} {r['final_loss']:11.4f}")


def _goals(speed_rows, loop_rows):
    by = {r["config"]: r for r in speed_rows}
    lp = {r["config"]: r for r in loop_rows}
    goals = {}
    hp = [r for r in speed_rows if r["config"].startswith("tf-hp-")]
    if hp and "tf-mwms" in by:
        best = min(hp, key=lambda r: r["ms_per_step"])
        goals["mwms_over_best_hp"] = {
            "best": best["config"], "value": by["tf-mwms"]["ms_per_step"] / best["ms_per_step"],
            "goal": ">= 2.0"}
        for c in ("tf-hp-ps-onebit", "tf-hp-ring-powersgd"):
            if c in by:
                goals[f"mwms_over_{c}"] = {"value": by["tf-mwms"]["ms_per_step"]
                                           / by[c]["ms_per_step"], "goal": "reported"}
    if {"tf-hp-none", "torch-hp-none"} <= lp.keys():
        tf_ms, th_ms = lp["tf-hp-none"]["ms_per_step"], lp["torch-hp-none"]["ms_per_step"]
        goals["tf_over_torch_face"] = {"value": tf_ms / th_ms, "goal": "<= 1.2"}
        if {"tf-floor", "torch-floor"} <= lp.keys():
            tf_over = tf_ms - lp["tf-floor"]["ms_per_step"]
            th_over = th_ms - lp["torch-floor"]["ms_per_step"]
            goals["floor_tf_over_torch"] = {
                "value": lp["tf-floor"]["ms_per_step"] / lp["torch-floor"]["ms_per_step"],
                "goal": "context: compute alone"}
            goals["sync_overhead_ms"] = {"tf": tf_over, "torch": th_over, "goal": "context"}
    print("\ngoals")
    for k, g in goals.items():
        if "value" in g:
            ok = ("" if not g["goal"].startswith(("<", ">")) else
                  ("  met" if (g["value"] >= float(g["goal"][3:]) if g["goal"][0] == ">"
                               else g["value"] <= float(g["goal"][3:])) else "  NOT met"))
            extra = f" (best: {g['best']})" if "best" in g else ""
            print(f"  {k:<34} {g['value']:6.2f}  goal {g['goal']}{ok}{extra}")
        else:
            print(f"  {k:<34} TF face {g['tf']:.0f} ms, PyTorch face {g['torch']:.0f} ms "
                  "above their floors")
    return goals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=",".join(PHASE1),
                    help=f"phase 1 rows, comma-separated subset of {', '.join(PHASE1)}")
    ap.add_argument("--loopback-configs", default=",".join(PHASE2),
                    help=f"phase 2 rows (loopback), subset of {', '.join(PHASE2)}; '' skips")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--netem", nargs="?", const="1gbit", default=None,
                    help="phase 1 in namespaces h0..h{N-1} over emulated links (default 1gbit)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.worker:
        worker(json.loads(ns.worker))
        return 0
    phase1 = [c for c in ns.configs.split(",") if c]
    phase2 = [c for c in ns.loopback_configs.split(",") if c]
    unknown = set(phase1) - set(PHASE1) | set(phase2) - set(PHASE2)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}")
    link = f"namespaces over {ns.netem} links" if ns.netem else "loopback"
    budget = (f"{ns.nprocs} ranks, batch {ns.batch}/rank, {ns.warmup} warm-up + {ns.steps} "
              "timed steps (median)")
    print(f"bench/train_tf.py: VGG-style, {budget}\nphase 1 ({link}): {', '.join(phase1)}",
          flush=True)
    if ns.netem:
        import netem as nm

        nm.up(ns.nprocs, ns.netem)
    try:
        speed = _run(ns, phase1, bool(ns.netem))
    finally:
        if ns.netem:
            nm.down(ns.nprocs)
    print(f"phase 2 (loopback): {', '.join(phase2)}", flush=True)
    loop = _run(ns, phase2, False)
    if speed:
        _table(f"phase 1, {link}", speed, "tf-mwms")
    if loop:
        _table("phase 2, loopback", loop, "torch-hp-none")
    goals = _goals(speed, loop)
    out = ns.out or os.path.join(ROOT, "results",
                                 f"train_tf_vgg{'_netem' if ns.netem else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"budget": budget, "link": link,
                   "tf_onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1"), "rows": speed,
                   "loopback_rows": loop, "goals": goals}, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
