"""The fault-injection matrix of a local run: rank kind x point x fault, one run a cell.

    python -m tests.fault_matrix [--kinds K ...] [--points P ...] [--faults F ...]

Each cell runs ``pearl-hpc run`` on the local backend with real engines and the tiny
model (a master, one trainer rank, a reserved and an overlap engine rank, one elastic
rank; 4 steps, a checkpoint every 2) and, at the point, sends the fault to a rank of the
kind:

- kinds: ``elastic``, ``reserved``, ``overlap`` (engine ranks), ``trainer``, ``master``;
- points: ``rollout`` (a rollout after the first, with turns in flight), ``train`` (step
  1's Training Begin: the trainer ranks start it and the borrowed GPU is being
  returned), ``publish`` (step 1 trained: its weight broadcast to the engines is next,
  and runs against the rank the fault hit unless the master saw it first),
  ``repartition`` (step 1 finished: the overlap engine is being lent the GPU again),
  ``leave`` (the elastic rank's LEAVE at step 2, its grant taken back), ``idle`` (after
  step 0's record, before the first turn of the next rollout is logged, or at once where
  none is left);
- faults: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a silent rank, left stopped) and
  ``term`` (SIGTERM, SIGKILL 5 s later if it lives: what Slurm's preemption does to a
  step's tasks with a GraceTime of 5 s; preemption by a real Slurm is in
  tests/test_slurm_run.py).

Joining ranks that die after their announce, before their hello, or that are strangers
are cells of the control plane's own test (tests/test_mpi_plane.py): the window is a few
milliseconds in a run.

A cell passes when the run finishes with every step trained once on its whole batch,
every weight version published once and in order, and no restart of the run (the master
row: one, by the launcher); it prints the seconds from
the fault to the rank's declared failure (``member_failed``; the master: its
successor's start) and to its recovery (the engine rank serving again, the trainer ranks
back, the elastic rank replaced, the master resumed). The suite runs a representative
row of each kind (tests/test_local_run.py); this runs them all. Not part of the suite:
~50 s a cell on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.rundir import RunDir
from tests.test_local_run import CONFIG as LOCAL_RUN
from tests.test_local_run import MEASURED

KINDS = ("elastic", "reserved", "overlap", "trainer", "master")
POINTS = ("rollout", "train", "publish", "repartition", "leave", "idle")
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
STEPS, BATCH = 4, 16
GRACE_S = 5.0  # the term fault's SIGKILL

CONFIG: dict[str, Any] = {  # the local run tests' (borrowing ungated), 4 steps
    **LOCAL_RUN,
    "profile": MEASURED,
    "elastic": {"grace_s": 30, "trace": [{"at_step": 0, "workers": 1}]},
    "run": {**LOCAL_RUN["run"], "steps": STEPS},
    "train": {"checkpoint_every": 2},
}


@dataclass
class Cell:
    kind: str
    point: str
    fault: str
    passed: bool = False
    why: str = ""
    detected_s: float | None = None
    recovered_s: float | None = None
    restarts: int = 0
    wall_s: float = 0.0
    loop_gap_ms: float | None = None  # the longest gap between the master's beats
    loop_own_ms: float | None = None  # ... less its thread's wait for a CPU


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError):
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return []


def _target(kind: str, run_dir: Path) -> int | None:
    """The pid of a rank of ``kind`` in the run (None: not up)."""
    ready = {
        "elastic": sorted(run_dir.glob("elastic/el1+0-*.ready.json")),
        "reserved": sorted(run_dir.glob("rank*-rsv:0.ready.json")),
        "overlap": sorted(run_dir.glob("rank*-train:0.ready.json")),
    }.get(kind)
    if ready is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(json.loads(ready[0].read_text())["pid"])
        return None
    if kind == "master":
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(RunDir(run_dir).lock_file.read_text().split()[0])
        return None
    out = subprocess.run(
        ["pgrep", "-f", f"pearl_hpc.rank trainers --run-dir {run_dir}"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for pid in out:  # the trainer rank 0 (not its gforker: its environment has PMI_RANK)
        with contextlib.suppress(OSError):
            if b"PMI_RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
    return None


def _at(point: str, run_dir: Path) -> bool:
    events = _jsonl(run_dir / "events.jsonl")
    if point == "train":
        return any(e.get("event") == "TrainingBegin" and e.get("step") == 1 for e in events)
    if point == "publish":
        return any(e["kind"] == "train" and e.get("step") == 1 for e in events)
    if point == "repartition":
        cause = "training step 1 finished"
        return any(e["kind"] == "reconfigure" and e["cause"] == cause for e in events)
    if point == "leave":
        return any(e["kind"] == "leave" and e["group"] == "el1+0" for e in events)
    logs = sorted((run_dir / "trajectories").glob("step-*.jsonl"))
    if point == "rollout":
        return len(logs) >= 2 and len(logs[-1].read_text().splitlines()) >= 4
    return len(_jsonl(run_dir / "metrics.jsonl")) >= 1  # idle: step 0 recorded


def _inject(cell: Cell, run_dir: Path, fired: list[float]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (run_dir / "events.jsonl").exists() and _at(cell.point, run_dir):
            pid = _target(cell.kind, run_dir)
            if pid is not None:
                os.kill(pid, FAULTS[cell.fault])
                fired.append(time.time())
                if cell.fault == "term":
                    time.sleep(GRACE_S)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.01)


def _wall(events: list[dict[str, Any]]) -> Callable[[dict[str, Any]], float]:
    """An event's wall time: each master's ``clock`` event lines its run clock up."""
    clocks = [(e["t_s"], e["wall"]) for e in events if e["kind"] == "clock"]

    def wall(e: dict[str, Any]) -> float:
        t0, w0 = max((c for c in clocks if c[0] <= e["t_s"]), default=clocks[0])
        return float(w0 + e["t_s"] - t0)

    return wall


def _judge(cell: Cell, run_dir: Path, fired: float) -> None:
    metrics = _jsonl(run_dir / "metrics.jsonl")
    events = _jsonl(run_dir / "events.jsonl")
    cell.restarts = sum(1 for e in events if e["kind"] == "resumed")  # (a new world's)
    cell.loop_gap_ms = round(1e3 * max((m.get("loop_gap_s", 0.0) for m in metrics), default=0))
    own = [m["loop_own_s"] for m in metrics if "loop_own_s" in m]
    cell.loop_own_ms = round(1e3 * max(own)) if own else None
    problems = []
    if [m["step"] for m in metrics] != list(range(STEPS)):
        problems.append(f"steps {[m['step'] for m in metrics]}")
    if any(m["trajectories"] != BATCH for m in metrics):
        problems.append(f"trajectories {[m['trajectories'] for m in metrics]}")
    if cell.restarts != (1 if cell.kind == "master" else 0):
        problems.append(f"{cell.restarts} restarts")
    # each version published once, in order, up to the last step's (a resumed master
    # may publish its recorded version again)
    versions = [e["version"] for e in events if e["kind"] == "publish"]
    ordered = sorted(set(versions)) if cell.kind != "master" else sorted(versions)
    if versions != ordered or not versions or versions[-1] != STEPS:
        problems.append(f"versions published {versions}")
    wall = _wall(events)
    after = [e for e in events if wall(e) >= fired - 0.5]
    failed = next((e for e in after if e["kind"] in ("member_failed", "resumed")), None)
    recovered = {
        "elastic": lambda e: e["kind"] == "joined" and e["group"].startswith("el2"),
        "reserved": lambda e: e["kind"] == "engine_back",
        "overlap": lambda e: e["kind"] == "engine_back",
        "trainer": lambda e: e["kind"] == "trainers_back",
        "master": lambda e: e["kind"] == "resumed",
    }[cell.kind]
    back = next((e for e in after if recovered(e)), None)
    cell.detected_s = None if failed is None else round(wall(failed) - fired, 2)
    cell.recovered_s = None if back is None else round(wall(back) - fired, 2)
    ended = wall(events[-1]) if events else fired
    if back is None and cell.kind == "master":
        problems.append("not resumed")
    elif back is None and cell.point == "leave" and cell.kind == "elastic":
        cell.why = "it was leaving: nothing to replace"
    elif back is None:  # (an engine rank may still be starting when the run ends)
        cell.why = f"the run ended {ended - fired:.0f} s after the fault, the rank not back yet"
    if cell.kind == "trainer":
        problems += _lent_through_the_loss(events)
        cell.why = cell.why or _gpu_back(run_dir, events, wall, fired)
    cell.passed = not problems
    cell.why = "; ".join(problems) if problems else cell.why


def _gpu_back(
    run_dir: Path,
    events: list[dict[str, Any]],
    wall: Callable[[dict[str, Any]], float],
    fired: float,
) -> str:
    """Where the trainer's GPU was lent at the fault: when it came back, and how long the
    new ranks waited for it before loading."""
    before = [e for e in events if e["kind"] == "trainer_gpus" and wall(e) < fired]
    if not before or not before[-1]["lent"]:
        return ""
    back = next(e for e in events if e["kind"] == "trainer_gpus" and wall(e) >= fired)
    waits = re.findall(r"waited ([0-9.]+) s for its GPU", _logs(run_dir, "rank*-trainer.log"))
    waited = f"; the new ranks waited {max(map(float, waits)):.1f} s" if waits else ""
    return f"GPU lent at the fault, back at {wall(back) - fired:.1f} s{waited}"


def _logs(run_dir: Path, pattern: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob(pattern)))


def _lent_through_the_loss(events: list[dict[str, Any]]) -> list[str]:
    """Trainer ranks lost while an overlap engine held their GPU: the master takes it
    back (``trainer_gpus`` lent false) before the new ranks are back, and lends it to no
    one in between."""
    kinds = [e["kind"] for e in events]
    if "trainers_lost" not in kinds or "trainers_back" not in kinds:
        return []
    lost, back = kinds.index("trainers_lost"), kinds.index("trainers_back")
    lent = [e["lent"] for e in events[:back] if e["kind"] == "trainer_gpus"]
    marks = [e["lent"] for e in events[lost:back] if e["kind"] == "trainer_gpus"]
    if lent and lent[-1]:
        return [f"a trainer GPU was lent when the new ranks came back ({marks})"]
    if True in marks:
        return [f"a trainer GPU was lent while the ranks were lost ({marks})"]
    return []


def run_cell(cell: Cell, root: Path) -> Cell:
    import yaml

    from pearl_hpc.backends.world import RunFailed, run_to_summary
    from pearl_hpc.master.preflight import load_run_config

    path = root / "run.yaml"
    config = CONFIG
    if cell.point == "leave":  # the grant taken back at step 2
        trace = [{"at_step": 0, "workers": 1}, {"at_step": 2, "workers": 0}]
        config = {**CONFIG, "elastic": {**CONFIG["elastic"], "trace": trace}}
    path.write_text(yaml.safe_dump({"runs_dir": str(root / "runs"), **config}))
    cfg = load_run_config(path)
    run_dir = root / "runs" / "t"
    fired: list[float] = []
    injector = threading.Thread(target=_inject, args=(cell, run_dir, fired), daemon=True)
    t0 = time.monotonic()
    injector.start()
    try:
        run_to_summary(cfg, run_dir)
    except RunFailed as exc:
        cell.why = str(exc).splitlines()[0][:200]
    cell.wall_s = round(time.monotonic() - t0, 1)
    kept = _kept(cell)
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(run_dir, kept, ignore=shutil.ignore_patterns("checkpoints", "*.key"))
    if not fired:
        cell.why = cell.why or "the point was never reached"
        return cell
    if not cell.why:
        _judge(cell, run_dir, fired[0])
    return cell


def table(cells: list[Cell]) -> str:
    head = (
        "| rank | point | fault | result | detected s | recovered s | run restarts | "
        "master loop gap / own ms | run s |"
    )
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        result = ("pass" + (f" ({c.why})" if c.why else "")) if c.passed else f"FAIL: {c.why}"
        lines.append(
            f"| {c.kind} | {c.point} | {c.fault} | {result} | {c.detected_s} | "
            f"{c.recovered_s} | {c.restarts} | {c.loop_gap_ms} / {c.loop_own_ms} | "
            f"{c.wall_s} |"
        )
    return "\n".join(lines)


def _kept(cell: Cell) -> Path:
    """Where a cell's run directory is kept (checkpoints and keys left out)."""
    return Path(tempfile.gettempdir()) / f"pearl-faults-{cell.kind}-{cell.point}-{cell.fault}"


