"""Weight sync: the bucket format (pure), the version bookkeeping (pure), and real
gloo transfers between three spawned processes over weight groups (the run's
:class:`WeightGroup`): a broadcast of the tiny model, then a point-to-point send to a
member that joined in a later group."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pearl_hpc.engine.client import EngineClient  # noqa: E402
from pearl_hpc.engine.rpc import new_key  # noqa: E402
from pearl_hpc.engine.store import KeyStore  # noqa: E402
from pearl_hpc.errors import ConfigError, PearlError  # noqa: E402
from pearl_hpc.train.sync import MembersLost, WeightSync, WeightVersions  # noqa: E402
from pearl_hpc.weights.group import (  # noqa: E402
    WeightGroup,
    WeightStream,
    send_weights,
)
from pearl_hpc.weights.wire import (  # noqa: E402
    ALIGN_BYTES,
    WeightsHeader,
    WeightSyncError,
    block_of,
    describe,
    pack_bucket,
    unpack,
)
from tests.factories import run_reporting  # noqa: E402

TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per session; test_grpo.py's fixture reuses the same directory."""
    pytest.importorskip("transformers")
    from pearl_hpc.engine.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3")


def _bytes(tensor: Any) -> bytes:
    """The raw bytes (bit identity, NaN-safe)."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


# --------------------------------------------------------------------------- pack / unpack

DTYPES = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"]


@st.composite
def states(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    out = {}
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
        high = 2 if dtype == torch.bool else 256  # any bit pattern (NaNs too) but bad bools
        raw = torch.randint(0, high, (*shape, dtype.itemsize), generator=generator)
        tensor = raw.to(torch.uint8).view(dtype).reshape(shape)
        if tensor.dim() == 2 and draw(st.booleans()):
            tensor = tensor.t()  # non-contiguous input
        out[f"layer.{i}.weight"] = tensor
    return out


def _received(header: WeightsHeader, state: dict[str, Any]) -> list[tuple[str, Any]]:
    """What a receiver gets: each bucket packed, then cut back into views."""
    out = []
    for b in range(header.num_buckets):
        flat = pack_bucket(header, b, state)
        assert flat.dtype == torch.uint8 and flat.dim() == 1
        assert flat.numel() == header.bucket_bytes(b)
        for name, tensor in unpack(header, b, flat):
            if tensor.numel():  # an empty tensor has no address
                offset = tensor.data_ptr() - flat.data_ptr()
                assert offset % ALIGN_BYTES == 0 and 0 <= offset < flat.numel()  # aligned view
            out.append((name, tensor))
    return out


@settings(max_examples=60, deadline=None)
@given(states(), st.integers(0, 10**6), st.integers(1, 256))
def test_buckets_round_trip_bit_identical(state: dict[str, Any], version: int, limit: int) -> None:
    header = describe(state, version, bucket_bytes=limit)
    assert header.version == version and sorted(header.names) == sorted(state)
    out = _received(header, state)
    assert [name for name, _ in out] == list(header.names)
    for name, tensor in out:
        original = state[name]
        assert tensor.dtype == original.dtype and tensor.shape == original.shape, name
        assert _bytes(tensor) == _bytes(original), name
    assert WeightsHeader.from_dict(header.to_dict()) == header
    assert header.num_bytes == sum(header.bucket_bytes(b) for b in range(header.num_buckets))


def test_buckets_are_bounded_and_never_split_a_block() -> None:
    """Qwen-like names, interleaved: every block is whole in one bucket, in first-seen
    order; a bucket closes before a block that would take it past the bound; a block
    larger than the bound is a bucket of its own."""
    kib = torch.zeros(256)  # 1 KiB in fp32
    state = {
        "model.embed_tokens.weight": torch.zeros(1024),  # 4 KiB
        "model.layers.0.self_attn.q_proj.weight": kib,
        "model.layers.1.self_attn.q_proj.weight": kib,
        "model.layers.0.self_attn.k_proj.weight": kib,  # block 0 again: moved up
        "model.layers.0.mlp.experts.7.up_proj.weight": kib,
        "model.layers.1.mlp.gate_proj.weight": kib,
        "model.norm.weight": torch.zeros(4),
        "lm_head.weight": torch.zeros(1024),
    }
    header = describe(state, 1, bucket_bytes=3 * 1024)
    buckets = [[header.names[i] for i in header.bucket(b)] for b in range(header.num_buckets)]
    assert [{block_of(n) for n in names} for names in buckets] == [
        {"model.embed_tokens"},  # 4 KiB > bound: alone
        {"model.layers.0"},  # 3 KiB: fills the bound
        {"model.layers.1", "model.norm"},  # 2 KiB + norm; lm_head would pass the bound
        {"lm_head"},
    ]
    assert buckets[1] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.experts.7.up_proj.weight",
    ]
    assert describe(state, 1).num_buckets == 1  # the 1 GiB default: one bucket here
    assert block_of("model.layers.12.mlp.experts.3.w1") == "model.layers.12"
    assert block_of("lm_head.weight") == "lm_head" and block_of("scale") == "scale"


def test_unpack_returns_views_and_pack_copies() -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"w": weight, "b": torch.ones(3, dtype=torch.bfloat16)}
    header = describe(state)
    flat = pack_bucket(header, 0, state)
    weight += 100  # the packed copy does not follow the source
    (_, w), _ = unpack(header, 0, flat)
    assert w.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    flat.zero_()  # ...but the unpacked tensors are views of the bucket
    assert float(w.sum()) == 0.0


def test_header_and_buffer_mismatches_are_named() -> None:
    state = {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int64)}
    header = describe(state, 4)
    flat = pack_bucket(header, 0, state)
    with pytest.raises(WeightSyncError, match=r"bucket 0 has 8 bytes but the header \(version 4\)"):
        unpack(header, 0, flat[:8])
    with pytest.raises(WeightSyncError, match="1-d uint8"):
        unpack(header, 0, flat.view(torch.int32))
    with pytest.raises(WeightSyncError, match="changed after describe"):
        pack_bucket(header, 0, {**state, "a": torch.zeros(4)})
    fields = header.to_dict()
    for ends in ([1], [2, 2], [0, 2], [3], []):
        with pytest.raises(WeightSyncError, match="bucket ends"):
            WeightsHeader.from_dict({**fields, "bucket_ends": ends})
    with pytest.raises(WeightSyncError, match="'b' has dtype 'complex64'"):
        WeightsHeader.from_dict({**fields, "dtypes": ["float32", "complex64"]})
    with pytest.raises(WeightSyncError, match="2 names, 1 shapes"):
        WeightsHeader.from_dict({**fields, "shapes": [[3]]})
    with pytest.raises(WeightSyncError, match="malformed"):
        WeightsHeader.from_dict({"version": 1})
    with pytest.raises(WeightSyncError, match="empty"):
        describe({})
    with pytest.raises(WeightSyncError, match=r"'x' has dtype torch\.complex64"):
        describe({"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WeightSyncError, match="bucket size must be > 0"):
        describe(state, bucket_bytes=0)
    assert issubclass(WeightSyncError, PearlError)


# --------------------------------------------------------------------------- versions


def test_versions_staleness_boundary() -> None:
    versions = WeightVersions(max_staleness=1)
    versions.loaded("w0", 0)
    versions.loaded("w1", 0)
    assert versions.latest == 0 and versions.stale() == []
    versions.published(1)
    assert versions.stale() == ["w0", "w1"]
    assert versions.may_generate("w0")  # one behind: still allowed
    versions.published(2)
    assert not versions.may_generate("w0")  # two behind: must sync first
    versions.loaded("w0", 2)
    assert versions.may_generate("w0") and versions.stale() == ["w1"]
    assert versions.version_of("w0") == 2 and versions.version_of("nobody") is None


def test_versions_forget_and_unknown_workers() -> None:
    versions = WeightVersions(max_staleness=0)
    versions.published(3)
    assert not versions.may_generate("new")  # holds nothing yet
    versions.loaded("new", 3)
    assert versions.may_generate("new")
    versions.published(4)
    assert not versions.may_generate("new") and versions.stale() == ["new"]
    versions.forget("new")
    versions.forget("never-seen")  # no-op
    assert versions.stale() == [] and versions.version_of("new") is None
    versions.loaded("new", 1)  # a restarted worker may start from an older snapshot
    assert versions.version_of("new") == 1


def test_versions_reject_impossible_moves() -> None:
    versions = WeightVersions()
    versions.published(2)
    versions.published(2)  # re-publishing the latest is fine
    with pytest.raises(WeightSyncError, match="older than the latest"):
        versions.published(1)
    with pytest.raises(WeightSyncError, match="latest published is 2; call published"):
        versions.loaded("w", 3)
    versions.loaded("w", 2)
    with pytest.raises(WeightSyncError, match="cannot go back to 1; forget"):
        versions.loaded("w", 1)
    with pytest.raises(WeightSyncError, match="version must be an int >= 0"):
        versions.loaded("w", -1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="max_staleness"):
            WeightVersions(max_staleness=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- gloo, 3 processes

TRAINER, EARLY, LATE = "trainer:0", "rollout:1", "rollout:2"
# two membership epochs, each a weight group of its own (rank 0 the trainer)
EPOCH_1 = ("epoch1/", [TRAINER, EARLY])
EPOCH_2 = ("epoch2/", [TRAINER, EARLY, LATE])
TIMING_REPEATS = 5
SMALL_BUCKET = 1 << 16  # 64 KiB: the tiny model's syncs take several buckets


def _trained(state: dict[str, Any], version: int) -> dict[str, Any]:
    """Stand-in for optimizer steps: every tensor differs between versions."""
    return {name: tensor * 0.5**version + version for name, tensor in state.items()}


def _group(store: Any, epoch: tuple[str, list[str]], member_id: str) -> WeightGroup:
    prefix, members = epoch
    return WeightGroup(store, prefix, members.index(member_id), len(members), "gloo")


def _sync(
    wg: WeightGroup,
    state: dict[str, Any] | None,
    version: int,
    *,
    dst: int | None = None,
    read: Any = _bytes,
) -> tuple[int, dict[str, Any]]:
    """One sync as the source sends it (``state``) or a receiver takes it (None): the
    version and ``read`` of every tensor, taken from each bucket before the next lands."""
    if state is not None:
        send_weights(wg, state, version, dst=dst, bucket_bytes=SMALL_BUCKET)
        return version, {n: read(t) for n, t in state.items()}
    stream = WeightStream(wg, 0, p2p=dst is not None)
    got = {n: read(t) for n, t in stream}
    stream.finish()
    return stream.version, got


def _timed_broadcasts(wg: WeightGroup, state: dict[str, Any], mine: bool) -> dict[str, Any]:
    """Broadcast version 2 a few times (receivers copy each tensor out, as an engine's
    loader does), then one collective per tensor as the baseline."""
    v2 = _trained(state, 2)
    barrier = torch.zeros(1)
    bucketed_s, per_tensor_s = [], []
    for _ in range(TIMING_REPEATS):
        wg.all_reduce(barrier)
        started = time.perf_counter()
        _sync(wg, v2 if mine else None, 2, read=torch.clone)
        bucketed_s.append(time.perf_counter() - started)
        buffers = [t.clone() if mine else torch.empty_like(t) for t in v2.values()]
        wg.all_reduce(barrier)
        started = time.perf_counter()
        for tensor in buffers:
            wg.broadcast(tensor, 0)
            tensor.clone()  # the loader's copy, as above
        per_tensor_s.append(time.perf_counter() - started)
    return {
        "v2": _sync(wg, v2 if mine else None, 2),
        "bucketed_s": statistics.median(bucketed_s),
        "per_tensor_s": statistics.median(per_tensor_s),
    }


def _member(port: int, key: str, member_id: str, weights_file: str, out: Any) -> None:
    """A spawned member. Epoch 1 (trainer + early worker): the trainer broadcasts
    versions 0 and 1. Epoch 2 adds the late joiner: it gets version 1 point to point (the
    early worker, already current, takes no part), then all three take version 2 by
    broadcast, timed."""
    try:
        from safetensors.torch import load_file

        from pearl_hpc.engine.store import StoreClient

        store = StoreClient("127.0.0.1", port, key)
        state = load_file(weights_file)
        report: dict[str, Any] = {}
        mine = member_id == TRAINER
        if member_id != LATE:
            wg = _group(store, EPOCH_1, member_id)
            if mine:
                with pytest.raises(WeightSyncError, match="empty"):
                    send_weights(wg, {}, 0)  # refused before any collective
            for version in (0, 1):
                report[f"v{version}"] = _sync(
                    wg, _trained(state, version) if mine else None, version
                )
        wg = _group(store, EPOCH_2, member_id)
        late = EPOCH_2[1].index(LATE)
        if mine:
            _sync(wg, _trained(state, 1), 1, dst=late)
        elif member_id == LATE:
            report["late"] = _sync(wg, None, 1, dst=late)
        report.update(_timed_broadcasts(wg, state, mine))
        out.put((member_id, report))
    except BaseException:
        out.put((member_id, traceback.format_exc()))


def _weight_members(key: str, names: list[str], gpus: bool) -> dict[str, subprocess.Popen[str]]:
    """Engine-less members (tests/weight_member.py), each printing its RPC port (on
    GPUs 1, 2, ...: the trainer has GPU 0)."""
    argv = [sys.executable, "-m", "tests.weight_member", key]
    procs = {}
    for i, name in enumerate(names, start=1):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)} if gpus else None
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    return procs


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_members_lost_in_a_publish_are_named_and_the_rest_take_the_version(backend: str) -> None:
    """Three members; one SIGSTOPped (a silent node) and one SIGKILLed as a publish
    begins: the publish fails as MembersLost naming both, whichever error came first
    (the group aborted, the members probed), as does a new epoch's forming with them;
    the epoch formed without them takes the version. NCCL: the trainer lives through its
    aborted group."""
    if backend == "nccl" and torch.cuda.device_count() < 4:
        pytest.skip("NCCL weight groups: needs 4 GPUs (the trainer and three members)")
    key = new_key()
    procs = _weight_members(key, ["a", "b", "c"], gpus=backend == "nccl")
    device = "cuda" if backend == "nccl" else "cpu"
    state = {
        "w": torch.arange(1 << 20, dtype=torch.float32, device=device),
        "b": torch.ones(7, device=device),
    }
    try:

        async def main() -> tuple[list[str], int, int]:
            sync = WeightSync(key, backend=backend)  # no shared store: all in the group
            clients = {}
            for name, proc in procs.items():
                assert proc.stdout is not None
                clients[name] = EngineClient(name)
                clients[name]._rpc.liveness_s = 1.0  # a stopped member fails its call fast
                await clients[name].connect("127.0.0.1", int(proc.stdout.readline()), key)
            await sync.form(clients)
            await sync.publish(sync.stage(state, 1))
            os.kill(procs["b"].pid, signal.SIGSTOP)
            procs["c"].kill()
            v2 = sync.stage({k: t + 1 for k, t in state.items()}, 2)
            with pytest.raises(MembersLost) as lost:
                await sync.publish(v2)
            with pytest.raises(MembersLost) as lost_again:  # a new epoch asks each first
                await sync.form(clients)
            assert sorted(lost_again.value.names) == ["b", "c"]
            await sync.form({"a": clients["a"]})
            await sync.publish(v2)
            held = (await clients["a"].stats()).weight_version
            # the abandoned send to the stopped member ends with its socket (else at
            # the group's timeout): asyncio.run waits for that thread
            procs["b"].kill()
            sync.close()
            for client in clients.values():
                await client.close()
            return sorted(lost.value.names), held, sync.versions.latest

        names, held, latest = asyncio.run(main())
        assert names == ["b", "c"]
        assert held == latest == 2
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_three_members_broadcast_and_a_late_joiner_catches_up(tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    weights_file = str(tiny_model_dir / "model.safetensors")
    state = load_file(weights_file)
    assert "lm_head.weight" in state
    ctx = mp.get_context("spawn")
    members = [TRAINER, EARLY, LATE]
    key = new_key()
    store = KeyStore(key)  # the trainer's, here the test's
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_member, args=(store.port, key, m, weights_file, out), daemon=True)
        for m in members
    ]
    results = run_reporting(procs, out, set(members), timeout_s=2 * TIMEOUT_S)
    assert all(proc.exitcode == 0 for proc in procs)

    expected = {
        v: (v, {name: _bytes(t) for name, t in _trained(state, v).items()}) for v in (0, 1, 2)
    }
    assert expected[0][1] == {name: _bytes(t) for name, t in state.items()}  # v0: the file
    for member_id in (TRAINER, EARLY):
        assert results[member_id]["v0"] == expected[0], member_id
        assert results[member_id]["v1"] == expected[1], member_id
    assert results[LATE]["late"] == expected[1]
    assert "late" not in results[EARLY] and "v0" not in results[LATE]
    for member_id in members:
        assert results[member_id]["v2"] == expected[2], member_id

    header = describe(state, bucket_bytes=SMALL_BUCKET)
    assert header.num_buckets > 1
    trainer, receiver = results[TRAINER], results[EARLY]
    print(
        f"\ntiny model ({len(state)} tensors, {header.num_bytes / 2**20:.2f} MiB), gloo, "
        f"source + 2 receivers, median of {TIMING_REPEATS}: send_weights (header + "
        f"{header.num_buckets} buckets of <= {SMALL_BUCKET >> 10} KiB) "
        f"{trainer['bucketed_s'] * 1e3:.2f} ms at the source, "
        f"{receiver['bucketed_s'] * 1e3:.2f} ms at a receiver; one broadcast per tensor "
        f"{trainer['per_tensor_s'] * 1e3:.2f} ms"
    )
