"""MXNet training benchmark: hipress_like.mxnet against MXNet's own ``dist_sync`` kvstore.

Every configuration runs the same job: 4 workers train the same Gluon model
(the VGG-style CNN of examples/models.py: three conv layers 32/64/512 on
32x32 input, FC 8192 -> 2560 -> 2048 -> 10, 26.6M parameters) on
scikit-learn's digits upsampled to 32x32, the same batch per worker and
step, SGD with momentum, for a fixed number of steps. Reported per
configuration: the median step time over the timed steps (after warm-up;
every step ends with ``mx.nd.waitall()``, MXNet being asynchronous), its
ratios to the other rows measured in the same run, and the CPU time one
worker spends per timed step.

Configurations:
  floor              every worker steps alone (gluon.Trainer, kvstore=None): no
                     communication at all
  kvstore            MXNet's distributed kvstore ``dist_sync``: 1 scheduler +
                     1 server + 4 workers (ps-lite), gluon.Trainer(kvstore=kv);
                     the server applies the optimizer (MXNet's default for dist)
  hp-none            hipress_like.mxnet.DistributedTrainer, no compression
                     (the engine's allreduce lane)
  hp-ps-onebit       ... onebit, co-located parameter servers (PS)
  hp-ring-powersgd   ... PowerSGD (rank 4), Ring
  hp-ring-powersgd1  ... PowerSGD rank 1, Ring

Links: loopback by default. ``--netem [RATE]`` (root) puts worker i in
network namespace ``h<i>`` and the kvstore's scheduler and server in ``h4``
(a host of their own, as a parameter server is deployed), every link shaped
to RATE (default 1gbit) by ``hipress_like.launch.netem``.

    python bench/train_mxnet.py                   # loopback, every configuration
    python bench/train_mxnet.py --netem           # 1 Gbit/s emulated links
    python bench/train_mxnet.py --configs kvstore,hp-ps-onebit --steps 10
    python bench/train_mxnet.py --repeats 3      # a shared host: median of 3 interleaved runs

Runs in the MXNet environment (scripts/env_mxnet.sh creates .venv-mxnet).
Writes results/train_mxnet[_netem].json. Timing lives here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CONFIGS = ("floor", "kvstore", "hp-none", "hp-ps-onebit", "hp-ring-powersgd",
           "hp-ring-powersgd1")
# name -> (compressor, params, strategy)
HP = {"hp-none": ("none", {}, "ps"), "hp-ps-onebit": ("onebit", {}, "ps"),
      "hp-ring-powersgd": ("powersgd", {}, "ring"),
      "hp-ring-powersgd1": ("powersgd", {"rank": 1}, "ring")}
SERVER_HOST = 4  # the kvstore's scheduler and server live in namespace h4 under --netem


# -- one process ---------------------------------------------------------------------------

def vgg_gluon():
    """examples/models.py's ``vgg_style`` in Gluon (shapes given: no deferred init)."""
    from mxnet import gluon

    net = gluon.nn.HybridSequential()
    for cin, cout in ((1, 32), (32, 64), (64, 512)):
        net.add(gluon.nn.Conv2D(cout, 3, padding=1, in_channels=cin, activation="relu"),
                gluon.nn.MaxPool2D(2))
    net.add(gluon.nn.Flatten(),
            gluon.nn.Dense(2560, in_units=512 * 4 * 4, activation="relu"),
            gluon.nn.Dense(2048, in_units=2560, activation="relu"),
            gluon.nn.Dense(10, in_units=2048))
    return net


