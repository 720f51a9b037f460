"""Harvest efficiency on a real Slurm cluster: how much of the capacity other users
leave idle a run turns into serving elastic workers, for ``single`` and ``hetjob``
requests side by side.

    pearl-hpc bench --harvest [--config configs/runs/slurm-local.yaml] [--segment 1]
                    [--speedup 60] [--steps 40] [--requests single,hetjob]

For each request kind: ``slurm/replay-load`` replays the availability segment on the
cluster (other users' jobs on ``high`` hold what the trace does not leave idle), the
run's master is submitted with ``pearl-hpc run CONFIG --sbatch``, and once both ended the
run's events and the load's log are read. Over the time both ran:

- **offered**: elastic worker-seconds the trace left idle (idle nodes, at most
  ``elastic.max_workers``);
- **served**: worker-seconds elastic workers were admitted and serving;
- **efficiency** = served / offered, and the gap in parts: **not held** (idle, but no
  request of the run was running there: pending latency, or not worth requesting),
  **preparing** (running, the engine starting: Slurm start -> admitted), **draining**
  (reclaim notice -> released);
- the grant latencies: submit -> RUNNING (squeue) and RUNNING -> admitted.

One node per elastic worker (``--exclusive``), as in slurm-local.yaml. Needs the local
cluster (``slurm/local-cluster.sh up``) and a source checkout (``slurm/replay-load``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pearl_hpc.bench import record
from pearl_hpc.rundir import RunDir, read_jsonl

REPO = record.SOURCE  # the checkout: slurm/replay-load
REQUESTS = ("single", "hetjob")


def worker_intervals(events: list[dict[str, Any]], end_s: float) -> dict[str, dict[str, float]]:
    """Per elastic component (``JOB+K``), run-clock times: ``granted`` (Slurm started
    it), ``serving`` (its worker admitted), ``notice`` (reclaim), ``released`` (given
    back), each absent if it did not happen; ``ended`` is the last of them or
    ``end_s`` (pure)."""
    comps: dict[str, dict[str, float]] = {}
    slot_comp: dict[int, str] = {}
    for e in events:
        t, kind = float(e["t_s"]), e["kind"]
        if kind == "event" and e.get("event") == "CapacityGranted":
            for tag in [e["source"], *e.get("also", [])]:  # a hetjob's components together
                comps.setdefault(str(tag), {})["granted"] = t
        elif kind == "ready" and e.get("source"):
            slot_comp[int(e["slot"])] = str(e["source"])
        elif kind == "admit":
            for slot in e["slots"]:
                comp = slot_comp.get(int(slot))
                if comp is not None:
                    comps.setdefault(comp, {}).setdefault("serving", t)
        elif kind == "event" and e.get("event") == "CapacityReclaimed":
            comps.setdefault(str(e["source"]), {}).setdefault("notice", t)
        elif kind == "release_capacity":
            comps.setdefault(str(e["source"]), {}).setdefault("released", t)
    for c in comps.values():
        c["ended"] = c.get("released", end_s)
    return comps


def offered_worker_s(load: list[dict[str, Any]], start_w: float, end_w: float, cap: int) -> float:
    """Worker-seconds the load left idle between two wall times, at most ``cap``
    workers at once (pure)."""
    points = [(float(x["wall"]), min(cap, int(x["idle_nodes"]))) for x in load if "idle_nodes" in x]
    total = 0.0
    for (t0, idle), (t1, _) in zip(points, [*points[1:], (end_w, 0)], strict=True):
        lo, hi = max(t0, start_w), min(t1, end_w)
        if hi > lo:
            total += idle * (hi - lo)
    return total


def harvest_figures(
    events: list[dict[str, Any]], load: list[dict[str, Any]], cap: int
) -> dict[str, Any]:
    """The figures of one run against its load (pure): over the wall time both ran."""
    clock = next(e for e in events if e["kind"] == "clock")
    wall0 = float(clock["wall"]) - float(clock["t_s"])  # wall time of run clock 0
    load_end = next((float(x["wall"]) for x in load if x.get("end")), float(load[-1]["wall"]))
    run_end = wall0 + float(events[-1]["t_s"])
    start_w, end_w = max(wall0, float(load[0]["wall"])), min(run_end, load_end)
    lo, hi = start_w - wall0, end_w - wall0  # the window on the run clock

    def inside(a: float | None, b: float | None) -> float:
        if a is None or b is None:
            return 0.0
        return max(0.0, min(b, hi) - max(a, lo))

    comps = worker_intervals(events, hi)
    served = sum(inside(c.get("serving"), c.get("notice", c["ended"])) for c in comps.values())
    held = sum(inside(c.get("granted"), c["ended"]) for c in comps.values())
    preparing = sum(
        inside(c.get("granted"), c.get("serving", c.get("notice", c["ended"])))
        for c in comps.values()
    )
    draining = sum(inside(c.get("notice"), c["ended"]) for c in comps.values())
    offered = offered_worker_s(load, start_w, end_w, cap)
    admitted = [
        c["serving"] - c["granted"] for c in comps.values() if "serving" in c and "granted" in c
    ]
    return {
        "window_s": round(end_w - start_w, 1),
        "offered_worker_s": round(offered, 1),
        "served_worker_s": round(served, 1),
        "efficiency": round(served / offered, 3) if offered else None,
        "not_held_worker_s": round(max(0.0, offered - held), 1),
        "preparing_worker_s": round(preparing, 1),
        "draining_worker_s": round(draining, 1),
        "grants": len([c for c in comps.values() if "granted" in c]),
        "reclaims": len([c for c in comps.values() if "notice" in c]),
        "running_to_admitted_s": _spread(admitted),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def _wait_gone(job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if not out.stdout.strip():
            return
        time.sleep(2)
    raise RuntimeError(f"job {job_id} still in squeue after {timeout_s:.0f} s")


def run_one(
    config: Path, request: str, work: Path, segment: int, speedup: float, steps: int
) -> dict[str, Any]:
    """One run of ``config`` with ``request`` next to the replayed load."""
    doc = yaml.safe_load(config.read_text())
    doc["runs_dir"] = str(work / "runs")
    doc["elastic"]["request"] = request
    doc["run"]["steps"] = steps
    cap = int(doc["elastic"].get("max_workers", 4))
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    load_log = work / "load.jsonl"
    load = subprocess.Popen(
        [sys.executable, str(REPO / "slurm" / "replay-load"), "--segment", str(segment),
         "--speedup", str(speedup), "--nodes", "3", "--instances-per-node", "4",
         "--tag", f"bench-{request}", "--log", str(load_log)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(2)  # the load holds its nodes first: the master's job gets the fourth
    out = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", str(path), "--sbatch"],
        capture_output=True, text=True, check=True, cwd=REPO,
        env={**os.environ, "PEARL_HPC_CACHE": os.environ.get("PEARL_HPC_CACHE", str(work))},
    )  # fmt: skip
    master = out.stdout.split("batch job ")[1].split(",")[0]  # its log: RUN_DIR/batch-JOB.out
    try:
        _wait_gone(master, 3600)
        load.wait(3600)
    finally:
        load.terminate()
        subprocess.run(["scancel", master], check=False)
    run = RunDir(next((work / "runs").glob("*")))
    events = read_jsonl(run.events)
    summary = json.loads(run.summary.read_text())
    metrics = read_jsonl(run.metrics)
    figures = harvest_figures(events, read_jsonl(load_log), cap)
    figures["submit_to_running_s"] = _spread(summary["slurm"]["pending_s"])
    figures["steps"] = len(metrics)
    figures["lost_trajectories"] = sum(
        int(doc["run"]["num_groups"]) * int(doc["run"]["group_size"]) - m["trajectories"]
        for m in metrics
    )
    figures["run_dir"] = str(run.path)
    return figures


def main(
    config: str,
    segment: int,
    speedup: float,
    steps: int,
    as_json: bool,
    requests: tuple[str, ...] = REQUESTS,
    record_to: str = record.DEFAULT,
) -> int:
    unknown = [r for r in requests if r not in REQUESTS]
    if unknown:
        print(f"bench --harvest: --requests {','.join(unknown)}: use single and/or hetjob",
              file=sys.stderr)  # fmt: skip
        return 2
    if not (REPO / "slurm" / "replay-load").exists():
        print("bench --harvest: slurm/replay-load not found (needs a source checkout)",
              file=sys.stderr)  # fmt: skip
        return 2
    results = {}
    for request in requests:
        work = Path(tempfile.mkdtemp(prefix=f"pearl-harvest-{request}-"))  # kept: the runs
        print(f"harvest: {request} requests, segment {segment} at {speedup:g}x, in {work}",
              file=sys.stderr, flush=True)  # fmt: skip
        results[request] = run_one(Path(config), request, work, segment, speedup, steps)
    args = {"config": config, "segment": segment, "speedup": speedup, "steps": steps}
    ratios = {f"{r}: efficiency": results[r]["efficiency"] or 0.0 for r in requests}
    kept = {r: {k: v for k, v in res.items() if k != "run_dir"} for r, res in results.items()}
    record.append(record_to, "harvest", kept, ratios, {**args, "requests": list(requests)})
    if as_json:
        print(json.dumps(results, indent=1))
        return 0
    rows = [k for k in results[requests[0]] if k != "run_dir"]
    print(f"{'':26}" + "".join(f"{r:>22}" for r in requests))
    for key in rows:
        cells = [results[r][key] for r in requests]
        print(f"{key:26}" + "".join(f"{_cell(c):>22}" for c in cells))
    return 0


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['median']:g} / {value['max']:g} (n={value['n']})"
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
