"""The fault-injection harness: real ranks, one injected fault, what every survivor saw.

``run_trial(fault)`` starts ``fault.ranks`` processes of ``fault_job.py`` the
way torchrun starts a script (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, gloo on loopback), each in a process group of its own, with
the fault set in the faulty rank's environment, and supervises them:

1. It polls every rank (20 ms) and notes when each exits. The fault's time is
   what the faulty rank wrote to the mark file just before acting (wall
   clock, one host); for a rank that joins with another setup there is no
   such moment, and times count from the launch.
2. A survivor still running ``timeout + MARGIN`` seconds after the fault is a
   *hang*; it is killed. Once every survivor has exited, the faulty rank is
   killed if it is still there (a stopped rank stays stopped, as under a real
   launcher that tears the job down).
3. Then it looks for *processes left behind*: anything still alive in the
   ranks' process groups (``/proc``; the library starts no processes, so there
   should be none).
4. It loads every checkpoint the ranks wrote (``torch.load(weights_only=True)``):
   one that does not load, or lacks its fields, is *corrupted*.
5. For each survivor it reads the ``RESULT`` line: the error's time, type,
   text and the ranks it names (``PeerError.ranks`` where the error carries
   them, else every ``rank N`` / ``rank(s) [..]`` in the text), and judges
   whether it names the cause (``Fault.cause``, a pattern) and the right rank.

``summarize`` folds trials into the table issue 46 asks for; ``write_summary``
writes it as JSON (``HIPRESS_FAULTS_JSON``, default ``results/faults.json``)
and ``render`` prints it (``python tests/faults/summary.py`` renders a file).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

JOB = Path(__file__).with_name("fault_job.py")
ROOT = JOB.parents[2]
# What "within the configured timeout" allows on top: start-up of a torch process on a
# loaded 2-core host, the diagnosis (about 1 s), and the store host's linger (5 s).
MARGIN = 30.0
TIMEOUT = 8.0  # the job's hpt.init(timeout=...): every collective's limit


@dataclass(frozen=True)
class Fault:
    """One kind of injected fault.

    Attributes:
        name: the row's name in the table.
        rank: the faulty rank.
        cause: a regular expression the survivors' error text must match.
        action, phase, step: a process fault (``kill``/``stop``/``raise`` in
            ``forward``/``backward``/``encode``/``save``/``switch`` at that step).
        transport: a ``HIPRESS_FAULT`` spec for the faulty rank (faults inside
            the bulk exchange: ``casync/transport/faulty.py``).
        mismatch: ``model``/``compressor``/``strategy``/``plan``/``world_size``.
        ranks: how many ranks the job has.
        link: the other end of a damaged message; a survivor may name it too.
        plan: the job's ``JOB_PLAN`` on every rank (``adaptive``: ``plan=hpt.Adaptive``,
            switching after step 5; the ``switch`` phase needs it).
        netem: run the ranks in network namespaces over links emulated at this rate
            (``hipress_like.launch.netem``; root): rank i in ``h{i}``. The ``slow``
            action needs it.
    """

    name: str
    rank: int
    cause: str
    action: Optional[str] = None
    phase: Optional[str] = None
    step: int = 5
    transport: Optional[str] = None
    mismatch: Optional[str] = None
    ranks: int = 2
    link: Optional[int] = None
    plan: Optional[str] = None
    netem: Optional[str] = None

    def env(self) -> Dict[str, str]:
        """The faulty rank's extra environment."""
        out: Dict[str, str] = {}
        if self.action:
            out.update(FAULT_ACTION=self.action, FAULT_PHASE=self.phase or "forward",
                       FAULT_STEP=str(self.step))
        if self.transport:
            out["HIPRESS_FAULT"] = self.transport
        if self.mismatch and self.mismatch != "world_size":
            out["FAULT_MISMATCH"] = self.mismatch
        return out

    @property
    def leaves_rank(self) -> bool:
        """Whether the faulty rank is gone (killed, stopped, raised) rather than a survivor."""
        return self.action in ("kill", "stop", "raise") or (
            self.transport or "").split(":")[0] in ("kill", "stop", "raise")


