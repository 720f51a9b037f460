"""Data-parallel GRPO on real MPI-launched ranks: two gloo training ranks take the same
step as one process on the same batch, though their rows hold different numbers of
policy tokens (the loss is normalised by the minibatch's global token count), with the
off-policy correction acting on half the batch's tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pearl_hpc.engine.tinymodel import build_tiny_model  # noqa: E402
from pearl_hpc.train.grpo import GRPOTrainer  # noqa: E402
from tests.factories import uneven_batch  # noqa: E402
from tests.mpi_dp_rank import DP_CONFIG, OFF_POLICY  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich)")
def test_two_dp_ranks_take_the_single_process_step(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny")
    batch = uneven_batch()
    tokens = [sum(t.loss_mask()) for t in batch]
    assert len(set(tokens)) == len(tokens)  # every row a different policy-token count

    proc = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, "-m", "tests.mpi_dp_rank", str(model_dir),
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    initial = GRPOTrainer(model_dir, DP_CONFIG).state_dict()
    single = GRPOTrainer(model_dir, DP_CONFIG)
    stats = single.train_step(batch)
    expected = single.state_dict()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert 0 < stats.capped_frac < 1 and stats.behaviour_coverage < 1  # the weights act,
    assert 0 < stats.masked_sequences < 4  # and the sequence mask drops one of the four
    for report in reports:  # the group's loss, gradient norm and off-policy figures are
        # the whole batch's
        assert report["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-8)
        assert report["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
        for key in OFF_POLICY:
            assert report[key] == pytest.approx(getattr(stats, key), rel=1e-5), key
    for name, want in expected.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # replicated weights
        step_single = want - initial[name]
        step_dp = ranks[0][name] - initial[name]
        if step_single.norm() > 0:
            # fp32 sums in another order: up to 2.5e-5 (the embedding) on some CPUs,
            # whose kernels sum differently; a wrong normalisation is > 1e-2
            assert _relative(step_dp, step_single) < 1e-4, name
        else:
            assert step_dp.norm() == 0, name