def _digits():
    """bench/train.py's data: digits upsampled to 32x32 (bilinear), an 80/20 split."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.from_numpy(d.images.astype("float32") / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).numpy()
    xtr, _, ytr, _ = train_test_split(x, d.target.astype("float32"), test_size=0.2,
                                      random_state=0, stratify=d.target)
    return xtr, ytr


def worker(cfg):
    """Run one configuration in this process (a worker); worker 0 writes the result."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    name = cfg["config"]
    hvd = None
    kv = None
    if name == "kvstore":
        kv = mx.kv.create("dist_sync")
        rank, size = kv.rank, kv.num_workers
    else:
        import hipress_like.mxnet as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    xtr, ytr = _digits()
    mx.random.seed(0)
    net = vgg_gluon()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    opt = {"learning_rate": cfg["lr"], "momentum": 0.9}
    batch = cfg["batch"]
    if name == "kvstore":  # kvstore.init broadcasts worker 0's weights
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv)
        scale = batch * size  # the server sums the workers' gradients: average them
    elif name == "floor":
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=None)
        scale = batch
    else:
        comp, params, strategy = HP[name]
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", opt,
                                         compression=hvd.Compression.get(comp, **params),
                                         strategy=strategy, plan=None)
        scale = batch
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times, losses = [], []
    total = cfg["warmup"] + cfg["steps"]
    for step in range(total):
        if step == cfg["warmup"]:
            cpu0 = time.process_time()
        idx = np.random.RandomState(cfg["seed"] * 100003 + step * size + rank).randint(
            0, len(xtr), batch)
        x, y = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
        mx.nd.waitall()
        t0 = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(scale)
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.mean().asscalar()))
    timed = times[cfg["warmup"]:]
    cpu_ms = (time.process_time() - cpu0) / max(1, len(timed)) * 1e3
    result = {"config": name, "rank": rank, "size": size,
              "ms_per_step": statistics.median(timed) * 1e3,
              "ms_steps": [t * 1e3 for t in timed], "cpu_ms_per_step": cpu_ms,
              "final_loss": statistics.mean(losses[-5:]),
              "params_m": sum(p.data().size for p in net.collect_params().values()) / 1e6}
    if hvd is not None:
        cpu = hvd.allreduce(mx.nd.array([cpu_ms], dtype="float64"), name="cpu_ms")
        result["cpu_ms_per_step"] = float(cpu.asscalar())  # the mean over workers
        if trainer.__class__ is not gluon.Trainer:
            layout = trainer.engine.layout()
            result["compressed"] = sorted(n for n, v in layout.items() if v["compress"])
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(result, f)
    if hvd is not None:
        hvd.barrier()
        hvd.shutdown()


# -- the parent ----------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes(cfg, nprocs, netem):
    """(namespace or None, env) of every process of one configuration."""
    from hipress_like.launch import netem as nm

    host = (lambda i: nm.host_address(i)) if netem else (lambda i: "127.0.0.1")
    ns = (lambda i: f"h{i}") if netem else (lambda i: None)
    base = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    port = str(_free_port())
    if cfg["config"] == "kvstore":
        dmlc = dict(base, DMLC_PS_ROOT_URI=host(SERVER_HOST if netem else 0),
                    DMLC_PS_ROOT_PORT=port, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(nprocs))
        if netem:
            dmlc["DMLC_INTERFACE"] = "eth0"
        srv = SERVER_HOST if netem else 0
        procs = [(ns(srv), dict(dmlc, DMLC_ROLE=role, DMLC_NODE_HOST=host(srv)))
                 for role in ("scheduler", "server")]
        return procs + [(ns(i), dict(dmlc, DMLC_ROLE="worker", DMLC_NODE_HOST=host(i)))
                        for i in range(nprocs)]
    env = dict(base, WORLD_SIZE=str(nprocs), MASTER_ADDR=host(0), MASTER_PORT=port,
               LOCAL_WORLD_SIZE="1" if netem else str(nprocs))
    if netem:
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    return [(ns(i), dict(env, RANK=str(i), LOCAL_RANK="0" if netem else str(i)))
            for i in range(nprocs)]


def launch(cfg, nprocs, netem, timeout):
    """Start every process of ``cfg``; return worker 0's result dict."""
    from hipress_like.launch.procs import own_process_group

    fd, path = tempfile.mkstemp(prefix="hp-train-mx-", suffix=".json")
    os.close(fd)
    cfg = dict(cfg, result=path)
    worker_cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    server_cmd = [sys.executable, "-c", "import mxnet"]  # ps-lite runs at import
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "DMLC_", "OMPI_",
                                  "HOROVOD_"))}
    procs = []
    try:
        for ns, env in _processes(cfg, nprocs, netem):
            cmd = server_cmd if env.get("DMLC_ROLE") in ("scheduler", "server") else worker_cmd
            if ns:
                cmd = ["ip", "netns", "exec", ns, *cmd]
            procs.append(subprocess.Popen(cmd, env=dict(clean, **env), **own_process_group()))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                time.sleep(3)  # let the others report their own errors
                break
            time.sleep(0.2)
        rcs = [p.poll() for p in procs]
        with open(path) as f:
            text = f.read()
        if not text:
            raise RuntimeError(f"{cfg['config']}: processes exited with {rcs} and no result")
        return json.loads(text)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        os.unlink(path)


