"""The data plane: pure group plans, and real gloo process groups on CPU — single-process
worlds in this process, and 3-4 spawned members re-partitioned between two epochs."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest

from pearl_hpc.comm.dataplane import (
    PD_GROUP,
    WEIGHTS_GROUP,
    DataPlane,
    DataPlaneError,
    GroupPlan,
    GroupSpec,
    Rendezvous,
    plan_groups,
    select_backend,
)
from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: pip install torch==2.13.0 (CPU) or 'pearl-hpc[dist]'",
)

T, P, D, C = Role.TRAINING, Role.PREFILL, Role.DECODE, Role.COLOCATED


# --------------------------------------------------------------------------- pure plans


def test_ranks_follow_natural_member_order_and_are_deterministic() -> None:
    roles = {"base:10": C, "base:2": T, "123+1:0": C, "base:1": C}
    plan = plan_groups(7, roles)
    assert plan.members == ("123+1:0", "base:1", "base:2", "base:10")
    assert plan.roles == (C, C, T, C)
    assert plan.world_size == 4 and plan.rank_of("base:10") == 3
    assert plan.prefix == "epoch/7"
    again = plan_groups(7, dict(reversed(list(roles.items()))))
    assert again == plan and again.digest == plan.digest
    assert plan_groups(8, roles).digest != plan.digest


def test_colocated_mix_has_only_the_weights_group_from_the_first_trainer() -> None:
    plan = plan_groups(1, {"w:3": T, "w:1": T, "w:0": C, "w:2": C})
    assert plan.groups == (GroupSpec(WEIGHTS_GROUP, (0, 1, 2, 3), source=1),)
    assert plan.weights_source == "w:1"
    assert not plan.has_group(PD_GROUP)
    with pytest.raises(DataPlaneError, match="pd needs at least one prefill and one decode"):
        plan.group(PD_GROUP)


def test_disaggregated_mix_adds_one_pd_group_of_prefill_and_decode() -> None:
    plan = plan_groups(2, {"a": D, "b": T, "c": P, "d": D, "e": C})
    assert [g.name for g in plan.groups] == [WEIGHTS_GROUP, PD_GROUP]
    assert plan.group(WEIGHTS_GROUP) == GroupSpec(WEIGHTS_GROUP, (0, 1, 2, 3, 4), source=1)
    assert plan.group(PD_GROUP) == GroupSpec(PD_GROUP, (0, 2, 3), source=None)


def test_no_trainer_means_no_broadcast_source_and_string_roles_are_accepted() -> None:
    plan = plan_groups(0, {"x": "prefill", "y": "decode"})
    assert plan.roles == (P, D)
    assert plan.weights_source is None
    assert plan.group(PD_GROUP).ranks == (0, 1)


@pytest.mark.parametrize(
    ("epoch", "roles", "match"),
    [
        (1, {}, "role map is empty"),
        (-1, {"a": T}, "epoch must be an int >= 0"),
        (True, {"a": T}, "epoch must be an int >= 0"),
        (1, {"": T}, "non-empty strings"),
        (1, {"master": T, "a": C}, "'master' owns the rendezvous store"),
        (1, {"a": "trainer"}, "has role 'trainer'; valid roles: prefill, decode"),
    ],
)
def test_bad_plans_name_the_problem(epoch: Any, roles: Mapping[str, Any], match: str) -> None:
    with pytest.raises(DataPlaneError, match=match):
        plan_groups(epoch, roles)


def test_unknown_member_is_named_with_the_members() -> None:
    with pytest.raises(DataPlaneError, match=r"'z' is not a member of epoch 3.*\(members: a, b\)"):
        plan_groups(3, {"a": T, "b": C}).rank_of("z")


def test_module_imports_and_plans_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pearl_hpc.comm import dataplane as d\n"
        "print(d.plan_groups(1, {'a': 'training', 'b': 'colocated'}).weights_source)\n"
        "try:\n    d.DataPlane().join('h', 1, d.plan_groups(1, {'a': 'training'}), 'a')\n"
        "except d.DataPlaneError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "a"
    assert "needs torch" in lines[1] and "pip install 'pearl-hpc[dist]'" in lines[1]


def test_backend_selection() -> None:
    assert select_backend("gloo") == "gloo"
    with pytest.raises(ConfigError, match="'mpi' is not one of auto, gloo, nccl"):
        select_backend("mpi")


@needs_torch
def test_auto_backend_picks_nccl_only_with_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        assert select_backend("auto") == select_backend("nccl") == "nccl"
    else:
        assert select_backend("auto") == "gloo"
        with pytest.raises(ConfigError, match=r"'nccl' needs CUDA.*'auto' or 'gloo'"):
            select_backend("nccl")


# --------------------------------------------------------------------------- one process


@pytest.fixture
def rendezvous() -> Iterator[Rendezvous]:
    with Rendezvous("127.0.0.1") as rv:
        yield rv


@needs_torch
def test_single_member_joins_broadcasts_leaves_and_rejoins(rendezvous: Rendezvous) -> None:
    import torch
    import torch.distributed as dist

    plane = DataPlane()
    for epoch in (1, 2):
        plane.join(rendezvous.host, rendezvous.port, plan_groups(epoch, {"a": T}), "a", "gloo")
        assert plane.joined and plane.rank == 0 and plane.backend == "gloo"
        weights = [torch.arange(3.0) * epoch]
        plane.broadcast(weights)
        assert weights[0].tolist() == [0.0, epoch, 2.0 * epoch]
        with pytest.raises(DataPlaneError, match="still in epoch"):
            plane.join(rendezvous.host, rendezvous.port, plan_groups(9, {"a": T}), "a")
        assert plane.leave() == ()
        assert not plane.joined and not dist.is_initialized()
    assert plane.leave() == ()  # leaving twice is a no-op


@needs_torch
def test_misuse_inside_an_epoch_is_refused(rendezvous: Rendezvous) -> None:
    import torch

    plane = DataPlane()
    with pytest.raises(DataPlaneError, match="has not joined"):
        plane.broadcast([torch.zeros(1)])
    plane.join(rendezvous.host, rendezvous.port, plan_groups(1, {"c": C}), "c", "gloo")
    try:
        with pytest.raises(DataPlaneError, match="no source for 'weights': no training member"):
            plane.broadcast([torch.zeros(1)])
        with pytest.raises(DataPlaneError, match="has no group 'pd'"):
            plane.send(torch.zeros(1), "c")
    finally:
        plane.leave()
    plane.join(rendezvous.host, rendezvous.port, plan_groups(2, {"t": T}), "t", "gloo")
    try:
        with pytest.raises(DataPlaneError, match="gloo backend needs cpu tensors"):
            plane.broadcast([torch.zeros(1, device="meta")])
        with pytest.raises(DataPlaneError, match="not contiguous"):
            plane.broadcast([torch.zeros(2, 2).t()])
    finally:
        plane.leave()


def _fake_peer(rendezvous: Rendezvous, plan: GroupPlan) -> Any:
    """A client on the epoch's keys, standing in for a member that misbehaves."""
    import torch.distributed as dist

    client = dist.TCPStore(rendezvous.host, rendezvous.port, None, False, timedelta(seconds=5))
    return dist.PrefixStore(plan.prefix, client)