@dataclass
class Survivor:
    """What one surviving rank did."""

    rank: int
    rc: Optional[int]
    error_s: Optional[float]  # fault -> its error (None: it raised nothing)
    exit_s: Optional[float]  # its error -> its exit
    error: str = ""
    kind: str = ""
    named: List[int] = field(default_factory=list)
    names_cause: bool = False
    names_rank: bool = False
    hung: bool = False


@dataclass
class Trial:
    """One run of one fault."""

    fault: str
    ranks: int
    survivors: List[Survivor]
    left_behind: int
    hangs: int
    corrupted: int
    checkpoints: int
    faulty_rc: Optional[int]
    fault_seen: bool  # the faulty rank reached its fault (a mark was written)
    wall_s: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pgid(pid: int) -> Optional[int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[2])


def alive_in_groups(pgids: Sequence[int]) -> List[int]:
    """Live (non-zombie) processes whose process group is one of ``pgids``."""
    want = set(pgids)
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) in want]


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


_RANK_RE = re.compile(r"rank\(s\) \[([\d, ]*)\]|ranks? (\d+)")


def named_ranks(result: dict, own: int) -> List[int]:
    """The ranks an error names: its ``ranks`` attribute, else those in its text
    (``rank(s) [1, 2]``, ``rank 3``), this rank itself left out."""
    if result.get("ranks"):
        return sorted(set(result["ranks"]) - {own})
    found = set()
    for group, single in _RANK_RE.findall(result.get("msg", "")):
        found.update(int(x) for x in (group.split(",") if group else [single]) if x.strip())
    return sorted(found - {own})


def _result(path: Path) -> Optional[dict]:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines()
                 if ln.startswith("RESULT ")]
    except OSError:
        return None
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def _check_checkpoints(folder: Path) -> tuple:
    import torch

    n = bad = 0
    for f in sorted(folder.glob("ckpt-r*.pt")):
        n += 1
        try:
            state = torch.load(f, weights_only=True)
            if not {"step", "model", "optimizer"} <= set(state):
                bad += 1
        except Exception:
            bad += 1
    return n, bad


def run_trial(fault: Fault, timeout: float = TIMEOUT, workdir: Optional[str] = None) -> Trial:
    """Run the job once with ``fault`` injected; see the module docstring."""
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="hipress-fault-") if own_tmp else workdir)
    (work / "ckpt").mkdir(parents=True, exist_ok=True)
    mark = work / "mark.jsonl"
    for old in [mark, *(work / "ckpt").glob("*")]:  # a reused workdir: nothing of the last run
        old.unlink(missing_ok=True)
    n = fault.ranks
    if fault.netem:
        from hipress_like.launch import netem

        netem.up(n, fault.netem)
        try:
            return _run_trial(fault, timeout, work, mark, own_tmp)
        finally:
            netem.down(n)
    return _run_trial(fault, timeout, work, mark, own_tmp)


