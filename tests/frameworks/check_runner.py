"""The loop of the horovodrun check jobs: run each check, print ``CHECK name ok|FAIL``,
keep going (the next check is collective too), meet at a barrier between checks."""
import traceback


def run_checks(hvd, checks):
    """``hvd.init()``, every check in ``checks`` with its verdict printed, ``hvd.shutdown()``."""
    hvd.init()
    for fn in checks:
        try:
            fn()
            print(f"CHECK {fn.__name__} ok", flush=True)
        except Exception as e:  # report and go on: the next check is collective too
            why = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            print(f"CHECK {fn.__name__} FAIL {why}", flush=True)
            traceback.print_exc()
        hvd.barrier()
    hvd.shutdown()
