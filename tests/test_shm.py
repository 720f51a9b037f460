"""Weight versions in the node's shared memory (pearl_hpc/weights/shm.py): staged by the
trainer in a tmpfs file, mapped back (in another process too) without a copy, removed once
superseded, and staged privately when the tmpfs has no room. Real files under /dev/shm."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pearl_hpc.weights.shm import (  # noqa: E402
    SHM_ROOT,
    SharedStore,
    map_version,
    shares_memory,
    stage_private,
    sweep,
)
from pearl_hpc.weights.wire import WeightSyncError  # noqa: E402
from tests.factories import run_reporting  # noqa: E402

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason=f"no {SHM_ROOT} on this machine")


@pytest.fixture
def store() -> Any:
    made = SharedStore.create(f"test-{uuid.uuid4().hex[:8]}")
    assert made is not None
    yield made
    made.close()


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g),
        "model.layers.1.mlp.up_proj.weight": torch.randn(5, 8, generator=g),
        "lm_head.weight": torch.randn(17, 8, generator=g),
        "model.position_ids": torch.arange(7),  # not floating: never cast
    }


def _raw(t: torch.Tensor) -> tuple[str, bytes]:
    """A tensor's dtype and bytes (plain values: a tensor itself would travel through
    torch's own shared memory and die with the process that sent it)."""
    return str(t.dtype), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _read_back(path: str, header: dict[str, Any], out: Any) -> None:
    """Another process maps the version and reports every tensor."""
    try:
        version, named = map_version(path, header)
        out.put((0, (version, {name: _raw(t) for name, t in named})))
    except BaseException as exc:
        out.put((0, repr(exc)))


def test_a_staged_version_maps_back_in_another_process_cast_and_unchanged(store) -> None:
    state = _state()
    staged = store.stage(state, 3, torch.bfloat16)
    assert staged.version == 3 and staged.path is not None and staged.header is not None
    assert Path(staged.path).parent == store.directory
    for name, tensor in state.items():  # the trainer's own views hold the cast copy
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(staged.state[name], want), name

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_read_back, args=(staged.path, staged.header, out), daemon=True)
    version, named = run_reporting([proc], out, {0}, timeout_s=120)[0]
    assert version == 3 and named.keys() == state.keys()
    assert all(named[k] == _raw(staged.state[k]) for k in state)
    assert named["model.position_ids"][0] == "torch.int64"


def test_a_staged_version_is_hashed_in_the_background_as_it_was_staged(store) -> None:
    """The digest hashed in the background once a version is staged (shared or private)
    is the staged copy's; not asked for, none is taken."""
    from pearl_hpc.weights.wire import digest

    state = _state()
    for staged in (
        store.stage(state, 4, torch.bfloat16, digest=True),
        stage_private(state, 4, torch.bfloat16, digest=True),
        stage_private(state, 4, digest=True),  # as it is (fp32): no copy, still hashed
    ):
        assert staged.digest is not None
        assert staged.digest.result() == digest(staged.state.items())
    assert store.stage(state, 5, torch.bfloat16).digest is None
    assert digest(stage_private(state, 4).state.items()) != digest(
        stage_private(state, 4, torch.bfloat16).state.items()
    )  # (the dtype is in it)


def test_a_mapping_is_private_and_outlives_the_file(store) -> None:
    """An engine's views stay valid after the trainer unlinks the version, and what the
    engine writes into them never reaches the file (or the trainer's view)."""
    first = store.stage(_state(0), 1)
    assert first.path is not None and first.header is not None
    _, named = map_version(first.path, first.header)
    views = dict(named)
    second = store.stage(_state(1), 2)
    store.unlink_before(2)
    assert not Path(first.path).exists() and second.path and Path(second.path).exists()
    assert all(torch.equal(views[k], first.state[k]) for k in views)
    views["lm_head.weight"].zero_()
    assert not torch.equal(first.state["lm_head.weight"], views["lm_head.weight"])
    # the same version staged again is a new file: a mapping of the old one stays whole
    again = store.stage(_state(2), 2)
    assert second.path is not None and again.path == second.path
    assert torch.equal(second.state["lm_head.weight"], _state(1)["lm_head.weight"])


def test_only_an_engine_that_reads_the_token_shares_the_memory(store) -> None:
    path, token = store.probe
    assert shares_memory(path, token)
    assert not shares_memory(path, token[::-1])
    assert not shares_memory(str(store.directory / "elsewhere"), token)
    # a process of this node (not a thread of this one) reads it too
    code = (
        "import sys; from pearl_hpc.weights.shm import shares_memory as s; print(s(*sys.argv[1:]))"
    )
    out = subprocess.run([sys.executable, "-c", code, path, token], capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_missing_or_foreign_file_is_named(store) -> None:
    staged = store.stage(_state(), 4)
    assert staged.path is not None and staged.header is not None
    wrong = {**staged.header, "shapes": [[1, 1], *staged.header["shapes"][1:]]}
    with pytest.raises(WeightSyncError, match="belongs to another version"):
        map_version(staged.path, wrong)
    os.unlink(staged.path)
    with pytest.raises(WeightSyncError, match="not on the trainer's node"):
        map_version(staged.path, staged.header)


def test_no_room_in_shared_memory_stages_privately(store, monkeypatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    staged = store.stage(_state(), 5, torch.bfloat16)
    assert staged.path is None and staged.header is None
    assert staged.state["lm_head.weight"].dtype == torch.bfloat16
    assert not list(store.directory.glob("v*"))  # nothing half-made left behind


def test_a_dead_trainers_leftovers_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = tmp_path / f"pearl-run-{int(dead.stdout)}"
    live = tmp_path / f"pearl-run-{os.getppid()}"
    other = tmp_path / f"pearl-other-{int(dead.stdout)}"
    reused = tmp_path / f"pearl-run-{os.getpid()}"  # a dead trainer had this pid
    for d in (left, live, other, reused):
        d.mkdir()
        (d / "v000001").write_bytes(b"x")
    made = SharedStore.create("run", root=tmp_path)
    assert made is not None
    assert not left.exists() and live.exists() and not other.exists()  # any run's
    assert made.directory == reused and not (reused / "v000001").exists()
    made.close()
    assert not made.directory.exists()
    assert SharedStore.create("run", root=tmp_path / "absent") is None


def test_mpich_segments_nobody_maps_are_swept(tmp_path: Path) -> None:
    """A segment of this user that no live process maps and older than the settling
    time goes; one mapped, one just made and another user's stay."""
    import mmap

    def segment(name: str, age_s: float) -> Path:
        path = tmp_path / f"mpich_shm_{name}"
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (path.stat().st_atime - age_s,) * 2)
        return path

    leaked, fresh, theirs = segment("leaked", 600), segment("fresh", 0), segment("theirs", 600)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)  # nobody's
    else:
        theirs.unlink()
    in_use = segment("in_use", 600)
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as _mapping:
        removed = sweep(tmp_path, settle_s=30)
    assert removed == [leaked.name]
    assert not leaked.exists() and fresh.exists() and in_use.exists()
