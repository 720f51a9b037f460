"""Where a turn goes: the one routing rule of the real router and the simulator (pure).

Both :class:`pearl_hpc.rollout.router.RoutingTable` (live engines) and the simulator
(:mod:`pearl_hpc.sim.engine`) describe their workers as candidates ``(load, routed, key)``
-- requests in flight or queued on the worker, turns routed to it in total, its id -- and
ask this module. ``min`` over those tuples is the least-loaded worker with its tie-breaks
(fewest routed, then smallest id), so a choice is deterministic.

Policies (each simulated system uses its own; the real router uses ``sticky``):
- **sticky** (ROLL-like colocated serving, and the prefill side of PD): a turn goes back to
  the worker that holds its trajectory's prefix cache unless that worker carries more
  than ``slack + slack_ratio * least`` requests above the least-loaded one (``least``:
  that worker's load); otherwise the least loaded.
- **shortest-queue** (RLBoost+): always the least-loaded worker; prefixes are re-prefilled
  wherever the turn lands.
- **PD pairing**: the prefill worker is chosen by the policy above (it holds the prefix),
  the decode worker when the prefill's KV is ready, least loaded.

Mode: disaggregated when the role table has prefill workers and one prefill and one decode
worker admit turns; otherwise colocated when a colocated worker admits; otherwise whatever
can serve (during a transition colocated and P/D workers coexist).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from pearl_hpc.core.types import Mode

K = TypeVar("K", int, str)  # a worker's id: the simulator's slot, the router's name
Candidate = tuple[int, int, K]  # (load, routed, key)


class RoutingPolicy(StrEnum):
    STICKY = "sticky"
    SHORTEST_QUEUE = "shortest-queue"


@dataclass(frozen=True, slots=True)
class RoutingRule:
    policy: RoutingPolicy = RoutingPolicy.STICKY
    slack: int = 2  # extra requests tolerated on the prefix holder ...
    slack_ratio: float = 0.5  # ... plus this share of the least-loaded worker's load

    def pick(self, candidates: Sequence[Candidate[K]], last: K | None = None) -> K:
        """The worker for a turn whose prefix ``last`` holds (None: no prefix anywhere)."""
        held = None
        if last is not None:
            held = next((c for c in candidates if c[2] == last), None)
        return self.choose(min(candidates), held)

    def choose(self, best: Candidate[K], held: Candidate[K] | None) -> K:
        """:meth:`pick` given the least candidate ``best`` and the prefix holder's
        candidate ``held`` (None: no holder among the candidates): for a caller that
        keeps its candidates in a heap."""
        if self.policy is RoutingPolicy.STICKY and held is not None and held[2] != best[2]:
            limit = best[0] + self.slack + self.slack_ratio * best[0]
            return held[2] if held[0] <= limit else best[2]
        return best[2]


def route_mode(pd_preferred: bool, has_colocated: bool, has_pd: bool) -> Mode | None:
    """How the next turn is served (None: no admitting worker can serve it)."""
    if pd_preferred and has_pd:
        return Mode.DISAGGREGATED
    if has_colocated:
        return Mode.COLOCATED
    return Mode.DISAGGREGATED if has_pd else None
