"""How long granted elastic capacity stays, estimated online from the run's own grants
and reclaims (pure; times are passed in).

Each elastic component's stay is a lifetime from its grant to its reclaim. A component
the run still holds, or gave back itself, is a lifetime cut short (censored: it stayed
at least that long). With lifetimes taken as exponential, the estimate of the mean stay
is the observed time over the number of reclaims; the configured window enters as one
prior lifetime, so a run without history uses ``expected_capacity_window_s``::

    window_s = (prior_s + sum of every stay so far, ended or not) / (1 + reclaims)

A cluster whose capacity comes and goes quickly lowers the window, and with it the
saving the expansion gate credits a new worker; capacity that stays raises it.

Capacity is worth nothing after the run ends: the window is cut at the run's predicted
end (:func:`run_end_s`, from its steps' pace), and for a request the scheduler starts
later, at its expected start (:func:`usable_window_s`)::

    usable_s = max(0, min(window_s, run_end_s - now - starts_in_s))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PACE_STEPS = 4  # the run's pace: the mean period of its last few steps


@dataclass
class CapacityWindow:
    """Grant / reclaim history -> expected stay of the next grant, seconds."""

    prior_s: float  # the configured window: one prior lifetime
    ended_s: float = 0.0  # summed stays of components that are gone
    reclaims: int = 0  # stays the scheduler ended (a reclaim, not the run's release)
    held: dict[str, float] = field(default_factory=dict)  # tag -> granted at, still held

    def granted(self, tag: str, now_s: float) -> None:
        self.held.setdefault(tag, now_s)

    def ended(self, tag: str, now_s: float, *, reclaimed: bool) -> None:
        """``tag`` is gone: reclaimed by the scheduler, or given back by the run (then
        its stay only says it lasted at least that long)."""
        start = self.held.pop(tag, None)
        if start is None:
            return
        self.ended_s += max(0.0, now_s - start)
        self.reclaims += int(reclaimed)

    def estimate_s(self, now_s: float) -> float:
        """The expected stay of capacity granted now."""
        live = sum(max(0.0, now_s - t) for t in self.held.values())
        return (self.prior_s + self.ended_s + live) / (1 + self.reclaims)

    def to_dict(self) -> dict[str, Any]:
        return {"ended_s": self.ended_s, "reclaims": self.reclaims, "held": dict(self.held)}

    def restore(self, data: dict[str, Any]) -> None:
        self.ended_s = float(data["ended_s"])
        self.reclaims = int(data["reclaims"])
        self.held = {str(k): float(v) for k, v in data["held"].items()}


def run_end_s(step_ends_s: Sequence[float], steps_left: int) -> float:
    """When the run is predicted to end: the last step's end plus the steps left at the
    mean period of the last :data:`PACE_STEPS` steps (run clock); ``inf`` before two
    steps have ended (the first one's period includes the start)."""
    if steps_left <= 0:
        return step_ends_s[-1] if step_ends_s else 0.0
    recent = step_ends_s[-(PACE_STEPS + 1) :]
    if len(recent) < 2:
        return math.inf
    period_s = (recent[-1] - recent[0]) / (len(recent) - 1)
    return recent[-1] + steps_left * period_s


def usable_window_s(
    window_s: float, now_s: float, end_s: float = math.inf, starts_in_s: float = 0.0
) -> float:
    """The expected stay of capacity that starts ``starts_in_s`` from now, cut at the
    run's predicted end ``end_s``."""
    return max(0.0, min(window_s, end_s - now_s - starts_in_s))
