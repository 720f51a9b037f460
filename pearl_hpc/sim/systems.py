"""The simulated systems: each is a configuration of the same simulator + controller.

| system      | rollout GPUs                       | PD        | borrowing | expansion | router  |
|-------------|------------------------------------|-----------|-----------|-----------|---------|
| roll        | 4 fixed                            | colocated | none      | -         | sticky  |
| roll-large  | 14 / 10 / 12 fixed (segment 1/2/3) | colocated | none      | -         | sticky  |
| rlboost+    | 4 reserved + trace                 | colocated | none      | always    | shortest|
| pd-only     | as given                           | adaptive  | none      | gated     | sticky  |
| pd+toggle   | as given                           | adaptive  | ungated   | gated     | sticky  |
| pearl       | as given (4 reserved + trace)      | adaptive  | gated     | gated     | sticky  |
| pearl+      | as pearl, + tail_start, local_prefill | adaptive | gated  | gated     | sticky  |
| pearl+tail  | as pearl, + tail_start only        | adaptive  | gated     | gated     | sticky  |
| pearl+local | as pearl, + local_prefill only     | adaptive  | gated     | gated     | sticky  |
| pearl+dispatch | as pearl, + tail_dispatch only  | adaptive  | gated     | gated     | sticky  |
| pearl+tail+dispatch | as pearl, + tail_start, tail_dispatch | adaptive | gated | gated | sticky |
| pearl+inplace | as pearl, role changes in place (no restart) | adaptive | gated | gated | sticky |
| static-XPYD | fixed                              | fixed X:Y | none      | -         | sticky  |
| static-coloc| fixed                              | colocated | none      | -         | sticky  |

``pearl+`` is PEARL with the policies of "beyond PEARL" that pay (``PolicyConfig``), and
``pearl+tail`` / ``pearl+local`` / ``pearl+dispatch`` each of them alone (the ablation;
``pearl+tail+dispatch`` the two that interact): ``tail_start``, the
next batch's trajectories start while this batch's tail leaves the workers idle (within
the staleness bound) instead of after its last trajectory; ``local_prefill``, in
disaggregated mode a turn is prefilled on the decode worker holding its prefix when that
is cheaper than the transfer (conditional disaggregation); ``tail_dispatch``, each
worker's queued turns go oldest batch first, then longest predicted remaining work;
``prewarm``, an elastic joiner catches up to the latest weights in its own background
before admission instead of pausing every worker's admission for finalisation.
``pearl+inplace`` changes roles the way pearl_hpc's engines do (NIXL ``kv_both``: a drain
and a new label) instead of PEARL's measured restart.

Routers are :mod:`pearl_hpc.core.routing`'s (the real router's): ``sticky`` keeps a turn on
the worker holding its prefix (colocated, or the prefill side of PD; decode goes to the
least loaded), ``shortest`` (shortest-queue) sends every turn to the least-loaded worker.
``--router sticky|shortest-queue`` gives every system the same one.

RLBoost+ (RLBoost adapted to asynchronous agentic RL) gets everything its design has:
elastic replicas from the same trace, weight pull by joining instances (the same
preparation cost as ours), token-level migration of interrupted responses (the shared
interrupt path), and every grant admitted at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.core.policies import BorrowingName, ExpansionName, PDPolicyName, PolicyConfig
from pearl_hpc.core.routing import RoutingPolicy, RoutingRule
from pearl_hpc.sim.costmodel import SimConfigError
from pearl_hpc.sim.entities import SimSetup

SYSTEMS = ("roll", "roll-large", "rlboost+", "pd-only", "pd+toggle", "pearl", "pearl+")
BEYOND: dict[str, dict[str, Any]] = {  # pearl + the policies beyond PEARL, with and apart
    # tail_dispatch and prewarm are not in pearl+: on the traces they move throughput by
    # about as much as the noise (docs/benchmarks.md, beyond PEARL)
    "pearl+": {"tail_start": True, "local_prefill": True},
    "pearl+tail": {"tail_start": True},
    "pearl+local": {"local_prefill": True},
    "pearl+dispatch": {"tail_dispatch": True},
    "pearl+prewarm": {"prewarm": True},
    "pearl+tail+dispatch": {"tail_start": True, "tail_dispatch": True},
}
ROLL_LARGE_GPUS = {1: 14, 2: 10, 3: 12}
RESERVED_ROLLOUT_GPUS = 4
TRAINING_GPUS = 16
ROUTERS = ("own", *(p.value for p in RoutingPolicy))  # own: each system's router


def _policy(
    base: PolicyConfig,
    pd: PDPolicyName,
    borrowing: BorrowingName,
    expansion: ExpansionName = ExpansionName.GATED,
    fraction: float = 0.5,
) -> PolicyConfig:
    return replace(
        base, pd_policy=pd, borrowing=borrowing, expansion=expansion, prefill_fraction=fraction
    )


def _check_gpus(what: str, count: int, tp: int) -> None:
    if count < tp or count % tp:
        raise SimConfigError(
            f"{what} = {count} cannot be split into TP{tp} workers: use a multiple of {tp} "
            "or change --tp"
        )


def make_setup(
    name: str,
    *,
    base: PolicyConfig,
    trace: AvailabilityTrace | None,
    segment: int | None,
    rollout_gpus: int | None,
    training_gpus: int = TRAINING_GPUS,
    tp: int = 2,
    routing: RoutingPolicy | None = None,  # None: the system's own
) -> SimSetup:
    """``rollout_gpus`` set = fixed resources (no elastic trace) for every system."""
    adaptive, coloc = PDPolicyName.ADAPTIVE, PDPolicyName.COLOCATED
    none, gated, ungated = BorrowingName.NONE, BorrowingName.GATED, BorrowingName.UNGATED
    fixed = rollout_gpus is not None

    def setup(policy: PolicyConfig, gpus: int, elastic: bool, overlap: bool) -> SimSetup:
        own = RoutingPolicy.SHORTEST_QUEUE if name == "rlboost+" else RoutingPolicy.STICKY
        return SimSetup(
            name,
            policy,
            reserved_rollout_gpus=gpus,
            training_gpus=training_gpus,
            elastic=trace if elastic and not fixed else None,
            overlap=overlap,
            routing=RoutingRule(routing or own),
        )

    reserved = rollout_gpus if rollout_gpus is not None else RESERVED_ROLLOUT_GPUS
    _check_gpus("--rollout-gpus" if fixed else "reserved rollout GPUs", reserved, tp)
    _check_gpus("--training-gpus", training_gpus, tp)
    if name == "roll":  # 4 GPUs, or the fixed resources every system gets
        return setup(_policy(base, coloc, none), reserved, False, False)
    if name == "roll-large":
        gpus = rollout_gpus if rollout_gpus is not None else ROLL_LARGE_GPUS.get(segment or 0)
        if gpus is None:
            raise SimConfigError("roll-large needs --segment 1|2|3 or --rollout-gpus N")
        _check_gpus("roll-large rollout GPUs", gpus, tp)
        return setup(_policy(base, coloc, none), gpus, False, False)
    if name == "rlboost+":
        return setup(_policy(base, coloc, none, ExpansionName.ALWAYS), reserved, True, False)
    if name == "pd-only":
        return setup(_policy(base, adaptive, none), reserved, True, False)
    if name == "pd+toggle":
        return setup(_policy(base, adaptive, ungated), reserved, True, True)
    if name == "pearl":
        return setup(_policy(base, adaptive, gated), reserved, True, True)
    if name in BEYOND:
        return setup(replace(_policy(base, adaptive, gated), **BEYOND[name]), reserved, True, True)
    if name == "pearl+inplace":
        return replace(
            setup(_policy(base, adaptive, gated), reserved, True, True), rerole_in_place=True
        )
    if name == "static-coloc":
        return setup(_policy(base, coloc, none), reserved, False, False)
    if name.startswith("static-") and name.endswith("D") and "P" in name:
        p_text, d_text = name[len("static-") : -1].split("P")
        num_p, num_d = int(p_text), int(d_text)
        workers = reserved // tp
        if num_p + num_d != workers or num_p < 1 or num_d < 1:
            raise SimConfigError(f"{name}: needs {workers} workers in all, got {num_p + num_d}")
        policy = _policy(base, PDPolicyName.FIXED_RATIO, none, fraction=num_p / workers)
        return setup(policy, reserved, False, False)
    raise SimConfigError(
        f"unknown system {name!r}; known: {', '.join(SYSTEMS)}, "
        f"{', '.join(n for n in BEYOND if n != 'pearl+')}, pearl+inplace, "
        "static-coloc, static-<P>P<D>D"
    )
