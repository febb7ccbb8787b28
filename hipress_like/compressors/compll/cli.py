"""``hipress-profile compll check|build|show FILE``: CompLL programs from the command line.

- ``check FILE``: parse and type-check; print the located error (caret and all)
  or a one-line summary (params, functions, wire id, capabilities).
- ``build FILE``: generate the C, build it (or take it from the cache), then a
  one-line speed check: encode and decode of a float32 gradient against a
  memory copy of it (``--mb``, default 16). For a round program (PowerSGD)
  "encode" is all its rounds on one rank (each merged alone, world size 1)
  and "decode" its decode, on the gradient's near-square matrix view.
- ``show FILE``: print the generated C (``--target c``, default) or CUDA.

Exit codes: 0 ok, 1 the program has errors, 2 bad command line.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["main"]


def _median(fn, repeats: int) -> float:
    ts: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _rounds_pair(c, g, out):
    """(encode, decode) callables of a round program on one rank: every round (its own
    payload merged alone) from one state, and the decode of the last round's payload.
    ``encode()`` returns the payloads; their total size is what a rank sends."""
    import torch
    st0 = c.init(g, seed=0, world_size=1)
    last = {}

    def encode():
        st, agg, payloads = st0, None, []
        for r in range(len(c.checked.rounds)):
            p, st = c.encode_round(r, g, st, agg)
            agg = c.merge([p])
            payloads.append(p)
        last.update(st=st, agg=agg)
        return [torch.cat(payloads)]

    def decode():
        return c.decode_rounds(g, last["st"], last["agg"], out=out, average=True)
    return encode, decode


def main(argv: Optional[Sequence[str]] = None, prog: str = "hipress-profile compll") -> int:
    """Run the compll subcommand; returns the exit code."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("check", "build", "show"))
    ap.add_argument("file", help="a .compll program")
    ap.add_argument("--target", choices=("c", "cuda"), default="c", help="show: which code")
    ap.add_argument("--mb", type=float, default=16.0, help="build: gradient size for the "
                    "speed check (MB of float32)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(list(argv) if argv is not None else None)
    import torch

    from . import CompllError, load
    from .compressor import DslCompressor, compile_program, register_dsl
    try:
        checked = load(a.file)
        if a.action == "check":
            wire = checked.metas.get("wire", {}).get("0", "(a free id)")
            params = ", ".join(f"{n}: {t} = {d}" for n, t, d, _ in checked.params) or "none"
            funcs = ", ".join(sorted(checked.funcs))
            rounds = f"; rounds {len(checked.rounds)} (summed)" if checked.rounds else ""
            print(f"{a.file}: ok; params {params}; functions {funcs}; wire id {wire}; "
                  f"decode {'yes' if checked.decode else 'no'}{rounds}")
            return 0
        if a.action == "show":
            if a.target == "c":
                from .render_c import render_c
                print(render_c(checked))
            else:
                from .render_cuda import render_cuda
                r = render_cuda(checked)
                print(r["source"])
                print(f"// encode kernels: {' '.join(r['encode'])}")
                print(f"// decode kernels: {' '.join(r['decode'])}")
            return 0
        t0 = time.perf_counter()
        nat = compile_program(checked)
        if nat is None:
            print(f"{a.file}: no C backend (see the warning above)", file=sys.stderr)
            return 1
        print(f"{a.file}: C {'from the cache' if nat.cache_hit else 'built'} in "
              f"{time.perf_counter() - t0:.2f} s (compile {nat.compile_s:.2f} s)")
        cls = register_dsl(a.file, name="compll_cli_" + str(abs(hash(a.file)) % 10**8),
                           replace=True)
        cls.native = nat
        c: DslCompressor = cls()
        n = int(a.mb * 2**20) // 4
        g = torch.randn(n)
        src, dst, out = torch.randn(n), torch.empty(n), torch.empty(n)
        if checked.rounds:
            encode, decode = _rounds_pair(c, g, out)
            p = encode()[0]
        else:
            st = c.init(g, seed=0)
            p, _ = c.encode(g, st)
            encode = lambda: c.encode(g, st)  # noqa: E731
            decode = lambda: c.decode(p, out=out)  # noqa: E731
        enc = _median(encode, a.repeats)
        dec = _median(decode, a.repeats) if checked.decode else None
        cp = _median(lambda: dst.copy_(src), a.repeats)
        line = (f"speed @{a.mb:g}MB: copy {cp * 1e3:.2f} ms; encode {enc * 1e3:.2f} ms "
                f"({cp / enc:.2f}x copy)")
        if dec is not None:
            line += f"; decode {dec * 1e3:.2f} ms ({cp / dec:.2f}x copy)"
        print(line + f"; payload {p.numel() / (4 * n):.4f} of the gradient")
        return 0
    except CompllError as e:
        print(str(e), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