def _run_trial(fault: Fault, timeout: float, work: Path, mark: Path, own_tmp: bool) -> Trial:
    n = fault.ranks
    port, addr, prefix, extra = free_port(), "127.0.0.1", [], {}
    if fault.netem:  # rank r inside namespace h{r}; gloo over the emulated links
        from hipress_like.launch import netem

        port, addr, extra = netem.DEFAULT_PORT, netem.MASTER_ADDR, {"GLOO_SOCKET_IFNAME": "eth0"}
    procs, logs = [], []
    t0 = time.time()
    for r in range(n):
        world = n + 1 if fault.mismatch == "world_size" and r == fault.rank else n
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", JOB_TIMEOUT=str(timeout),
                   JOB_CKPT_DIR=str(work / "ckpt"), HIPRESS_FAULT_MARK=str(mark),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for k in ("HIPRESS_FAULT", "FAULT_ACTION", "FAULT_PHASE", "FAULT_STEP",
                  "FAULT_MISMATCH", "JOB_PLAN"):
            env.pop(k, None)
        env.update(extra)
        if fault.plan:
            env["JOB_PLAN"] = fault.plan
        if r == fault.rank:
            env.update(fault.env())
        log = open(work / f"rank{r}.log", "w")
        logs.append(log)
        if fault.netem:
            prefix = ["ip", "netns", "exec", f"h{r}"]
        procs.append(subprocess.Popen([*prefix, sys.executable, str(JOB)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, process_group=0))
    pgids = [p.pid for p in procs]  # process_group=0: each rank leads its own group
    survivors = [r for r in range(n) if not (fault.leaves_rank and r == fault.rank)]
    exited: Dict[int, float] = {}
    hung = set()
    fault_t: Optional[float] = None
    # No rank may take longer than start-up + the job + the fault's timeout + margin.
    hard_deadline = t0 + 3 * timeout + 6 * MARGIN
    try:
        while True:
            now = time.time()
            for r, p in enumerate(procs):
                if r not in exited and p.poll() is not None:
                    exited[r] = now
            if fault_t is None and mark.exists():
                marks = [json.loads(ln) for ln in mark.read_text().splitlines() if ln.strip()]
                fault_t = min(m["t"] for m in marks) if marks else None
            if all(r in exited for r in survivors):
                break
            since = fault_t if fault_t is not None else None
            limit = (since + timeout + MARGIN) if since is not None else hard_deadline
            if now > min(limit, hard_deadline):
                for r in survivors:
                    if r not in exited:
                        hung.add(r)
                        _killpg(pgids[r])
                        procs[r].wait()
                        exited[r] = time.time()
                break
            time.sleep(0.02)
        for r, p in enumerate(procs):  # the faulty rank, if still there (stopped)
            if p.poll() is None:
                _killpg(pgids[r])
                p.wait()
        time.sleep(0.3)
        left = alive_in_groups(pgids)
    finally:
        for pg in pgids:
            _killpg(pg)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    origin = fault_t if fault_t is not None else t0
    if fault.mismatch:
        origin = t0
    records = []
    for r in survivors:
        res = _result(work / f"rank{r}.log") or {}
        err_t = res.get("t") if res and not res.get("ok") else None
        named = named_ranks(res, r) if err_t is not None else []
        if fault.mismatch:  # every rank is a survivor; the odd one must be among those named
            right = fault.rank in named or (r == fault.rank and bool(named))
        else:
            allowed = {fault.rank} | ({fault.link} if fault.link is not None else set())
            right = bool(named) and set(named) <= allowed
        msg = res.get("msg", "") if err_t is not None else ""
        records.append(Survivor(
            rank=r, rc=procs[r].returncode,
            error_s=None if err_t is None else round(err_t - origin, 3),
            exit_s=None if err_t is None else round(exited[r] - err_t, 3),
            error=msg[:1500], kind=res.get("type", ""), named=named,
            names_cause=bool(msg) and re.search(fault.cause, msg, re.I) is not None,
            names_rank=right, hung=r in hung))
    n_ckpt, bad = _check_checkpoints(work / "ckpt")
    trial = Trial(fault=fault.name, ranks=n, survivors=records, left_behind=len(left),
                  hangs=len(hung), corrupted=bad, checkpoints=n_ckpt,
                  faulty_rc=None if not fault.leaves_rank else procs[fault.rank].returncode,
                  fault_seen=fault_t is not None or bool(fault.mismatch),
                  wall_s=round(time.time() - t0, 2))
    if own_tmp and all(s.names_rank and s.names_cause for s in records):
        for f in sorted(work.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        work.rmdir()
    else:
        trial_dir = str(work)
        for s in records:
            s.error = s.error or f"(no error; logs in {trial_dir})"
    return trial


def trial_from_dict(d: dict) -> Trial:
    """A ``Trial`` back from its JSON form (``write_summary``'s ``trials``)."""
    d = dict(d)
    d["survivors"] = [Survivor(**s) for s in d["survivors"]]
    return Trial(**d)


def logs_of(trial: Trial) -> str:
    """The survivors' records as text, for an assertion message."""
    return json.dumps(asdict(trial), indent=1)[:6000]


def _stats(xs: List[float]) -> Dict[str, Optional[float]]:
    return ({"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs
            else {"median": None, "max": None})


def summarize(trials: Sequence[Trial]) -> List[dict]:
    """One row per fault: the table issue 46 asks for (module docstring)."""
    rows: Dict[str, dict] = {}
    for t in trials:
        row = rows.setdefault(t.fault, {"fault": t.fault, "ranks": t.ranks, "trials": 0,
                                        "_err": [], "_exit": [], "left_behind": 0, "hangs": 0,
                                        "corrupted": 0, "checkpoints": 0, "wrong_rank": 0,
                                        "cause_missing": 0, "zero_exit": 0, "no_error": 0})
        row["trials"] += 1
        row["left_behind"] += t.left_behind
        row["hangs"] += t.hangs
        row["corrupted"] += t.corrupted
        row["checkpoints"] += t.checkpoints
        for s in t.survivors:
            if s.error_s is None:
                row["no_error"] += 1
            else:
                row["_err"].append(s.error_s)
                row["_exit"].append(s.exit_s)
            row["wrong_rank"] += not s.names_rank
            row["cause_missing"] += not s.names_cause
            row["zero_exit"] += s.rc == 0
    out = []
    for row in rows.values():
        row["first_error_s"] = _stats(row.pop("_err"))
        row["exit_after_error_s"] = _stats(row.pop("_exit"))
        out.append(row)
    return out


COLUMNS = [("fault", "fault"), ("ranks", "ranks"), ("trials", "trials"),
           ("first_error_s.median", "1st error med s"), ("first_error_s.max", "max s"),
           ("exit_after_error_s.median", "exit med s"), ("exit_after_error_s.max", "max s"),
           ("left_behind", "left"), ("hangs", "hangs"), ("corrupted", "corrupt"),
           ("wrong_rank", "wrong rank"), ("cause_missing", "no cause"),
           ("zero_exit", "exit 0")]


def render(rows: Sequence[dict]) -> str:
    """The summary as a plain-text table."""
    def cell(row: dict, key: str) -> str:
        v = row
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return "-" if v is None else str(v)

    table = [[h for _, h in COLUMNS]] + [[cell(r, k) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_summary(trials: Sequence[Trial], path: Optional[str] = None) -> str:
    """Write the table (and every trial) as JSON; return the path."""
    path = path or os.environ.get("HIPRESS_FAULTS_JSON") or str(ROOT / "results" / "faults.json")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"timeout_s": TIMEOUT, "margin_s": MARGIN, "rows": summarize(trials),
           "trials": [asdict(t) for t in trials]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return path


# The catalogue: every fault the suite injects. The faulty rank is never rank 0 unless
# the point is rank 0 (the store's host); ``step`` 5 is past the first checkpoint (step 3).
_KILLED = r"stopped heartbeating|died|closed their transport or exited|failed in an earlier"
_STALLED = r"stopped heartbeating|froze|stalled|never entered"
_RAISED = (r"error occurred on rank|injected exception|closed their transport or exited|"
           r"failed in an earlier")
# an uncaught exception outside the engine: its rank tells the peers the exception's text
# (runtime's excepthook) before it exits
_TOLD = r"injected exception"
_SLOWED = (r"had not arrived|never arrived|slower than the timeout|stopped heartbeating|"
           r"timed out|unreachable|failed in an earlier")
_DAMAGED = r"payload|truncat|corrupt|checksum|sent \d+ bytes|never arrived|error occurred on rank"
CATALOG: Dict[str, Fault] = {f.name: f for f in [
    # default tier: 2 ranks, one of each family
    Fault("kill/forward", rank=1, cause=_KILLED, action="kill", phase="forward"),
    Fault("raise/encode", rank=1, cause=_RAISED, action="raise", phase="encode"),
    Fault("stop/exchange", rank=1, cause=_STALLED, transport="stop:call=12"),
    Fault("mismatch/world_size", rank=1, cause=r"world sizes", mismatch="world_size"),
    Fault("mismatch/compressor", rank=1, cause=r"compressor", mismatch="compressor"),
    # slow tier
    Fault("kill/backward", rank=1, cause=_KILLED, action="kill", phase="backward"),
    Fault("kill/encode", rank=1, cause=_KILLED, action="kill", phase="encode"),
    Fault("kill/exchange", rank=1, cause=_KILLED, transport="kill:call=12"),
    Fault("kill/save", rank=1, cause=_KILLED, action="kill", phase="save"),
    Fault("raise/forward", rank=1, cause=_TOLD, action="raise", phase="forward"),
    Fault("raise/backward", rank=1, cause=_TOLD, action="raise", phase="backward"),
    Fault("raise/exchange", rank=1, cause=_RAISED, transport="raise:call=12"),
    Fault("raise/save", rank=1, cause=_RAISED, action="raise", phase="save"),
    Fault("stop/forward", rank=1, cause=_STALLED, action="stop", phase="forward"),
    # the receiver names the sender whose message never came; the sender cannot know it
    # dropped one, and names the receiver that failed waiting for it
    Fault("drop/exchange", rank=1, cause=_DAMAGED + "|failed in an earlier",
          transport="drop:call=12", link=0),
    Fault("truncate/exchange", rank=1, cause=_DAMAGED, transport="truncate:call=12", link=0),
    Fault("flip-header/exchange", rank=1, cause=_DAMAGED, transport="flip:call=12,byte=0",
          link=0),
    Fault("flip-data/exchange", rank=1, cause=_DAMAGED, transport="flip:call=12,byte=-1",
          link=0),
    Fault("mismatch/model", rank=1, cause=r"gradient|shape|names|parameter", mismatch="model"),
    Fault("mismatch/strategy", rank=1, cause=r"strategy", mismatch="strategy"),
    Fault("mismatch/plan", rank=1, cause=r"plan", mismatch="plan"),
    Fault("mismatch/world_size@4", rank=2, cause=r"world sizes", mismatch="world_size",
          ranks=4),
    # 4 ranks, a non-zero rank dies: survivors name it, not rank 0 (the store's host)
    Fault("kill/forward@4", rank=2, cause=_KILLED, action="kill", phase="forward", ranks=4),
    Fault("kill/exchange@4", rank=3, cause=_KILLED, transport="kill:call=12", ranks=4),
    Fault("raise/backward@4", rank=3, cause=_TOLD, action="raise", phase="backward",
          ranks=4),
    # plan="adaptive": a rank killed as every rank enters the plan switch
    Fault("kill/switch@3", rank=1, cause=_KILLED, action="kill", phase="switch", ranks=3,
          plan="adaptive"),
    Fault("kill/forward rank 0@4", rank=0, cause=_KILLED + "|unreachable", action="kill",
          phase="forward", ranks=4),
    # netem tier (root): rank 1's link out slowed by tc to 1 kbit/s at step 5; both ranks
    # live on, every exchange from then on outlasts the timeout
    Fault("slow-link/forward", rank=1, cause=_SLOWED, action="slow", phase="forward",
          link=0, netem="1gbit"),
]}
DEFAULT_TIER = ("kill/forward", "raise/encode", "raise/forward", "stop/exchange",
                "drop/exchange", "mismatch/world_size", "mismatch/compressor")
