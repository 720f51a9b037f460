"""Looking at a run directory: ``pearl-hpc status RUN_DIR`` and ``pearl-hpc report RUN_DIR``.

Both only read what the master writes (``journal.json``, ``metrics.jsonl``,
``events.jsonl``), so they work on a running, finished or dead run, from any shell.
``report`` draws the same figures as ``pearl-hpc simulate --report`` (step throughput
over time with the rollout-worker budget behind it, the role timeline), plus the
tracker's predicted rollout time next to the measured one.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pearl_hpc.core.window import run_end_s
from pearl_hpc.errors import PearlError
from pearl_hpc.master.records import StepMetrics, read_metrics, read_tables
from pearl_hpc.rundir import JournalError, RunDir, RunStatus, read_jsonl

_ROLE_LETTER = {"prefill": "P", "decode": "D", "colocated": "C"}


def _alive(pid: int) -> bool:
    """A process of this machine that runs (an exited one not yet reaped -- a zombie,
    e.g. a rank whose launcher was killed -- is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return "Z" not in line.split()[1]
    except OSError:
        pass
    return True


def run_status(run_dir: Path) -> dict[str, Any]:
    """The run's state as one dict (what ``status`` prints)."""
    run = RunDir(run_dir)
    if not run.journal.exists() and run.config.exists():
        return _before_journal(run)
    state = run.read_state()
    try:
        return _status_of(run_dir, state)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise JournalError(
            f"{RunDir(run_dir).journal}: corrupt journal ({type(exc).__name__}: {exc})"[:400]
        ) from None


def _before_journal(run: RunDir) -> dict[str, Any]:
    """A run whose master has written no journal yet: waiting for its job (no master),
    starting (a master holds the lock: the world's ranks and engines coming up), or
    failed at start (a rank recorded why)."""
    failure = run.read_failure()
    if failure is not None:
        status, since = RunStatus.FAILED, run.failure
    elif run.lock_held():
        status, since = RunStatus.STARTING, run.lock_file
    else:
        status, since = RunStatus.WAITING, run.config
    return {
        "run_dir": str(run.path),
        "status": status,
        "for_s": round(max(0.0, time.time() - since.stat().st_mtime)),
        "failure": failure,
    }


def _status_of(run_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    status = state["status"]
    if status == RunStatus.RUNNING and not _master_alive(run_dir, int(state["pid"])):
        status = RunStatus.DEAD
    slots = state["controller"]["table"]["slots"]
    rollout = [s for s in slots if s["role"] != "training"]
    metrics = read_metrics(run_dir)
    left_s = None  # the steps left at the pace of the last ones (the expansion gate's too)
    if status == RunStatus.RUNNING and metrics:
        end_s = run_end_s([m.t_s for m in metrics], state["steps"] - state["next_step"])
        left_s = round(end_s - metrics[-1].t_s) if math.isfinite(end_s) else None
    return {
        "run_dir": str(run_dir),
        "status": status,
        "pid": state["pid"],
        "step": state["next_step"],
        "steps": state["steps"],
        "version": state["version"],
        "t_s": state["t_s"],
        "left_s": left_s,
        "elastic_workers": state["elastic_workers"],
        # a finished run cancelled its elastic jobs (the journal's list is the last poll's)
        "elastic_jobs": [] if status == RunStatus.FINISHED else state.get("elastic_jobs", []),
        "borrowed": [
            s["slot_id"] for s in rollout if s["zone"] == "overlap" and s["status"] != "inactive"
        ],
        "workers": [
            {k: s[k] for k in ("slot_id", "role", "status", "zone", "gpu_ids")} for s in rollout
        ],
        "counters": {k: v for k, v in state["counters"].items() if not isinstance(v, list)},
        "last_step": asdict(metrics[-1]) if metrics else None,
        "failure": RunDir(run_dir).read_failure() if status != RunStatus.RUNNING else None,
    }


def format_pools(components: list[dict[str, Any]]) -> str:
    """``elastic: 2 running, 1 pending (start in ~4 min)`` per pool, from the backend's
    ``describe()`` (states: requested, pending, running, draining; the soonest of Slurm's
    expected starts of the pending ones; pure)."""
    pools: dict[str, dict[str, int]] = {}
    soonest: dict[str, int] = {}
    for c in components:
        pool = str(c.get("pool", "local"))
        states = pools.setdefault(pool, {})
        states[c["state"]] = states.get(c["state"], 0) + 1
        if "starts_in_s" in c:
            soonest[pool] = min(soonest.get(pool, c["starts_in_s"]), c["starts_in_s"])
    order = ("requested", "pending", "running", "draining", "releasing", "refused")

    def state(pool: str, k: str, n: int) -> str:
        if k != "pending" or pool not in soonest:
            return f"{n} {k}"
        return f"{n} {k} (start in ~{_duration(soonest[pool])})"

    return "; ".join(
        f"{pool}: " + ", ".join(state(pool, k, states[k]) for k in order if k in states)
        for pool, states in sorted(pools.items())
    )


def _duration(seconds: int) -> str:
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def format_status(doc: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    hint = ""
    failure = doc.get("failure")
    cause = [RunDir(Path(doc["run_dir"])).failure_line(failure)] if failure else []
    if "for_s" in doc:  # before the master's first journal
        what = {
            RunStatus.WAITING: "no master yet (its batch job waiting, or not started)",
            RunStatus.STARTING: "the world's ranks and engines coming up",
            RunStatus.FAILED: "failed at start",
        }[doc["status"]]
        when = f"{_duration(doc['for_s'])} ago" if failure else f"for {_duration(doc['for_s'])}"
        return "\n".join([f"{doc['run_dir']}: {doc['status']}: {what}, {when}", *cause])
    left = "" if doc.get("left_s") is None else f" (~{_duration(doc['left_s'])} left)"
    if doc["status"] in (RunStatus.DEAD, RunStatus.FAILED, RunStatus.STOPPED):
        hint = f"  (continue it: pearl-hpc run --resume {doc['run_dir']})"
    lines = [
        f"{doc['run_dir']}: {doc['status']}{hint}",
        f"step {doc['step']}/{doc['steps']}{left}, weights v{doc['version']}, "
        f"{doc['t_s']:.0f} s; elastic workers {doc['elastic_workers']}, "
        f"borrowed slots {doc['borrowed'] or 'none'}",
        "counters: " + ", ".join(f"{k} {v}" for k, v in doc["counters"].items()),
        *cause,
    ]
    if doc["elastic_jobs"]:
        lines.append("elastic workers by pool: " + format_pools(doc["elastic_jobs"]))
        lines.append(
            "elastic jobs: "
            + ", ".join(
                f"{c['component']} {c['state']} {','.join(c['nodes']) or '-'}"
                for c in doc["elastic_jobs"]
            )
        )
    last = doc["last_step"]
    if last:
        lines.append(
            f"last step {last['step']}: {last['tokens_per_s']:.0f} tok/s, reward "
            f"{last['mean_reward']:.3f}, rollout {last['rollout_s']:.1f} s "
            f"(predicted {last['predicted_s']:.1f} s as {last['config']}), off-policy "
            f"|log(pi_old/mu)| mean {last.get('mismatch_mean', 0.0):.4f} max "
            f"{last.get('mismatch_max', 0.0):.3f}, capped {last.get('capped_frac', 0.0):.1%}"
        )
    table = Table(title="workers")
    for col in ("slot", "role", "status", "zone", "GPUs"):
        table.add_column(col)
    for w in doc["workers"]:
        table.add_row(str(w["slot_id"]), w["role"], w["status"], w["zone"], ",".join(w["gpu_ids"]))
    console = Console(width=100, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
    return "\n".join(lines) + "\n" + cap.get()


def role_timeline(events: list[dict[str, Any]]) -> list[tuple[float, int, str, str]]:
    """``(t, slot, role, state)`` changes from the ``table`` events of a run."""
    out: list[tuple[float, int, str, str]] = []
    last: dict[int, tuple[str, str]] = {}
    for ev in read_tables(events):
        seen = set()
        for slot, role, status, zone in ev.slots:
            seen.add(slot)
            state = "inactive"
            if status == "active":
                state = "active-borrowed" if zone == "overlap" else "active"
            if last.get(slot) != (role, state):
                last[slot] = (role, state)
                out.append((ev.t_s, slot, role, state))
        for slot in set(last) - seen:  # gone from the table
            if last[slot][1] != "gone":
                out.append((ev.t_s, slot, last[slot][0], "gone"))
                last[slot] = (last[slot][0], "gone")
    return out


def write_run_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PearlError("report needs matplotlib: pip install -e '.[plots]'") from None
    from pearl_hpc.sim.report import finish_throughput_axes, plot_role_timeline, save_figure

    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else RunDir(run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise PearlError(f"{RunDir(run_dir).metrics}: no finished step yet; nothing to plot")
    timeline = role_timeline(read_jsonl(RunDir(run_dir).events))
    duration = max([m.t_s for m in metrics] + [t for t, *_ in timeline])
    if not math.isfinite(duration):
        paths = f"{RunDir(run_dir).metrics} or {RunDir(run_dir).events.name}"
        raise PearlError(f"{paths} has a time of {duration}")
    written = []

    # step throughput over time, active rollout workers (dedicated, borrowed) behind it
    fig, ax = plt.subplots(figsize=(10, 4.5))
    budget_ax = ax.twinx()
    # a step's throughput holds over the step: from the previous step's end to its own
    ends = [m.t_s for m in metrics]
    rates = [m.tokens_per_s for m in metrics]
    ax.step([ends[0] - metrics[0].rollout_s - metrics[0].train_s, *ends], [rates[0], *rates],
            where="pre", label="pearl (measured)")  # fmt: skip
    active: dict[int, str] = {}
    times, dedicated, borrowed = [0.0], [0], [0]
    for t, slot, _role, state in timeline:
        active[slot] = state
        times.append(t)
        dedicated.append(sum(1 for s in active.values() if s == "active"))
        borrowed.append(sum(1 for s in active.values() if s == "active-borrowed"))
    times.append(duration)
    dedicated.append(dedicated[-1])
    borrowed.append(borrowed[-1])
    budget_ax.step(times, dedicated, where="post", color="grey", alpha=0.4, label="dedicated")
    budget_ax.step(
        times,
        [d + b for d, b in zip(dedicated, borrowed, strict=True)],
        where="post",
        color="green",
        alpha=0.3,
        label="+ borrowed",
    )
    finish_throughput_axes(
        ax, budget_ax, "active rollout workers (grey; green with borrowed)", "run time (s)"
    )
    written.append(save_figure(plt, fig, out / "throughput.png"))

    path = out / "roles.png"
    plot_role_timeline(plt, timeline, duration, run_dir.name, path)
    written.append(path)

    # the tracker's prediction of each rollout next to the measured time
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [m.step for m in metrics]
    ax.plot(steps, [m.rollout_s for m in metrics], "o-", label="measured rollout")
    ax.plot(steps, [m.predicted_s for m in metrics], "s--", label="predicted (tracker)")
    for m in metrics:
        ax.annotate(m.config, (m.step, m.rollout_s), fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    written.append(save_figure(plt, fig, out / "prediction.png"))

    written.append(_plot_off_policy(plt, metrics, out / "off_policy.png"))

    path = out / "steps.md"
    head = (
        "| step | config | rollout s | predicted s | tokens/s | reward | borrowed | return s "
        "| staleness | mismatch mean | mismatch max | capped | clipped |"
    )
    rows = [head, "|" + "---|" * 13]
    for m in metrics:
        rows.append(
            f"| {m.step} | {m.config} | {m.rollout_s:.2f} | {m.predicted_s:.2f} | "
            f"{m.tokens_per_s:.0f} | {m.mean_reward:.3f} | "
            f"{'yes' if m.borrowed else 'no'} | {m.return_latency_s:.2f} | {m.max_staleness} | "
            f"{m.mismatch_mean:.4f} | {m.mismatch_max:.3f} | {m.capped_frac:.1%} | "
            f"{m.clip_frac:.1%} |"
        )
    path.write_text("\n".join(rows) + "\n")
    written.append(path)
    if RunDir(run_dir).summary.exists():  # the run has ended: it can be replayed
        from pearl_hpc.sim.replay import ReplayError

        try:
            written += _write_counterfactual(plt, run_dir, out)
        except ReplayError as exc:  # e.g. a resumed run: the report stands without it
            (out / "counterfactual.md").write_text(f"Not replayed: {exc}\n")
            written.append(out / "counterfactual.md")
    return written


TWIN = {"color": "crimson"}  # the simulated twin of the run, in both panels


def _write_counterfactual(plt: Any, run_dir: Path, out: Path) -> list[Path]:
    """The run replayed in the simulator, PEARL as configured and the other systems on
    the same inputs: ``counterfactual.md``, ``counterfactual.png``, and the document in
    ``summary.json`` (key ``counterfactual``)."""
    from pearl_hpc.sim import counterfactual as cf
    from pearl_hpc.sim.replay import load_run
    from pearl_hpc.sim.report import save_figure

    record = load_run(run_dir)
    doc = cf.counterfactual(record)
    md = out / "counterfactual.md"
    md.write_text(
        f"# {doc['run']}: measured, simulated, and what other systems would have done\n\n"
        f"Inputs (all from the run): {cf.format_inputs(doc)}\n\n"
        f"## The run against its simulated twin\n\n{cf.format_validation(doc)}\n\n"
        f"Not modelled: {cf.NOT_MODELLED}.\n\n"
        f"## Counterfactual: the same steps, capacity and costs\n\n{cf.format_systems(doc)}\n"
    )
    summary_path = RunDir(run_dir).summary
    summary = json.loads(summary_path.read_text())
    summary["counterfactual"] = doc
    tmp = summary_path.with_name(summary_path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, summary_path)

    fig, (ax, step_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    start = record.startup_s
    ax.axvspan(0, start, color="grey", alpha=0.2, label="start-up (engine starts)")
    ax.step([0, *(start + m.recorded_s for m in record.steps)], range(len(record.steps) + 1),
            where="post", color="black", linewidth=2.5, label="measured run")  # fmt: skip
    for row in [*doc["systems"][1:], doc["systems"][0]]:  # the twin drawn last, on top
        ends = [start + s["trained_s"] for s in row["per_step"]]
        twin = row["system"] == cf.PEARL
        name = "pearl (simulated)" if twin else row["system"]
        ax.step([0, *ends], range(len(ends) + 1), "-" if twin else "--", where="post",
                linewidth=2 if twin else 1, label=name, **(TWIN if twin else {}))  # fmt: skip
    ax.set_xlabel("run time (s)")
    ax.set_ylabel("steps trained")
    ax.legend(fontsize=7)
    steps = [m.step for m in record.steps]
    step_ax.plot(steps, [m.rollout_s for m in record.steps], "o-", color="black",
                 label="measured")  # fmt: skip
    simulated = [s["rollout_s"] for s in doc["systems"][0]["per_step"]]
    step_ax.plot(steps[: len(simulated)], simulated, "s--", label="pearl (simulated)", **TWIN)
    step_ax.set_xlabel("step")
    step_ax.set_ylabel("rollout seconds")
    step_ax.legend(fontsize=7)
    return [md, save_figure(plt, fig, out / "counterfactual.png")]


def _plot_off_policy(plt: Any, metrics: list[StepMetrics], path: Path) -> Path:
    """Per step: the gap between the trainer's pre-update policy and the engine's
    (mean and max |log(pi_old/mu)| per token), the share of tokens the importance-weight
    cap clamped or dropped, the clip fraction, and the batch's staleness."""
    fig, ax = plt.subplots(figsize=(8, 4))
    share_ax = ax.twinx()
    steps = [m.step for m in metrics]
    ax.plot(steps, [m.mismatch_mean for m in metrics], "o-", label="mean |log(pi_old/mu)|")
    ax.plot(steps, [m.mismatch_max for m in metrics], "^:", label="max |log(pi_old/mu)|")
    share_ax.plot(steps, [m.capped_frac for m in metrics], "s--", color="red", label="capped")
    share_ax.plot(steps, [m.clip_frac for m in metrics], "d--", color="purple", label="clipped")
    for m in metrics:
        ax.annotate(f"s{m.max_staleness}", (m.step, m.mismatch_mean), fontsize=7)
    ax.set_xlabel("step (annotated: the batch's staleness)")
    ax.set_ylabel("nats per token")
    share_ax.set_ylabel("share of policy tokens")
    lines = ax.get_legend_handles_labels()
    shares = share_ax.get_legend_handles_labels()
    ax.legend(lines[0] + shares[0], lines[1] + shares[1], fontsize=8)
    from pearl_hpc.sim.report import save_figure

    return save_figure(plt, fig, path)


def _master_alive(run_dir: Path, pid: int) -> bool:
    """A master on another node (the Slurm backend's may be): its lease file (touched
    every second) tells; one of this machine: its lock (the kernel drops a dead
    holder's) or its pid."""
    from pearl_hpc.backends.lease import LEASE_STALE_S, lease_owner

    lease = RunDir(run_dir).lease
    owner = lease_owner(lease)
    if owner is not None and owner[0] != os.uname().nodename:
        return time.time() - lease.stat().st_mtime < LEASE_STALE_S
    held = RunDir(run_dir).lock_held()
    if held is not None:
        return held
    if owner is not None:
        pid = owner[1]
    return pid > 0 and _alive(pid)
