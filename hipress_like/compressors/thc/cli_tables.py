"""``python -m hipress_like.compressors.thc.cli_tables``: solve, check and list THC's tables.

The command line of ``tables.py`` (the solver and loader stay there):

    solve --bits B --granularity G --p P -o FILE   solve T_{b,g,p} exactly, write JSON
    check FILE...                                  validate files, re-solve for optimality
    list                                           the shipped tables
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from typing import Iterable, Optional

# absolute: the old path hipress_like.compressors.thc_tables_cli runs this file too
from hipress_like.compressors.thc.tables import TableError, dump, load, shipped_tables, solve

__all__ = ["main"]


def _parse_p(s: str) -> float:
    try:
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError) as e:
        raise argparse.ArgumentTypeError(f"p must be a number such as 0.03125 or 1/32, "
                                         f"found {s!r}") from e


def main(argv: Optional[Iterable[str]] = None) -> int:
    """``solve`` a table into a file, ``check`` files, or ``list`` the shipped ones."""
    ap = argparse.ArgumentParser(prog="python -m hipress_like.compressors.thc.cli_tables",
                                 description="Solve, check and list THC's lookup tables.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("solve", help="solve T_{b,g,p} exactly and write it as JSON")
    s.add_argument("--bits", type=int, required=True)
    s.add_argument("--granularity", type=int, required=True)
    s.add_argument("--p", type=_parse_p, required=True, help="e.g. 1/32 or 0.03125")
    s.add_argument("--source", default="", help="where this (b, g, p) choice comes from")
    s.add_argument("-o", "--output", required=True)
    c = sub.add_parser("check", help="validate table files and re-solve each for optimality")
    c.add_argument("files", nargs="+")
    sub.add_parser("list", help="list the shipped tables")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.cmd == "solve":
            t = solve(args.bits, args.granularity, args.p, args.source)
            dump(t, args.output)
            print(f"{args.output}: b={t.bits} g={t.granularity} p={t.p!r} "
                  f"values={list(t.values)} objective={t.objective:.6g}")
        elif args.cmd == "check":
            for f in args.files:
                t = load(f)
                best = solve(t.bits, t.granularity, t.p)
                if t.objective > best.objective * (1 + 1e-9) + 1e-15:
                    raise TableError(f"{f}: objective {t.objective!r} is not optimal "
                                     f"({best.objective!r} with {list(best.values)})")
                print(f"{f}: ok (b={t.bits} g={t.granularity} p={t.p!r}, optimal "
                      f"objective {t.objective:.6g})")
        else:
            for (b, g, q), t in sorted(shipped_tables().items()):
                print(f"b={b} g={g} p={q!r} objective={t.objective:.6g} values="
                      f"{list(t.values)}  [{t.source}]")
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
