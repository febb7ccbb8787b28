"""GPU check of CompLL's generated CUDA (issue 45): equal bytes, and speed against a copy.

For each of the six shipped CompLL programs and each size, on the GPU:

* **Single-pass programs** (onebit, TBQ, TernGrad, and the state-array programs
  DGC and GradDrop): encode a float32 CUDA gradient with the hand-written
  compressor (its torch path, eager: ``HIPRESS_NO_COMPILE=1`` so no Triton
  build eats the budget) and with the program's generated CUDA (cupy:
  ``render_cuda.CudaProgram`` for the fused sweeps, ``cuda_runners.SeqCudaProgram``
  for DGC and GradDrop); check the payloads are equal byte for byte over two
  steps (DGC's and GradDrop's state arrays too), that each side decodes the
  other's payload to the same floats, and that a NaN gradient is refused with the
  state untouched; time encode and decode of both (CUDA events, median of repeats)
  next to a device memory copy of the gradient (``dst.copy_(src)``), interleaved.
* **PowerSGD's round program** (``cuda_runners.RoundsCudaProgram``): two ranks'
  rounds and decode by hand for two steps, run three ways: the generated CUDA on
  the GPU, the generated C on CPU copies, the hand-written PowerSGD on the GPU
  (its lane-order kernels, ``powersgd/cuda.py``, through cupy). The CUDA must give
  the C's bits, and the hand-written PowerSGD the same bits (payloads, decoded
  averages, states: every sum in the lane order of ``compll/matrices.py``). Times
  round 0's encode of both on the GPU next to the copy.

Prints a table, writes JSON to ``$OUT/gpu_check.json`` (else
``results/gpu_check.json``) and exits 1 on any mismatch or error: it fails
loudly. Needs torch with CUDA, cupy, lark and a C compiler (PowerSGD's C);
runs from the repository root with ``PYTHONPATH=.``.

    PYTHONPATH=. python bench/gpu_check.py                 # 1M and 16M elements
    PYTHONPATH=. python bench/gpu_check.py --sizes 1 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HIPRESS_NO_COMPILE", "1")

import torch  # noqa: E402

CASES = [("onebit", {}), ("tbq", {"threshold": 0.5}), ("terngrad", {"bitwidth": 2}),
         ("terngrad", {"bitwidth": 4}), ("dgc", {}), ("graddrop", {}), ("powersgd", {}),
         ("powersgd", {"rank": 4})]


def _time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events)."""
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _states_equal(a, b) -> bool:
    """Equal tensors under every key the two states share."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return True  # stateless on both sides (onebit, TBQ)
    return all(torch.equal(a[k], b[k]) for k in a
               if isinstance(a[k], torch.Tensor) and isinstance(b.get(k), torch.Tensor))


def _nan_refused(comp, g, state) -> bool:
    """encode of a gradient holding a NaN raises ValueError and leaves ``state`` as it was."""
    items = state.items() if isinstance(state, dict) else []
    before = {k: v.clone() for k, v in items if isinstance(v, torch.Tensor)}
    bad = g.clone()
    bad[bad.numel() // 2] = float("nan")
    try:
        comp.encode(bad, state)
    except ValueError:
        return all(torch.equal(before[k], state[k]) for k in before)
    return False


def single_pass(hp, name, params, label, sizes, repeats, dev, rows, failures):
    """Hand-written torch path against the generated CUDA for one program (docstring)."""
    from hipress_like.compressors.compll import program_path
    key = f"{name}_dsl_gpu"
    cls = hp.compressors.register_dsl(program_path(name), name=key, replace=True)
    t0 = time.perf_counter()
    h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
    if d._cuda() is None:
        raise RuntimeError("the generated CUDA did not load (see the log)")
    load_s = time.perf_counter() - t0
    runner = type(d._cuda()).__name__
    for n in [7, 999_999] + [int(m * (1 << 20)) for m in sizes]:
        timed = n >= 1 << 20
        gen = torch.Generator(device=dev).manual_seed(n)
        sh, sd = h.init(torch.zeros(n, device=dev), seed=3), \
            d.init(torch.zeros(n, device=dev), seed=3)
        same = cross = states = True
        nbad = 0
        for _step in range(2):
            g = torch.randn(n, device=dev, generator=gen) * 0.1
            ph, sh = h.encode(g, sh)
            pd, sd = d.encode(g, sd)
            torch.cuda.synchronize()
            same &= bool(torch.equal(ph, pd))
            nbad = max(nbad, -1 if ph.shape != pd.shape else int((ph != pd).sum()))
            cross &= bool(torch.equal(h.decode(pd), d.decode(ph)))
            states &= _states_equal(sh, sd)
        nan_ok = _nan_refused(d, g, sd)
        row = {"algorithm": label, "numel": n, "equal_bytes": same, "differing_bytes": nbad,
               "cross_decode_equal": cross, "states_equal": states, "nan_refused": nan_ok,
               "load_s": load_s, "dsl_cls": cls.__name__, "dsl_backend": runner}
        ok = same and cross and states and nan_ok
        if timed:
            dst, out = torch.empty_like(g), torch.empty_like(g)
            row["copy_ms"] = _time(lambda: dst.copy_(g), repeats)  # noqa: B023
            row["encode_hand_ms"] = _time(lambda: h.encode(g, sh), repeats)  # noqa: B023
            row["encode_dsl_ms"] = _time(lambda: d.encode(g, sd), repeats)  # noqa: B023
            row["decode_hand_ms"] = _time(lambda: h.decode(ph, out=out), repeats)  # noqa: B023
            row["decode_dsl_ms"] = _time(lambda: d.decode(pd, out=out), repeats)  # noqa: B023
            c = row["copy_ms"]
            print(f"{label:22s} {n * 4 / 2**20:5.0f} {'ok' if ok else 'BAD':>6s} {c:8.3f} "
                  f"{row['encode_hand_ms']:9.3f} {row['encode_dsl_ms']:8.3f} "
                  f"{row['decode_hand_ms']:9.3f} {row['decode_dsl_ms']:8.3f}  "
                  f"({c / row['encode_hand_ms']:.2f}/{c / row['encode_dsl_ms']:.2f}, "
                  f"{c / row['decode_hand_ms']:.2f}/{c / row['decode_dsl_ms']:.2f})")
        else:
            print(f"{label:22s} n={n:<9d} {'ok' if ok else 'BAD':>6s} (correctness only)")
        rows.append(row)
        if not ok:
            failures.append(f"{label} n={n}: equal bytes {same} ({nbad} differ), cross-decode "
                            f"{cross}, states {states}, NaN refused {nan_ok}")


def _steps(c, grads, shape, dev):
    """Two ranks' rounds by hand (the engine's role) for len(grads[0]) steps: per step a
    dict of CPU tensors: ``payloads`` (bytes), ``bodies`` (their float32 bodies),
    ``res`` (decoded averages), ``error`` (error feedback) and ``q`` per rank."""
    from hipress_like.compressors.payload import unpack_payload
    n = len(grads)
    states = [c.init(torch.zeros(shape, device=dev), world_size=n, shared_seed=7)
              for _ in range(n)]
    out = []
    for s in range(len(grads[0])):
        g = [grads[i][s].to(dev) for i in range(n)]
        pays = []
        agg = None
        for r in range(2):
            ps = []
            for i in range(n):
                p, states[i] = c.encode_round(r, g[i], states[i], agg)
                ps.append(p)
            agg = c.merge(ps)
            pays += ps
        res = []
        for i in range(n):
            x, states[i] = c.decode_rounds(g[i], states[i], agg, average=True)
            res.append(x)
        cpu = [p.cpu() for p in pays]
        out.append({
            "payloads": cpu,
            "bodies": [unpack_payload(p).body.view(torch.float32) for p in cpu],
            "res": [x.cpu() for x in res],
            "error": [(c.error(st) if hasattr(c, "error") else st["error"]).cpu().clone()
                      for st in states],
            "q": [st["q"].cpu().clone() for st in states]})
    return out


def _rel(x, y) -> float:
    if x.shape != y.shape:
        return float("inf")
    if not x.numel():
        return 0.0
    return float((x - y).abs().max() / x.abs().max().clamp_min(1e-30))


def rounds(hp, name, params, label, sizes, repeats, dev, rows, failures):
    """PowerSGD's round program: CUDA against its C and against the hand-written PowerSGD
    on the GPU, bit for bit; round 0's encode timed (docstring)."""
    from hipress_like.compressors.compll import program_path
    from hipress_like.compressors.powersgd import cuda as psgd_cuda
    if not psgd_cuda.available():
        raise RuntimeError("the hand-written PowerSGD's GPU kernels did not load (cupy?)")
    key, ckey = f"{name}_dsl_gpu", f"{name}_dsl_gpu_c"
    cls = hp.compressors.register_dsl(program_path(name), name=key, replace=True)
    ccls = hp.compressors.register_dsl(program_path(name), name=ckey, replace=True)
    ccls.cuda = False  # the generated C, on CPU copies
    t0 = time.perf_counter()
    d, dc, h = (hp.compressors.get(k, **params) for k in (key, ckey, name))
    if d._cuda() is None:
        raise RuntimeError("the generated CUDA did not load (see the log)")
    load_s = time.perf_counter() - t0
    shapes = [(37,), (16, 24), (4, 3, 5, 2)] + [(int(m * 1024), 1024) for m in sizes]
    for shape in shapes:
        n = 1
        for k in shape:
            n *= k
        gen = torch.Generator().manual_seed(n)
        grads = [[torch.randn(shape, generator=gen) for _ in range(2)] for _ in range(2)]
        a, b, c = (_steps(x, grads, shape, dv) for x, dv in
                   ((d, dev), (dc, torch.device("cpu")), (h, dev)))
        bits = all(torch.equal(x, y) for sa, sb in zip(a, b) for k in sa
                   for x, y in zip(sa[k], sb[k]))
        hand_bits = all(torch.equal(x, y) for sa, sc in zip(a, c) for k in sa
                        for x, y in zip(sa[k], sc[k]))
        worst = 0.0
        headers = True
        for step, (sa, sc) in enumerate(zip(a, c)):
            for x, y, bx in zip(sa["payloads"], sc["payloads"], sa["bodies"]):
                nb = bx.numel() * 4
                headers &= x.numel() == y.numel() and torch.equal(x[:-nb or None],
                                                                   y[:-nb or None])
            for k in ("bodies", "res", "q"):
                worst = max([worst] + [_rel(y, x) for x, y in zip(sa[k], sc[k])])
            scale = max(float(grads[0][step].abs().max()),
                        max(float(e.abs().max()) for e in sc["error"]))
            worst = max([worst] + [float((x - y).abs().max()) / scale
                                   for x, y in zip(sa["error"], sc["error"])])
        row = {"algorithm": label, "shape": list(shape), "numel": n, "cuda_equals_c_bits": bits,
               "cuda_equals_hand_bits": hand_bits,
               "headers_equal_hand": headers, "max_rel_vs_hand": worst,
               "load_s": load_s, "dsl_cls": cls.__name__,
               "dsl_backend": type(d._cuda()).__name__,
               "cpu_backend": "generated C" if dc._native() else "interpreter"}
        ok = bits and hand_bits and headers
        if n >= 1 << 20:
            g = grads[0][0].to(dev)
            st_d = d.init(g, world_size=2, shared_seed=7)
            st_h = h.init(g, world_size=2, shared_seed=7)
            dst = torch.empty_like(g)
            row["copy_ms"] = _time(lambda: dst.copy_(g), repeats)  # noqa: B023
            row["round0_hand_ms"] = _time(
                lambda: h.encode_round(0, g, st_h, None), repeats)  # noqa: B023
            row["round0_dsl_ms"] = _time(
                lambda: d.encode_round(0, g, st_d, None), repeats)  # noqa: B023
            print(f"{label:22s} {n * 4 / 2**20:5.0f} {'ok' if ok else 'BAD':>6s} "
                  f"{row['copy_ms']:8.3f} {row['round0_hand_ms']:9.3f} "
                  f"{row['round0_dsl_ms']:8.3f}   (round 0; CUDA = C bits {bits}, "
                  f"= hand-written bits {hand_bits})")
        else:
            print(f"{label:22s} {str(shape):>10s} {'ok' if ok else 'BAD':>6s} (correctness "
                  f"only; CUDA = C bits {bits}, = hand-written bits {hand_bits}, rel "
                  f"{worst:.1e})")
        rows.append(row)
        if not ok:
            failures.append(f"{label} shape {shape}: CUDA = C bits {bits}, = hand-written "
                            f"bits {hand_bits}, headers equal {headers}, max rel vs "
                            f"hand-written {worst:.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,16", help="millions of float32 elements")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--only", default="", help="comma-separated algorithm names")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing was run", file=sys.stderr)
        return 2
    import hipress_like as hp
    from hipress_like.compressors.compll import PROGRAMS, load, program_path
    dev = torch.device("cuda")
    sizes = [float(s) for s in args.sizes.split(",")]
    rows, failures = [], []
    t_start = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"{'algorithm':22s} {'MB':>5s} {'bytes':>6s} {'copy ms':>8s} {'enc hand':>9s} "
          f"{'enc dsl':>8s} {'dec hand':>9s} {'dec dsl':>8s}  (x copy: enc hand/dsl, dec "
          "hand/dsl)")
    only = set(filter(None, args.only.split(",")))
    for name, params in CASES:
        if only and name not in only:
            continue
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        if name not in PROGRAMS or not program_path(name).exists():
            rows.append({"algorithm": label, "status": "no CompLL program"})
            print(f"{label:22s} no CompLL program shipped: not run")
            continue
        try:
            run = rounds if load(program_path(name)).rounds else single_pass
            run(hp, name, params, label, sizes, args.repeats, dev, rows, failures)
        except Exception as e:  # report and go on: one broken program must not hide others
            traceback.print_exc()
            rows.append({"algorithm": label, "status": f"error: {type(e).__name__}: {e}"})
            failures.append(f"{label}: {type(e).__name__}: {e}")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "rows": rows, "failures": failures, "seconds": time.perf_counter() - t_start}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out_dir / 'gpu_check.json'}; {time.perf_counter() - t_start:.1f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("all six programs' generated CUDA ran: equal bytes to the hand-written "
          "compressors (and PowerSGD's to its C)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