def _report(rows, budget):
    by = {r["config"]: r for r in rows}
    floor = by.get("floor", {}).get("ms_per_step")
    kvs = by.get("kvstore", {}).get("ms_per_step")
    none = by.get("hp-none", {}).get("ms_per_step")
    print(f"\nGluon VGG-style, {rows[0]['params_m']:.1f}M parameters, {budget}")
    print(f"{'configuration':<20} {'ms/step':>8} {'x floor':>8} {'kvstore/this':>13} "
          f"{'hp-none/this':>13} {'CPU ms/worker':>14} {'final loss':>11}")
    for r in rows:
        ms = r["ms_per_step"]
        cols = [f"{ms / floor:.2f}" if floor else "-", f"{kvs / ms:.2f}" if kvs else "-",
                f"{none / ms:.2f}" if none else "-"]
        print(f"{r['config']:<20} {ms:8.0f} {cols[0]:>8} {cols[1]:>13} {cols[2]:>13} "
              f"{r['cpu_ms_per_step']:14.0f} {r['final_loss']:11.4f}")
    hp = [r for r in rows if r["config"].startswith("hp-") and r["config"] != "hp-none"]
    if hp and kvs:
        best = min(hp, key=lambda r: r["ms_per_step"])
        print(f"\nfastest of this project: {best['config']} {best['ms_per_step']:.0f} ms/step; "
              f"MXNet dist_sync {kvs:.0f} ms/step: {kvs / best['ms_per_step']:.2f}x"
              + (f"; hp-none {none:.0f} ms/step: {none / best['ms_per_step']:.2f}x"
                 if none else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    ap.add_argument("--nprocs", type=int, default=4, help="workers")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="images per worker per step")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per configuration, in rounds over all; the median is reported")
    ap.add_argument("--netem", nargs="?", const="1gbit", default=None,
                    help="run in namespaces over emulated links (default 1gbit; root)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.worker:
        worker(json.loads(ns.worker))
        return 0
    configs = ns.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    link = f"namespaces over {ns.netem} links" if ns.netem else "loopback"
    budget = (f"{ns.nprocs} workers on {link}, batch {ns.batch}/worker, {ns.warmup} warm-up + "
              f"{ns.steps} timed steps (median), {ns.repeats} run(s) per configuration "
              f"(median run)")
    print(f"bench/train_mxnet.py: {budget}", flush=True)
    if ns.netem:
        from hipress_like.launch import netem as nm

        nm.up(max(ns.nprocs, SERVER_HOST + 1), ns.netem)
    runs = {c: [] for c in configs}
    try:
        # rounds over every configuration: on a shared host, load that comes and goes
        # then falls on every row alike, and the median run of each row is reported
        for rep in range(ns.repeats):
            for c in configs:
                cfg = dict(config=c, steps=ns.steps, warmup=ns.warmup, batch=ns.batch,
                           lr=ns.lr, seed=ns.seed)
                t0 = time.perf_counter()
                try:
                    r = launch(cfg, ns.nprocs, bool(ns.netem), ns.timeout)
                except Exception as e:  # a failing row must not hide the others
                    print(f"  {c:<20} FAILED: {e}", flush=True)
                    continue
                runs[c].append(r)
                print(f"  {c:<20} {r['ms_per_step']:8.0f} ms/step  CPU "
                      f"{r['cpu_ms_per_step']:5.0f} ms/worker  (run {rep + 1}, "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        if ns.netem:
            nm.down()
    rows = []
    for rs in runs.values():
        if rs:
            med = sorted(rs, key=lambda r: r["ms_per_step"])[(len(rs) - 1) // 2]
            rows.append(dict(med, runs_ms_per_step=[r["ms_per_step"] for r in rs]))
    if rows:
        _report(rows, budget)
        out = ns.out or os.path.join(ROOT, "results",
                                     f"train_mxnet{'_netem' if ns.netem else ''}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"budget": budget, "link": ns.netem or "loopback", "rows": rows}, f,
                      indent=1)
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
