"""The training job the fault suite injects into: digits, a small MLP, ``DistributedOptimizer``.

Run as torchrun runs a script (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; ``harness.run_trial`` sets them). It reads its fault from
the environment (set on the faulty rank only):

- ``FAULT_ACTION`` (``kill``, ``stop``, ``raise``, ``slow``) at ``FAULT_STEP`` in
  ``FAULT_PHASE`` (``forward``, ``backward``, ``encode``, ``save``, ``switch``:
  entering ``Engine.set_plan``, with ``JOB_PLAN=adaptive``); faults
  inside the bulk exchange come from the transport wrapper instead
  (``HIPRESS_FAULT``, ``casync/transport/faulty.py``); ``slow`` (a rank run
  inside a network namespace by the harness, as root) shapes its own link
  out to ``SLOW_RATE`` with ``tc`` and trains on;
- ``FAULT_MISMATCH`` (``model``, ``compressor``, ``strategy``, ``plan``): this
  rank joins with another setup (``world_size`` is set by the harness in
  ``WORLD_SIZE`` itself).

``JOB_DEVICE`` (default ``cpu``; ``cuda`` trains on the GPU, every rank on the
current device, as ``bench/gpu_faults.sh`` runs the suite's GPU rows) and
``JOB_STRATEGY`` (``ps`` or ``ring``, default ``ps``) are read by every rank.

``JOB_PLAN=adaptive`` (every rank) trains with ``plan=hpt.Adaptive`` on a
profile made here and an injected link estimate that drops from 100 Gbit/s
to 10 Mbit/s after step 3, so every rank switches the plan at the check
after step 5 (``SWITCH_STEP``; step 3 saved a checkpoint before it).

Every rank saves its checkpoint every ``SAVE_EVERY`` steps the way the
reliability guide recommends (write a temporary file, fsync, ``os.replace``),
so a rank killed while saving leaves the previous checkpoint whole. Before a
fault the faulty rank appends its time to ``HIPRESS_FAULT_MARK``; a rank that
catches an error prints one ``RESULT`` JSON line (time, type, message, the
ranks the error names) and exits non-zero; a rank that finishes prints
``RESULT`` with ``ok``.
"""
import io
import json
import os
import signal
import sys
import time

if os.environ.get("JOB_EXIT_TRACE"):  # each exit handler's time, to see where an exit goes
    import atexit

    _register = atexit.register

    def _timed(f, *a, **k):
        def run(*aa, **kk):
            t0 = time.time()
            try:
                return f(*aa, **kk)
            finally:
                print(f"EXIT {getattr(f, '__module__', '')}.{getattr(f, '__qualname__', f)} "
                      f"{time.time() - t0:.3f}s ends {time.time():.3f}", file=sys.stderr,
                      flush=True)
        return _register(run, *a, **k)

    atexit.register = _timed

import torch  # noqa: E402

import hipress_like.torch as hpt  # noqa: E402


def _env(name, default=None):
    return os.environ.get(name, default)


ACTION, PHASE = _env("FAULT_ACTION"), _env("FAULT_PHASE")
FAULT_STEP = int(_env("FAULT_STEP", "-1"))
MISMATCH = _env("FAULT_MISMATCH")
STEPS = int(_env("JOB_STEPS", "30"))
SAVE_EVERY = int(_env("JOB_SAVE_EVERY", "4"))
CKPT_DIR = _env("JOB_CKPT_DIR", ".")
MARK = _env("HIPRESS_FAULT_MARK")
# ``slow``: this rank's link out, a token bucket this slow and this small, so every
# exchange from the fault on outlasts the job's timeout
SLOW_RATE, SLOW_BURST = "1kbit", "1600"
JOB_PLAN = _env("JOB_PLAN")
DEVICE = torch.device(_env("JOB_DEVICE", "cpu"))
STRATEGY = _env("JOB_STRATEGY", "ps")
SWITCH_STEP = 5  # JOB_PLAN=adaptive: the loop step whose opt.step() switches the plan


def fault(where):
    """Inject this rank's process fault (kill / stop / raise / slow) now."""
    if MARK:
        with open(MARK, "a") as f:
            f.write(json.dumps({"t": time.time(), "rank": int(os.environ["RANK"]),
                                "fault": f"{ACTION} in {where}"}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if ACTION == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if ACTION == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if ACTION == "slow":  # the rank's own namespace: its eth0 is its link out
        import subprocess

        subprocess.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                        SLOW_RATE, "burst", SLOW_BURST, "limit", "10000000"], check=True)
        return
    raise RuntimeError(f"injected exception on rank {os.environ['RANK']} in {where}")


class _Step:
    n = 0


