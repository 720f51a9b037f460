"""The trainer's checkpoints with torch.distributed.checkpoint, on real torch: a round
trip of weights, AdamW state and version; the save written while the next step runs; a
save killed half-way leaves the previous checkpoint loadable; retention; the export of a
checkpoint. Sharded (FSDP2 on two gloo ranks) and resharded: tests/test_grpo.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pearl_hpc.engine.tinymodel import TinyModelSpec, build_tiny_model  # noqa: E402
from pearl_hpc.rundir import RunDir  # noqa: E402
from pearl_hpc.train.checkpoint import (  # noqa: E402
    Checkpointer,
    checkpoint_of_version,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
)
from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from pearl_hpc.train.objective import TrainError  # noqa: E402
from tests.test_grpo import _uneven_batch  # noqa: E402

CONFIG = GRPOConfig(lr=1e-2, minibatch_size=5, weight_decay=0.1, max_staleness=100)


def _adam(trainer: GRPOTrainer) -> list[bytes]:
    return [
        state[key].numpy().tobytes()
        for state in trainer.optimizer.state.values()
        for key in sorted(state)
    ]


def _same_weights(a: GRPOTrainer, b: GRPOTrainer) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_checkpoint_resumes_weights_adamw_and_version_bitwise(
    model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    trainer = GRPOTrainer(model_dir, CONFIG)
    saver = Checkpointer(root, keep=2, sharded=False, lead=True)
    assert latest_checkpoint(root) is None
    for _ in range(3):
        trainer.train_step(_uneven_batch())
        saver.save(trainer)
    saver.save(trainer)  # v3 again (Slurm's warning, then the step's own): saved once
    saver.close()
    assert saver.take_saved() == [1, 2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["v000002", "v000003"]  # keep 2
    path = latest_checkpoint(root)
    assert path == root / "v000003" == checkpoint_of_version(root, 3)
    assert read_meta(path)["version"] == 3 and read_meta(path)["ranks"] == 1
    assert {p.stat().st_mode & 0o777 for p in path.iterdir()} == {0o600}  # private, all

    resumed = GRPOTrainer(model_dir, CONFIG)
    load_checkpoint(resumed, path)
    assert resumed.version == 3
    assert _same_weights(trainer, resumed) and _adam(trainer) == _adam(resumed)
    trainer.train_step(_uneven_batch())  # the next step is the same on both
    resumed.train_step(_uneven_batch())
    assert _same_weights(trainer, resumed) and _adam(trainer) == _adam(resumed)

    with pytest.raises(TrainError, match=r"no checkpoint of the weights after step 0.*kept: "
                       r"after steps 1, 2"):  # fmt: skip
        checkpoint_of_version(root, 1)
    with pytest.raises(TrainError, match="not a complete checkpoint"):
        load_checkpoint(resumed, root)


def test_a_checkpoint_of_another_model_is_refused_naming_it(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = GRPOTrainer(model_dir, CONFIG)
    trainer.train_step(_uneven_batch())
    saver = Checkpointer(tmp_path, keep=2, sharded=False, lead=True)
    saver.save(trainer)
    saver.close()
    other = build_tiny_model(tmp_path / "wide", TinyModelSpec(hidden_size=96))
    with pytest.raises(TrainError, match="does not fit the model in"):
        load_checkpoint(GRPOTrainer(other, CONFIG), tmp_path / "v000001")


# a model whose full state (fp32 weights and AdamW's two moments: 12 bytes a parameter)
# takes a while to write: 25M parameters, 0.3 GB
LARGER = TinyModelSpec(hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64)  # fmt: skip


@pytest.fixture(scope="module")
def larger_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("larger"), LARGER)


def test_the_save_is_written_while_the_next_step_trains(larger_dir: Path, tmp_path: Path):
    """The caller waits for the staging only: the next step starts before the checkpoint
    is on disk, and a save waits for the one in flight."""
    trainer = GRPOTrainer(larger_dir, CONFIG)
    trainer.train_step(_uneven_batch())
    saver = Checkpointer(tmp_path, keep=2, sharded=False, lead=True)
    blocked_s = saver.save(trainer)
    next_step_at = time.time()
    assert latest_checkpoint(tmp_path) is None  # still being written
    trainer.train_step(_uneven_batch())
    saver.save(trainer)  # waits for v1, then stages v2
    assert latest_checkpoint(tmp_path) == tmp_path / "v000001"
    saver.close()
    first = read_meta(tmp_path / "v000001")
    assert first["written_at"] > next_step_at  # the step ran while v1 was written
    assert blocked_s == pytest.approx(first["staged_s"], abs=1e-3)
    params = sum(p.numel() for p in trainer.model.parameters())
    assert 12 * params < first["bytes"] < 12.1 * params  # weights and both moments, fp32
    assert latest_checkpoint(tmp_path) == tmp_path / "v000002"


def _saver_killed_mid_write(root: str, model_dir: str, ready: Any) -> None:
    """Save v1 completely, then v2 with a file system that never finishes a file."""
    trainer = GRPOTrainer(model_dir, CONFIG)
    saver = Checkpointer(root, keep=2, sharded=False, lead=True)
    trainer.train_step(_uneven_batch())
    saver.save(trainer)
    saver.wait()
    os.fsync = lambda fd: time.sleep(3600)  # DCP fsyncs each file it writes
    trainer.train_step(_uneven_batch())
    saver.save(trainer)
    ready.set()
    time.sleep(3600)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_saver_killed_mid_write, args=(str(tmp_path), str(model_dir), ready))
    proc.start()
    try:
        assert ready.wait(120), "the saver did not start its second save"
        partial = tmp_path / "v000002"
        deadline = time.monotonic() + 60
        while not list(partial.glob("*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(partial.glob("*.distcp"))  # written, never completed
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.join()
    assert latest_checkpoint(tmp_path) == tmp_path / "v000001"
    resumed = GRPOTrainer(model_dir, CONFIG)
    load_checkpoint(resumed, latest_checkpoint(tmp_path))
    assert resumed.version == 1
    run = RunDir(tmp_path.parent)  # the resume's clean-up: the partial one goes
    (tmp_path.parent / "checkpoints").mkdir(exist_ok=True)
    os.rename(tmp_path / "v000002", run.checkpoints / "v000002")
    os.rename(tmp_path / "v000001", run.checkpoints / "v000001")
    assert run.drop_checkpoints(newer_than=5) == ["v000002"]
    assert run.drop_checkpoints(newer_than=0) == ["v000001"]  # a step never recorded
