"""The base job's engine ranks, each a failure domain of its own, kept by the launcher.

    pearl-hpc run ──the world (master + trainer ranks)──────────────────────────────┐
       │                                                                            │ MPI
       └──a launch per engine rank: gforker -n 1 | srun --overlap -w NODE ... rank engine
            ──> the rank joins the master as group rankN-A (like an elastic rank) ──┘

A launch that ends while the world lives is started again as the rank's next attempt
(``rankN-A+1``), up to ``run.max_restarts`` times per rank: its process died (SIGKILL,
OOM, a node's failure), or the master declared the rank failed (silent past the
heartbeat timeout, a command undelivered) and wrote ``RUN_DIR/domains/GROUP.lost``: that
launch is killed first (a stopped process does not end by itself). The master fails a
rank's old member when the rank joins again, re-registers it and gives its GPUs back to
the controller (``EngineRankBack``). A rank that left at the run's end
(``GROUP.left``) is not started again.

A first launch whose rank failed before it joined ends the world (a bad model or engine
setting: every relaunch would fail the same way); its error is the run's failure record.
Nothing here imports MPI, torch or vLLM: the launcher runs it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.comm.layout import ENGINE, RankSpec, base_layout, domain_group
from pearl_hpc.config.run import RunConfig
from pearl_hpc.rundir import RunDir

END_TIMEOUT_S = 10.0  # a launch not gone this long after SIGTERM is killed


@dataclass
class _Launch:
    spec: RankSpec
    attempt: int
    proc: subprocess.Popen[bytes]
    kill_at: float | None = None  # being ended: SIGKILL then

    @property
    def group(self) -> str:
        return domain_group(self.spec.rank, self.attempt)


class EngineDomains:
    """The launches of a world's engine ranks: :meth:`start`, then :meth:`tend` while
    the world runs, then :meth:`stop`."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        argv: Callable[[RankSpec, int], list[str]],
        *,
        env: dict[str, str],
        output: Any = None,
        child: Callable[[], None] | None = None,
    ) -> None:
        """``argv(spec, attempt)``: a launch's command (:func:`~.world.domain_argv`);
        ``output``: where the launchers' own output goes (the ranks log to the run
        directory); ``child``: run in each launch before exec."""
        self.run = RunDir(run_dir)
        self.argv = argv
        self.env = env
        self.output = output
        self.child = child
        self.max_restarts = cfg.run.max_restarts
        self.specs = [r for r in base_layout(cfg.workers, cfg.layout) if r.kind == ENGINE]
        self.launches: dict[int, _Launch] = {}  # by rank; a rank given up has none
        self._ending: list[_Launch] = []

    def start(self) -> None:
        """Every engine rank's first launch (marks of a previous world's cleared)."""
        self.run.domains.mkdir(mode=0o700, exist_ok=True)
        for mark in self.run.domains.iterdir():
            mark.unlink()
        for spec in self.specs:
            self._launch(spec, 0)

    def _launch(self, spec: RankSpec, attempt: int) -> None:
        proc = subprocess.Popen(
            self.argv(spec, attempt),
            env=self.env,
            stdout=self.output,
            stderr=subprocess.STDOUT if self.output is not None else None,
            preexec_fn=self.child,
            start_new_session=True,  # its own process group: ended as one
        )
        self.launches[spec.rank] = _Launch(spec, attempt, proc)

    def tend(self) -> int | None:
        """Start again what ended or was declared lost; the exit status the world must
        end with where a first launch failed before its rank joined (2: it refused its
        input), else None."""
        self._reap()
        for rank, launch in list(self.launches.items()):
            lost = self.run.domain_note(launch.group, "lost").exists()
            if launch.proc.poll() is None and not lost:
                continue
            if self.run.domain_note(launch.group, "left").exists():
                del self.launches[rank]  # the run is ending: it left
                continue
            self._end(launch)
            if launch.attempt == 0:
                note = self.run.read_failure()
                if note is not None and note.get("rank") == rank and not note.get("joined"):
                    return 2 if launch.proc.returncode == 2 else 1
            why = "declared failed by the master" if lost else f"ended ({self._status(launch)})"
            why += f"; its log: {self.run.rank_log(rank, ENGINE)}"
            if launch.attempt == self.max_restarts:
                del self.launches[rank]
                limit = f"run.max_restarts ({self.max_restarts}) launches of it failed"
                self._say(f"engine rank {rank} {why}; not started again: {limit}")
                continue
            again = f"{launch.attempt + 1} of {self.max_restarts}, run.max_restarts"
            self._say(f"engine rank {rank} {why}; starting it again ({again})")
            self._launch(launch.spec, launch.attempt + 1)
        return None

    def _say(self, line: str) -> None:
        """A line on the launcher's output (the world's, where it is a file)."""
        text = f"pearl-hpc run: {line}\n"
        if self.output is None:
            print(text, end="", file=sys.stderr, flush=True)
        else:
            self.output.write(text.encode())
            self.output.flush()

    @staticmethod
    def _status(launch: _Launch) -> str:
        code = launch.proc.returncode
        if code is None:
            return "running"
        return f"signal {-code}" if code < 0 else f"exit {code}"

    def _end(self, launch: _Launch) -> None:
        """SIGTERM its process group now (a rank that was stopped gets SIGKILL after
        ``END_TIMEOUT_S``, from :meth:`tend`)."""
        if launch.proc.poll() is None:
            _signal(launch.proc, signal.SIGCONT)
            _signal(launch.proc, signal.SIGTERM)
            launch.kill_at = time.monotonic() + END_TIMEOUT_S
            self._ending.append(launch)
        else:  # its rank may outlive the launcher that died (a srun step's task)
            _signal(launch.proc, signal.SIGKILL)

    def _reap(self) -> None:
        now = time.monotonic()
        for launch in self._ending:
            if launch.proc.poll() is None and launch.kill_at is not None and now > launch.kill_at:
                _signal(launch.proc, signal.SIGKILL)
                launch.kill_at = None
        self._ending = [x for x in self._ending if x.proc.poll() is None]

    def stop(self) -> None:
        """Every launch ended (the world did): SIGTERM, then SIGKILL after
        ``END_TIMEOUT_S``."""
        live = [*self.launches.values(), *self._ending]
        self.launches.clear()
        for launch in live:
            if launch.proc.poll() is None:
                _signal(launch.proc, signal.SIGTERM)
        deadline = time.monotonic() + END_TIMEOUT_S
        for launch in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launch.proc.wait(max(0.0, deadline - time.monotonic()))
            _signal(launch.proc, signal.SIGKILL)  # (its group: what outlived the launcher)
            launch.proc.wait()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