def armed(phase):
    return ACTION is not None and PHASE == phase and _Step.n == FAULT_STEP


def save_checkpoint(path, state):
    """Atomic save: a reader sees the old file or the new one, never half of one."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        if armed("save"):
            fault("checkpoint save")
        f.write(data[len(data) // 2:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def adaptive_plan():
    """``hpt.Adaptive`` that switches at the check after loop step ``SWITCH_STEP``:
    a profile with 1-bit's curves on a fast link (the first plan sends every
    gradient uncompressed), then an estimate of a slow link (checks every 2 steps;
    the first, after step 1, is the reference; the one after step 3 still sees the
    fast link)."""
    from hipress_like.cost_model import CompressorProfile, Curve, Link, Profile

    fast, slow = Link(2e-6, 12.5e9), Link(1e-3, 1.25e6)
    pts = [float(4 << e) for e in range(8, 26, 2)]
    cp = CompressorProfile(name="onebit", category="quantization", ratio=1 / 32,
                           header_bytes=8, encode=Curve.linear(2e-5, 1e-9, pts),
                           decode=Curve.linear(1e-5, 5e-10, pts))
    profile = Profile(link=fast, compressors={"onebit": cp}, meta={"ranks": 2})
    return hpt.Adaptive(check_every=2, margin=0.1, profile=profile,
                        estimate=lambda step, rank: slow if step >= SWITCH_STEP - 1 else fast)


def main():
    from hipress_like.demo import load_digits_split

    hpt.init(timeout=float(_env("JOB_TIMEOUT", "10")))
    rank, size = hpt.rank(), hpt.size()
    compressor = "topk" if MISMATCH == "compressor" else _env("JOB_COMPRESSOR", "onebit")
    strategy = {"ps": "ring", "ring": "ps"}[STRATEGY] if MISMATCH == "strategy" else STRATEGY
    hidden = 48 if MISMATCH == "model" else 32
    # Compress every gradient (the default rule leaves those under 1 MB to the
    # uncompressed lane, and this model's are all smaller), so encode, decode and
    # the bulk exchange run; the odd plan cuts gradients into 1 KB partitions.
    from hipress_like.cost_model.plan import Plan, SizeRule
    rule = (SizeRule(min_compress_bytes=1, bytes_per_partition=1024) if MISMATCH == "plan"
            else SizeRule(min_compress_bytes=1))
    plan = Plan(compressor=compressor, rule=rule)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10)).to(DEVICE)
    if PHASE == "forward":
        model.register_forward_pre_hook(lambda m, a: fault("forward") if armed("forward") else None)
    if PHASE == "backward":
        model[1].weight.register_hook(lambda g: fault("backward") if armed("backward") else None)
    if PHASE == "encode" and ACTION:
        # the engine's one encode site (every wrapper of the compressor runs below it),
        # called on its compute thread
        from hipress_like.casync.workflows import CompressorCodec
        encode = CompressorCodec.encode

        def faulty_encode(self, *a, **k):
            if armed("encode"):
                fault("encode")
            return encode(self, *a, **k)

        CompressorCodec.encode = faulty_encode
    if PHASE == "switch" and ACTION:
        # the engine's one switch site, entered on every rank at the same step boundary
        from hipress_like.casync.engine import Engine
        set_plan = Engine.set_plan

        def faulty_set_plan(self, *a, **k):
            if armed("switch"):
                fault("plan switch")
            return set_plan(self, *a, **k)

        Engine.set_plan = faulty_set_plan
    if JOB_PLAN == "adaptive":
        plan = adaptive_plan()
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compressor, strategy=strategy, plan=plan)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y, _, _ = load_digits_split()
    x, y = x[rank::size].to(DEVICE), y[rank::size].to(DEVICE)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        _Step.n = step
        idx = torch.randint(0, len(x), (32,), generator=gen).to(DEVICE)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if (step + 1) % SAVE_EVERY == 0 or armed("save"):
            save_checkpoint(os.path.join(CKPT_DIR, f"ckpt-r{rank}.pt"),
                            {"step": step, "model": model.state_dict(),
                             "optimizer": opt.state_dict()})
    return float(loss)


if __name__ == "__main__":
    try:
        loss = main()
    except BaseException as e:
        ranks = [int(r) for r in getattr(e, "ranks", None) or ()]
        print("RESULT " + json.dumps({"t": time.time(), "ok": False, "type": type(e).__name__,
                                      "ranks": ranks, "msg": str(e)[:4000]}), flush=True)
        raise
    print("RESULT " + json.dumps({"t": time.time(), "ok": True, "loss": loss}), flush=True)
    hpt.shutdown()
    sys.exit(0)
