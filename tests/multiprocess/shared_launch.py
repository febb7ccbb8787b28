"""One launch of real ranks serving several tests' workers, one after another.

Starting ranks (fresh interpreters importing torch, a gloo rendezvous) costs more than
most checks they run, so tests of the same part at the same world size share a launch:
``run_shared(n, calls)`` runs each ``fn(ctx, *args)`` of ``calls`` in turn on the same n
ranks (each worker builds and closes its own engine) and keeps what every call returned
on every rank, or the traceback of what it raised there. A test reads its own call with
``ranks(entry)``: a call that raised fails that test, with every rank's traceback, and
not the tests whose calls returned.

Example (in a test module; the workers are module-level functions):

    @functools.lru_cache(maxsize=None)
    def _on_three():
        return run_shared(3, [(_sync, ("identity", "ring")), (_big, ("ps",))])

    def test_big():
        assert ranks(_on_three()[1]) == [True] * 3
"""
import importlib
import traceback

from hipress_like.launch.launch import run_workers

__all__ = ["run_shared", "ranks"]


def _serve(ctx, calls):
    """Each (module, name, args) of ``calls`` in turn: ("returned", value) or ("raised", tb)."""
    out = []
    for module, name, args in calls:
        fn = getattr(importlib.import_module(module), name)
        try:
            out.append(("returned", fn(ctx, *args)))
        except Exception:
            out.append(("raised", traceback.format_exc()))
    return out


def run_shared(nprocs, calls, timeout=600):
    """Run ``calls`` ([(fn, args), ...], module-level functions) in one launch of ``nprocs``.

    Returns:
        One entry per call: each rank's ("returned", value) or ("raised", traceback).
    """
    refs = [(fn.__module__, fn.__name__, tuple(args)) for fn, args in calls]
    res = run_workers(_serve, nprocs, args=(refs,), timeout=timeout)
    return [[r[i] for r in res] for i in range(len(refs))]


def ranks(entry):
    """Each rank's return value of one call of ``run_shared``.

    Raises:
        AssertionError: the call raised on some rank; the message holds each such
            rank's traceback.
    """
    raised = {r: v for r, (how, v) in enumerate(entry) if how == "raised"}
    assert not raised, "\n".join(f"rank {r} raised:\n{tb}" for r, tb in raised.items())
    return [v for _, v in entry]
