"""bench/train.py's rows over Horovod: Horovod's own optimizer, and this project on Horovod.

Rows (all named ``hvd-...``):
  hvd-none, hvd-fp16        ``horovod.torch.DistributedOptimizer`` with
                            ``Compression.none`` / ``Compression.fp16``
                            (Horovod's tensor fusion, its gloo allreduce)
  hvd-hp-<strategy>-<comp>  ``hipress_like.torch.DistributedOptimizer`` with the
                            engine over the Horovod transport, for this
                            project's best configurations (PS + onebit,
                            Ring + PowerSGD rank 1), to set beside the same
                            ``hp-...`` rows over gloo

How the ranks meet: bench/train.py starts every rank with torchrun-style
variables (in network namespaces under ``--netem``). A Horovod row turns
them into what ``horovodrun --gloo`` gives each process: rank 0 starts
Horovod's own rendezvous server (``horovod.runner.http.http_server.
RendezvousServer``, the one horovodrun runs) with the host plan
(``localhost:N`` on loopback, one host ``h<i>`` per namespace under netem),
shares its port through a small TCPStore at ``MASTER_ADDR:MASTER_PORT``,
and every rank sets ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ...,
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT`` and drops ``RANK``/``WORLD_SIZE``,
so ``hpt.init()`` joins as it does under horovodrun and picks the Horovod
transport. Horovod's rendezvous server is used, not re-implemented.

Under ``--netem``, ``netns_hosts`` first gives each namespace an
``/etc/netns/h<i>/hosts`` that resolves this machine's hostname to the
namespace's own address (``ip netns exec`` bind-mounts it over
``/etc/hosts``): Horovod 0.28.1 builds the gloo device of every process
set (the global one too) without ``HOROVOD_GLOO_IFACE``
(``GlooContext::InitializeForProcessSet`` reads its own, empty,
``gloo_iface_``), so gloo falls back to the hostname's address, which is
127.0.0.1 in every namespace, and the ranks cannot connect.

A row name may end in ``-cycle<MS>`` (``hvd-hp-ps-powersgd1-cycle5``,
``hvd-none-cycle5``): the row then runs with ``HOROVOD_CYCLE_TIME=<MS>``, so
Horovod's cycle time (1 ms by default) is compared with the default in the
same alternated run.

``report(rows)`` prints the issue's ratios from the same run: this project
over Horovod against Horovod fp16 (goal >= 2x) and none (>= 3x), and
against the same configuration over gloo (within 10%).
"""
from __future__ import annotations

import os
import re
from datetime import timedelta

# this project's best configurations (README, "Where it stands"), over Horovod
HP_OVER_HOROVOD = ("hvd-hp-ps-onebit", "hvd-hp-ps-powersgd1", "hvd-hp-ring-powersgd1")
CONFIGS = ("hvd-none", "hvd-fp16", *HP_OVER_HOROVOD)

_keep = []  # the port-sharing store (and rank 0's server) live as long as the job


_CYCLE = re.compile(r"-cycle(\d+(?:\.\d+)?)$")


def is_horovod_row(name: str) -> bool:
    """True for the rows this module runs (``hvd-...``, with or without ``-cycle<MS>``)."""
    return name.startswith("hvd-") and split_cycle(name)[0] in CONFIGS


def split_cycle(name: str):
    """``hvd-none-cycle5`` -> (``hvd-none``, ``"5"``); without the suffix, (name, None)."""
    m = _CYCLE.search(name)
    return (name[:m.start()], m.group(1)) if m else (name, None)


def hp_name(name: str) -> str:
    """``hvd-hp-ps-onebit`` -> ``hp-ps-onebit`` (the same configuration's gloo row)."""
    name = split_cycle(name)[0]
    return name[len("hvd-"):] if name.startswith("hvd-hp-") else name


def enter_horovod_job(cycle_ms=None) -> None:
    """Turn this rank's torchrun-style environment into horovodrun's gloo-mode one.

    Collective: every rank calls it before ``hpt.init()``. Rank 0 starts
    Horovod's rendezvous server. ``cycle_ms`` sets ``HOROVOD_CYCLE_TIME``.
    """
    import torch.distributed as dist
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    env = os.environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    in_netns = env.get("GLOO_SOCKET_IFNAME", "lo") != "lo"
    hosts = (",".join(f"h{i}:1" for i in range(size)) if in_netns else f"localhost:{size}")
    plan = get_host_assignments(parse_hosts(hosts), size)
    store = dist.TCPStore(addr, port, size, rank == 0, timedelta(seconds=120))
    _keep.append(store)
    if rank == 0:
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer(verbose=0)
        rdv_port = server.start()
        server.init(plan)
        _keep.append(server)
        store.set("hvd_rendezvous_port", str(rdv_port))
    rdv_port = store.get("hvd_rendezvous_port").decode()
    slot = plan[rank]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    env.update(HOROVOD_HOSTNAME=slot.hostname, HOROVOD_RANK=str(slot.rank),
               HOROVOD_SIZE=str(slot.size), HOROVOD_LOCAL_RANK=str(slot.local_rank),
               HOROVOD_LOCAL_SIZE=str(slot.local_size), HOROVOD_CROSS_RANK=str(slot.cross_rank),
               HOROVOD_CROSS_SIZE=str(slot.cross_size), HOROVOD_GLOO_RENDEZVOUS_ADDR=addr,
               HOROVOD_GLOO_RENDEZVOUS_PORT=rdv_port, HOROVOD_CONTROLLER="gloo",
               HOROVOD_CPU_OPERATIONS="gloo",
               HOROVOD_GLOO_IFACE=env.get("GLOO_SOCKET_IFNAME", "lo"))
    if cycle_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = cycle_ms


def netns_hosts(nprocs: int, subnet: str = "10.77.0") -> None:
    """Write ``/etc/netns/h<i>/hosts`` mapping the hostname to h<i>'s address (root only).

    Namespace h<i> has address ``<subnet>.<i+1>`` (bench/netem.py).
    """
    import socket

    for i in range(nprocs):
        d = f"/etc/netns/h{i}"
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{subnet}.{i + 1} {socket.gethostname()}\n")


def horovod_optimizer(base, model, name: str):
    """Horovod's own ``DistributedOptimizer`` for ``hvd-none`` / ``hvd-fp16``."""
    import horovod.torch as hvd

    compression = {"hvd-none": hvd.Compression.none,
                   "hvd-fp16": hvd.Compression.fp16}[split_cycle(name)[0]]
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=compression)


def report(rows) -> None:
    """Print the Horovod ratios of issue 20 from rows measured in the same run."""
    by = {r["config"]: r for r in rows}
    ours = [r for r in rows if split_cycle(r["config"])[0] in HP_OVER_HOROVOD]
    if not ours:
        return
    best = min(ours, key=lambda r: r["ms_per_step"])
    ms = best["ms_per_step"]
    print(f"\nover Horovod: best of this project {best['config']} ({ms:.0f} ms/step)")
    goals = []
    for ref, target in (("hvd-fp16", 2.0), ("hvd-none", 3.0)):
        if ref in by:
            goals.append((f"{ref}/this >= {target:g}x", by[ref]["ms_per_step"] / ms, target,
                          True))
    for r in ours:
        gloo = by.get(hp_name(r["config"]))
        if gloo:
            goals.append((f"{r['config']} / {gloo['config']} <= 1.10",
                          r["ms_per_step"] / gloo["ms_per_step"], 1.10, False))
    for label, v, target, higher in goals:
        met = v >= target if higher else v <= target
        print(f"  {label:<40} {v:5.2f}  {'met' if met else 'NOT met'}")
