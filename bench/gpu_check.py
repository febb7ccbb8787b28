"""GPU check of CompLL's generated CUDA (issue 45): equal bytes, and speed against a copy.

For each shipped CompLL program (onebit, TBQ, TernGrad, DGC, GradDrop; PowerSGD's
round program is listed as compile-checked only: it has no CUDA runner and equals the
hand-written PowerSGD within a tolerance, not in bytes) and each size, on the GPU
(DGC and GradDrop's generated CUDA is compile-checked only: their DSL side runs the
interpreter on the tensors' CPU copies, labelled so in the JSON, so their rows check
bytes, not CUDA speed):

1. encode a float32 CUDA gradient with the hand-written compressor (its torch
   path, eager: ``HIPRESS_NO_COMPILE=1`` so no Triton build eats the budget)
   and with the program's generated CUDA (cupy.RawModule);
2. check the payloads are equal byte for byte and that each side decodes the
   other's payload to the same floats;
3. time encode and decode of both (CUDA events, median of repeats) next to a
   device memory copy of the gradient (``dst.copy_(src)``), interleaved.

Prints a table, writes JSON to ``$OUT/gpu_check.json`` (else
``results/gpu_check.json``) and exits 1 on any mismatch or error: it fails
loudly. Needs torch with CUDA, cupy and lark; runs from the repository root
with ``PYTHONPATH=.`` and needs no C compiler.

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
os.environ.setdefault("HIPRESS_NO_NATIVE", "1")

import torch  # noqa: E402

CASES = [("onebit", {}), ("tbq", {"threshold": 0.5}), ("terngrad", {"bitwidth": 2}),
         ("terngrad", {"bitwidth": 4}), ("dgc", {}), ("graddrop", {}), ("powersgd", {})]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,16", help="millions of float32 elements")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing was run", file=sys.stderr)
        return 2
    import hipress_like as hp
    from hipress_like.compressors.compll import PROGRAMS, program_path
    dev = torch.device("cuda")
    rows, failures = [], []
    t_start = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    hdr = (f"{'algorithm':22s} {'MB':>5s} {'bytes':>6s} {'copy ms':>8s} {'enc hand':>9s} "
           f"{'enc dsl':>8s} {'dec hand':>9s} {'dec dsl':>8s}  (x copy: enc hand/dsl, dec "
           "hand/dsl)")
    print(hdr)
    for name, params in CASES:
        if name not in PROGRAMS or not program_path(name).exists():
            rows.append({"algorithm": name, "status": "no CompLL program"})
            print(f"{name:22s} no CompLL program shipped: not run")
            continue
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        from hipress_like.compressors.compll import load
        if load(program_path(name)).rounds:  # PowerSGD: rounds, no cupy runner, no bytes
            rows.append({"algorithm": label, "status": "round program: CUDA compile-checked "
                         "only (nvcc -ptx in the tests); no runner, equal within a tolerance"})
            print(f"{label:22s} round program: CUDA compile-checked only, not run")
            continue
        try:
            key = f"{name}_dsl_gpu"
            cls = hp.compressors.register_dsl(program_path(name), name=key, replace=True)
            t0 = time.perf_counter()
            h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
            from hipress_like.compressors.compll.checker import is_sparse
            sparse = is_sparse(cls.checked)  # DGC, GradDrop: CUDA compile-checked, no runner
            if not sparse and d._cuda() is None:
                raise RuntimeError("the generated CUDA did not load (see the log)")
            build_s = time.perf_counter() - t0
            for mil in (float(s) for s in args.sizes.split(",")):
                n = int(mil * (1 << 20))
                g = torch.randn(n, device=dev) * 0.1
                dst = torch.empty_like(g)
                out = torch.empty_like(g)
                sh, sd = h.init(g, seed=3), d.init(g, seed=3)
                ph, _ = h.encode(g, sh)
                pd, _ = d.encode(g, sd)
                torch.cuda.synchronize()
                same = bool(torch.equal(ph, pd))
                nbad = -1 if ph.shape != pd.shape else int((ph != pd).sum())
                x_hd = h.decode(pd)
                x_dh = d.decode(ph)
                cross = bool(torch.equal(x_hd, x_dh))
                copy = _time(lambda: dst.copy_(g), args.repeats)  # noqa: B023
                eh = _time(lambda: h.encode(g, sh), args.repeats)  # noqa: B023
                ed = _time(lambda: d.encode(g, sd), args.repeats)  # noqa: B023
                dh = _time(lambda: h.decode(ph, out=out), args.repeats)  # noqa: B023
                dd = _time(lambda: d.decode(pd, out=out), args.repeats)  # noqa: B023
                row = {"algorithm": label, "numel": n, "equal_bytes": same,
                       "differing_bytes": nbad, "cross_decode_equal": cross,
                       "copy_ms": copy, "encode_hand_ms": eh, "encode_dsl_ms": ed,
                       "decode_hand_ms": dh, "decode_dsl_ms": dd, "load_s": build_s,
                       "dsl_cls": cls.__name__,
                       "dsl_backend": "interpreter (no CUDA runner for state-array programs)"
                       if sparse else "generated CUDA"}
                rows.append(row)
                ok = "ok" if same and cross else "MISMATCH"
                print(f"{label:22s} {n * 4 / 2**20:5.0f} {ok:>6s} {copy:8.3f} {eh:9.3f} "
                      f"{ed:8.3f} {dh:9.3f} {dd:8.3f}  ({copy / eh:.2f}/{copy / ed:.2f}, "
                      f"{copy / dh:.2f}/{copy / dd:.2f})")
                if not (same and cross):
                    failures.append(f"{label} n={n}: equal bytes {same} ({nbad} differ), "
                                    f"cross-decode equal {cross}")
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
    print("all generated CUDA payloads equal the hand-written torch path's bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