@needs_torch
def test_missing_member_times_out_with_its_name(rendezvous: Rendezvous) -> None:
    plane = DataPlane()
    plan = plan_groups(1, {"a": T, "b": C, "c": C})
    _fake_peer(rendezvous, plan).set("rollcall/2", plan.digest)  # c arrived, b never does
    started = time.monotonic()
    with pytest.raises(DataPlaneError, match=r"'a' \(rank 0 of 3\) in epoch 1: b did not join"):
        plane.join(rendezvous.host, rendezvous.port, plan, "a", "gloo", timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert not plane.joined


@needs_torch
def test_different_plan_or_duplicate_id_is_named(rendezvous: Rendezvous) -> None:
    plan = plan_groups(1, {"a": T, "b": C})
    peer = _fake_peer(rendezvous, plan)
    peer.set("rollcall/1", "not-the-same-digest")
    with pytest.raises(DataPlaneError, match="b joined with a different plan"):
        DataPlane().join(rendezvous.host, rendezvous.port, plan, "a", "gloo", timeout_s=5)
    plan = plan_groups(2, {"a": T, "b": C})
    _fake_peer(rendezvous, plan).add("claim/1", 1)
    with pytest.raises(DataPlaneError, match="already joined as 'b'; member ids must be unique"):
        DataPlane().join(rendezvous.host, rendezvous.port, plan, "b", "gloo", timeout_s=5)


@needs_torch
def test_unreachable_store_is_a_clear_error() -> None:
    with Rendezvous("127.0.0.1") as rv:
        port = rv.port
    with pytest.raises(DataPlaneError, match=f"cannot reach the rendezvous store at .*:{port}"):
        DataPlane().join("127.0.0.1", port, plan_groups(1, {"a": T}), "a", "gloo", timeout_s=0.5)


# --------------------------------------------------------------------------- several processes

EPOCH_1 = plan_groups(1, {"base:0": T, "base:1": C, "base:2": C})
# a new elastic member arrives (rank 0 in natural order), the trainer moves to base:1
EPOCH_2 = plan_groups(2, {"base:0": P, "base:1": T, "base:2": D, "123+1:0": D})
JOIN_TIMEOUT_S = 30.0


def _weights(epoch: int) -> list[Any]:
    import torch

    return [
        torch.arange(6, dtype=torch.float32).reshape(2, 3) * epoch + 0.5,
        torch.tensor([epoch, -epoch, 2**40], dtype=torch.int64),
    ]


def _kv(plan: GroupPlan, src: str, dst: str) -> Any:
    import torch

    value = 100 * plan.epoch + 10 * plan.rank_of(src) + plan.rank_of(dst)
    return torch.full((4, 8), float(value), dtype=torch.bfloat16)


def _member(host: str, port: int, member_id: str, out: Any) -> None:
    """One spawned worker: every epoch it belongs to, join, receive the weights, hand KV
    from each prefill to each decode member, leave. Reports values and timings."""
    try:
        import torch

        plane, report = DataPlane(), {}
        for plan in (EPOCH_1, EPOCH_2):
            if member_id not in plan.members:
                continue
            started = time.perf_counter()
            plane.join(host, port, plan, member_id, "gloo", timeout_s=JOIN_TIMEOUT_S)
            joined, rank = time.perf_counter(), plane.rank
            role = plan.role_of(member_id)
            weights = _weights(plan.epoch)
            if role is not T:
                weights = [torch.zeros_like(t) for t in weights]
            plane.broadcast(weights)
            kv = {}
            if plan.has_group(PD_GROUP):
                prefill = [m for m in plan.members if plan.role_of(m) is P]
                decode = [m for m in plan.members if plan.role_of(m) is D]
                for src in prefill:
                    for dst in decode:
                        if member_id == src:
                            plane.send(_kv(plan, src, dst), dst)
                        elif member_id == dst:
                            buffer = torch.zeros(4, 8, dtype=torch.bfloat16)
                            plane.recv(buffer, src)
                            kv[src] = buffer.float().tolist()
            left_at = time.perf_counter()
            missing = plane.leave(timeout_s=JOIN_TIMEOUT_S)
            report[plan.epoch] = {
                "rank": rank,
                "weights": [t.tolist() for t in weights],
                "kv": kv,
                "missing": missing,
                "join_s": joined - started,
                "leave_s": time.perf_counter() - left_at,
            }
        out.put((member_id, report))
    except BaseException:
        out.put((member_id, traceback.format_exc()))


@needs_torch
def test_members_reform_groups_across_two_epochs() -> None:
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    member_ids = sorted(set(EPOCH_1.members) | set(EPOCH_2.members))
    with Rendezvous("127.0.0.1") as rv:
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_member, args=(rv.host, rv.port, m, out), daemon=True)
            for m in member_ids
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + 60
            while len(results) < len(procs):
                try:
                    member_id, report = out.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    pytest.fail(f"members {set(member_ids) - set(results)} did not report in time")
                results[member_id] = report
            for proc in procs:
                proc.join(timeout=15)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
    failed = {m: r for m, r in results.items() if isinstance(r, str)}
    assert not failed, "\n".join(f"--- {m}\n{r}" for m, r in failed.items())
    assert all(proc.exitcode == 0 for proc in procs)

    weights = {epoch: [t.tolist() for t in _weights(epoch)] for epoch in (1, 2)}
    for member_id in EPOCH_1.members:
        assert results[member_id][1]["weights"] == weights[1]
        assert results[member_id][1]["rank"] == EPOCH_1.rank_of(member_id)
        assert results[member_id][1]["missing"] == ()
    assert "123+1:0" not in EPOCH_1.members and 1 not in results["123+1:0"]
    for member_id in EPOCH_2.members:
        assert results[member_id][2]["weights"] == weights[2]
        assert results[member_id][2]["rank"] == EPOCH_2.rank_of(member_id)
    for decode in ("base:2", "123+1:0"):
        assert results[decode][2]["kv"] == {"base:0": _kv(EPOCH_2, "base:0", decode).tolist()}
    assert results["base:0"][2]["kv"] == {}
    timings = {
        m: {e: (r["join_s"], r["leave_s"]) for e, r in rep.items()} for m, rep in results.items()
    }
    print(f"join/leave seconds per member and epoch: {timings}")