def _most(values: list[float]) -> str:
    return f"{max(values):g}" if values else "-"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def summary(cells: list[Cell]) -> str:
    """A row per rank kind and fault, over the points: cells passed, the spans of the
    detection and recovery seconds, run restarts, the longest master loop gap (and that
    gap less its thread's wait for a CPU)."""
    head = (
        "| rank | fault | passed | detected s | recovered s | run restarts | "
        "master loop gap / own ms |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        for fault in FAULTS:
            row = [c for c in cells if c.kind == kind and c.fault == fault]
            if not row:
                continue
            passed = sum(c.passed for c in row)
            detected = [c.detected_s for c in row if c.detected_s is not None]
            recovered = [c.recovered_s for c in row if c.recovered_s is not None]
            gaps = [c.loop_gap_ms for c in row if c.loop_gap_ms is not None]
            owns = [c.loop_own_ms for c in row if c.loop_own_ms is not None]
            lines.append(
                f"| {kind} | {fault} | {passed}/{len(row)} | {_span(detected)} | "
                f"{_span(recovered)} | {sum(c.restarts for c in row)} | "
                f"{_most(gaps)} / {_most(owns)} |"
            )
    return "\n".join(lines)


def _number(text: str) -> float | None:
    return None if text.strip() in ("None", "-", "") else float(text)


def read_rows(paths: list[Path]) -> list[Cell]:
    """The cells of earlier runs' tables (their output saved), a later row of a cell
    replacing an earlier one."""
    cells: dict[tuple[str, str, str], Cell] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            fields = [f.strip() for f in line.strip().strip("|").split("|")]
            if len(fields) < 8 or fields[0] not in KINDS:
                continue
            kind, point, fault, result = fields[:4]
            loop = fields[7].split("/") if len(fields) == 9 else []
            gap = _number(loop[0]) if loop else None
            own = _number(loop[1]) if len(loop) > 1 else None
            passed = result.startswith("pass")
            why = result.split("(", 1)[1].rstrip(")") if passed and "(" in result else ""
            cell = Cell(kind, point, fault, passed, why if passed else result[6:])
            cell.detected_s, cell.recovered_s = _number(fields[4]), _number(fields[5])
            cell.restarts, cell.wall_s = int(fields[6]), float(fields[-1])
            cell.loop_gap_ms, cell.loop_own_ms = gap, own
            if own is None:  # a row of an older harness: the cell's kept run may say
                metrics = _jsonl(_kept(cell) / "metrics.jsonl")
                owns = [m["loop_own_s"] for m in metrics if "loop_own_s" in m]
                cell.loop_own_ms = round(1e3 * max(owns)) if owns else None
            cells[(kind, point, fault)] = cell
    return [cells[k] for k in sorted(cells, key=lambda k: (KINDS.index(k[0]), k[1], k[2]))]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_matrix", description=__doc__)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--points", nargs="+", default=list(POINTS), choices=POINTS)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument(
        "--report", nargs="+", type=Path, help="no run: the tables of these saved outputs"
    )
    args = parser.parse_args()
    if args.report:
        cells = read_rows(args.report)
        print(table(cells) + "\n\n" + summary(cells))
        return 0 if all(c.passed for c in cells) else 1
    cells = []
    cache = tempfile.TemporaryDirectory(prefix="pearl-faults-cache-")
    os.environ["PEARL_HPC_CACHE"] = cache.name  # (the tiny model, built once)
    for kind in args.kinds:
        for point in args.points:
            for fault in args.faults:
                with tempfile.TemporaryDirectory(prefix="pearl-faults-") as root:
                    cell = run_cell(Cell(kind, point, fault), Path(root))
                cells.append(cell)
                print(table([cell]).splitlines()[-1], flush=True)
    cache.cleanup()
    print()
    print(table(cells) + "\n\n" + summary(cells))
    return 0 if all(c.passed for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
