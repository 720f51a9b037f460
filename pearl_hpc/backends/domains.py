"""The run's failure domains besides the master's world, kept by the launcher.

    pearl-hpc run ──the world: the master alone──────────────────────────────────────┐
       ├──the trainer ranks: gforker -n T | srun --overlap (hostfile) ... rank trainers │
       └──a launch per engine rank: gforker -n 1 | srun --overlap -w NODE ... rank engine
            each joins the master as group NAME-A (trainers-0, rank3-0), like an ──────┘
            elastic component (MPI)

A domain's ranks die together (the trainer ranks: FSDP's collectives) and nobody else
with them. A launch that ends while the world lives is started again as the domain's
next attempt (``NAME-A+1``), up to ``run.max_restarts`` times a domain: its process died
(SIGKILL, OOM, a node's failure), or the master declared a member failed (silent past
the heartbeat timeout, a command undelivered, its engine dead) and wrote
``RUN_DIR/domains/GROUP.lost``: that launch is ended first (a stopped process does not
end by itself; SIGKILL after ``END_TIMEOUT_S``). The trainer ranks start again from the
newest checkpoint the journal covers (newer ones are dropped first: their steps are
trained again); the master replays the steps after it and sends the step in flight
again. An engine rank, once it joins, is registered again and its GPUs go back to the
controller. A launch that left at the run's end (``GROUP.left``) is not started again.

The world ends (and the launcher's restart rules take over) when a first launch fails
before it joined (a bad model or setting: every relaunch would fail the same way; its
error is the run's failure record), or when the trainer ranks are given up. Nothing
here imports MPI, torch or vLLM: the launcher runs it.
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

from pearl_hpc.comm.layout import Domain, base_layout, domain_group, domains_of
from pearl_hpc.config.run import RunConfig
from pearl_hpc.errors import PearlError
from pearl_hpc.rundir import RunDir

END_TIMEOUT_S = 10.0  # a launch not gone this long after SIGTERM is killed


@dataclass
class _Launch:
    domain: Domain
    attempt: int
    proc: subprocess.Popen[bytes]
    kill_at: float | None = None  # being ended: SIGKILL then

    @property
    def group(self) -> str:
        return domain_group(self.domain.name, self.attempt)


class Domains:
    """The launches of a world's failure domains: :meth:`start`, then :meth:`tend` while
    the world runs, then :meth:`stop`."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        argv: Callable[[Domain, int], list[str]],
        *,
        env: dict[str, str],
        output: Any = None,
        child: Callable[[], None] | None = None,
    ) -> None:
        """``argv(domain, attempt)``: a launch's command (:func:`~.world.domain_argv`);
        ``output``: where the launchers' own output goes (the ranks log to the run
        directory); ``child``: run in each launch before exec."""
        self.run = RunDir(run_dir)
        self.argv = argv
        self.env = env
        self.output = output
        self.child = child
        self.max_restarts = cfg.run.max_restarts
        self.domains = domains_of(base_layout(cfg.workers, cfg.layout))
        self.launches: dict[str, _Launch] = {}  # by domain; a domain given up has none
        self._ending: list[_Launch] = []

    def start(self) -> None:
        """Every domain's first launch (marks of a previous world's cleared)."""
        self.run.domains.mkdir(mode=0o700, exist_ok=True)
        for mark in self.run.domains.iterdir():
            mark.unlink()
        for domain in self.domains:
            if domain.ranks:
                self._launch(domain, 0)

    def _launch(self, domain: Domain, attempt: int) -> None:
        proc = subprocess.Popen(
            self.argv(domain, attempt),
            env=self.env,
            stdout=self.output,
            stderr=subprocess.STDOUT if self.output is not None else None,
            preexec_fn=self.child,
            start_new_session=True,  # its own process group: ended as one
        )
        self.launches[domain.name] = _Launch(domain, attempt, proc)

    def tend(self) -> int | None:
        """Start again what ended or was declared lost; the exit status the world must
        end with (a first launch failed before it joined -- 2: it refused its input --,
        or the trainer ranks given up), else None."""
        self._reap()
        for name, launch in list(self.launches.items()):
            lost = self.run.domain_note(launch.group, "lost").exists()
            if launch.proc.poll() is None and not lost:
                continue
            if self.run.domain_note(launch.group, "left").exists():
                del self.launches[name]  # the run is ending: it left
                continue
            self._end(launch)
            if launch.attempt == 0 and self._failed_before_joining(launch):
                return 2 if launch.proc.returncode == 2 else 1
            why = "declared failed by the master" if lost else f"ended ({self._status(launch)})"
            what = _what(launch.domain)
            if launch.attempt == self.max_restarts:
                del self.launches[name]
                limit = f"run.max_restarts ({self.max_restarts}) launches of it failed"
                self._say(f"{what} {why}; not started again: {limit}")
                if launch.domain.vital:
                    return 1
                continue
            again = f"{launch.attempt + 1} of {self.max_restarts}, run.max_restarts"
            self._say(f"{what} {why}; starting it again ({again})")
            if launch.domain.vital:  # from the newest checkpoint the journal covers
                self._drop_unrecorded()
            self._launch(launch.domain, launch.attempt + 1)
        return None

    def _failed_before_joining(self, launch: _Launch) -> bool:
        note = self.run.read_failure()
        ranks = {r.rank for r in launch.domain.ranks}
        return note is not None and note.get("rank") in ranks and not note.get("joined")

    def _drop_unrecorded(self) -> None:
        """Checkpoints newer than the journal's version (and incomplete ones) go: the
        relaunched trainers take the newest the master recorded, and it replays from
        there."""
        with contextlib.suppress(PearlError, OSError, KeyError, ValueError):
            dropped = self.run.drop_checkpoints(int(self.run.read_state()["version"]))
            if dropped:
                self._say(f"checkpoints newer than the journal dropped: {', '.join(dropped)}")

    def _say(self, line: str) -> None:
        say(self.output, line)

    @staticmethod
    def _status(launch: _Launch) -> str:
        code = launch.proc.returncode
        if code is None:
            return "running"
        return f"signal {-code}" if code < 0 else f"exit {code}"

    def _end(self, launch: _Launch) -> None:
        """SIGTERM its process group now, then SIGCONT (SIGKILL after ``END_TIMEOUT_S``,
        from :meth:`tend`). SIGTERM first: a rank's default action ends a stopped process
        at once, where SIGCONT first would let it run (and send on its old link) until
        the SIGTERM arrives."""
        if launch.proc.poll() is None:
            _signal(launch.proc, signal.SIGTERM)
            _signal(launch.proc, signal.SIGCONT)
            launch.kill_at = time.monotonic() + END_TIMEOUT_S
            self._ending.append(launch)
        else:  # its ranks may outlive the launcher that died (gforker's other ranks)
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


def say(output: Any, line: str) -> None:
    """A line on the launcher's output (``output``: the world's, where it is a file)."""
    text = f"pearl-hpc run: {line}\n"
    if output is None:
        print(text, end="", file=sys.stderr, flush=True)
    else:
        output.write(text.encode())
        output.flush()


def _what(domain: Domain) -> str:
    if domain.vital:
        return "the trainer ranks"
    return f"engine rank {domain.ranks[0].rank}"


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
