"""The GRPO objective on hand-built tensors: each correction, aggregation and KL variant
against a formula written here from the papers' definitions (loop over tokens, plain
Python floats), values and gradients."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from pearl_hpc.rollout.types import Segment, Trajectory  # noqa: E402
from pearl_hpc.train.objective import (  # noqa: E402
    TrainError,
    behaviour_weights,
    chunked_logprobs,
    group_advantages,
    grpo_loss,
)

LOW, HIGH = 0.2, 0.28  # the clip range [1 - LOW, 1 + HIGH] (clip-higher)
CAP = 2.0
NAN = math.nan

# two sequences of four tokens; the second's last token is padding, its first has no mu
OLD = [[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.4, 0.0]]
MU = [[-1.9, -0.4, -2.1, -1.5], [NAN, -1.0, -0.2, NAN]]
NEW = [[-0.8, -0.6, -1.7, -0.1], [-0.9, -1.0, -0.1, 0.0]]
REF = [[-1.1, -0.5, -1.8, -0.4], [-0.6, -1.1, -0.5, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
ADV = [1.0, -0.5]


def _reference_token_losses(correction: str, new: list[list[float]] = NEW) -> list[list[float]]:
    """-w min(r A, clip(r) A) per token, w = pi_old / mu: 1 (none or no mu), min(w, C)
    (tis, TRL / slime), w if w <= C else 0 (decoupled, AReaL)."""
    out = []
    for b in range(2):
        row = []
        for t in range(4):
            r = math.exp(new[b][t] - OLD[b][t])
            a = ADV[b]
            surrogate = min(r * a, min(max(r, 1 - LOW), 1 + HIGH) * a)
            w = 1.0
            if not math.isnan(MU[b][t]) and correction != "none":
                raw = math.exp(OLD[b][t] - MU[b][t])
                w = min(raw, CAP) if correction == "tis" else (raw if raw <= CAP else 0.0)
            row.append(-w * surrogate)
        out.append(row)
    return out


def _tensors(requires_grad: bool = True):
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=requires_grad)
    old = torch.tensor(OLD, dtype=torch.float64)
    mu = torch.tensor(MU, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)
    return new, old, mu, mask, adv


def _ours(correction: str, **kwargs):
    new, old, mu, mask, adv = _tensors()
    c = behaviour_weights(old, mu, mask, correction=correction, cap=CAP)
    loss, metrics = grpo_loss(
        new, old, adv, mask, clip_low=LOW, clip_high=HIGH, weights=c.weights, **kwargs
    )
    loss.backward()
    return loss, new.grad, metrics, c


def _reference_grad(fn) -> torch.Tensor:
    """d fn / d NEW by central differences (fn takes the NEW matrix as lists)."""
    grad = torch.zeros(2, 4, dtype=torch.float64)
    h = 1e-6
    for b in range(2):
        for t in range(4):
            up = [row[:] for row in NEW]
            down = [row[:] for row in NEW]
            up[b][t] += h
            down[b][t] -= h
            grad[b, t] = (fn(up) - fn(down)) / (2 * h)
    return grad


def _bnpo_of(correction: str):
    def loss(new: list[list[float]]) -> float:
        per = _reference_token_losses(correction, new)
        return sum(per[b][t] * MASK[b][t] for b in range(2) for t in range(4)) / 7

    return loss


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_each_correction_equals_its_formula_in_value_and_gradient(correction: str) -> None:
    loss, grad, _, _ = _ours(correction)
    reference = _bnpo_of(correction)
    assert float(loss.detach()) == pytest.approx(reference(NEW), rel=1e-12)
    assert torch.allclose(grad, _reference_grad(reference), atol=1e-7)


def test_none_is_the_uncorrected_surrogate_of_before() -> None:
    """``none`` (weights all 1) gives what grpo_loss gave with no weights at all."""
    new, old, mu, mask, adv = _tensors()
    c = behaviour_weights(old, mu, mask, correction="none")
    assert torch.equal(c.weights, torch.ones_like(old))
    with_weights, _ = grpo_loss(
        new, old, adv, mask, clip_low=LOW, clip_high=HIGH, weights=c.weights
    )
    without, _ = grpo_loss(new, old, adv, mask, clip_low=LOW, clip_high=HIGH)
    assert float(with_weights.detach()) == float(without.detach())


def test_the_correction_reports_the_gap_and_what_the_cap_did() -> None:
    _, old, mu, mask, _ = _tensors(requires_grad=False)
    gaps = [
        abs(OLD[b][t] - MU[b][t])
        for b in range(2)
        for t in range(4)
        if MASK[b][t] and not math.isnan(MU[b][t])
    ]
    over = sum(
        1
        for b in range(2)
        for t in range(4)
        if MASK[b][t] and not math.isnan(MU[b][t]) and math.exp(OLD[b][t] - MU[b][t]) > CAP
    )
    c = behaviour_weights(old, mu, mask, correction="tis", cap=CAP)
    assert c.measured_tokens == len(gaps) == 6
    assert c.mismatch_sum == pytest.approx(sum(gaps))
    assert c.mismatch_max == pytest.approx(max(gaps))
    assert c.capped_tokens == over == 2  # exp(0.9) = 2.5 and exp(1.2) = 3.3 exceed 2
    assert behaviour_weights(old, mu, mask, correction="none").capped_tokens == 0


def test_the_sequence_mask_drops_a_sequence_too_far_off_policy() -> None:
    _, old, mu, mask, _ = _tensors(requires_grad=False)
    # mean |log w|: sequence 0 (0.9 + 0.1 + 0.1 + 1.2) / 4 = 0.575; sequence 1: 0.2
    c = behaviour_weights(old, mu, mask, correction="tis", sequence_mask=0.5)
    assert c.masked_sequences == 1
    assert torch.all(c.weights[0] == 0) and torch.all(c.weights[1] > 0)
    kept = behaviour_weights(old, mu, mask, correction="tis", sequence_mask=0.6)
    assert kept.masked_sequences == 0


def test_loss_aggregations_are_trls() -> None:
    per = _reference_token_losses("tis")
    tokens = [sum(MASK[b]) for b in range(2)]
    sums = [sum(per[b][t] * MASK[b][t] for t in range(4)) for b in range(2)]
    grpo = sum(s / n for s, n in zip(sums, tokens, strict=True)) / 2
    dr_grpo = sum(sums) / (2 * 16)
    assert float(_ours("tis", loss_type="grpo")[0]) == pytest.approx(grpo, rel=1e-12)
    assert float(_ours("tis", loss_type="dr_grpo", max_completion_tokens=16)[0]) == pytest.approx(
        dr_grpo, rel=1e-12
    )
    with pytest.raises(TrainError, match="loss_type"):
        _ours("tis", loss_type="mean")


@pytest.mark.parametrize("bias_correction", [False, True])
def test_the_k3_term_with_and_without_the_ratio(bias_correction: bool) -> None:
    beta = 0.1

    def loss(new: list[list[float]]) -> float:
        total = 0.0
        for b in range(2):
            for t in range(4):
                r = math.exp(new[b][t] - OLD[b][t])
                a = ADV[b]
                surrogate = min(r * a, min(max(r, 1 - LOW), 1 + HIGH) * a)
                d = REF[b][t] - new[b][t]
                k3 = math.exp(d) - d - 1
                total += MASK[b][t] * (-surrogate + beta * (k3 * r if bias_correction else k3))
        return total / 7

    new, old, _, mask, adv = _tensors()
    ours, metrics = grpo_loss(
        new, old, adv, mask, clip_low=LOW, clip_high=HIGH, kl_coef=beta,
        ref_logprobs=torch.tensor(REF, dtype=torch.float64), kl_bias_correction=bias_correction,
    )  # fmt: skip
    ours.backward()
    assert float(ours) == pytest.approx(loss(NEW), rel=1e-12)
    assert torch.allclose(new.grad, _reference_grad(loss), atol=1e-7)
    assert metrics["kl"] > 0


def test_advantage_std_population_or_sample() -> None:
    rewards, groups = [1.0, 0.0, 0.5, 2.0], ["a", "a", "a", "b"]
    mean = 0.5
    pop = math.sqrt(((0.5) ** 2 * 2) / 3)
    sample = math.sqrt(((0.5) ** 2 * 2) / 2)
    got_pop = group_advantages(rewards, groups, eps=0.0)
    got_sample = group_advantages(rewards, groups, eps=0.0, std="sample")
    assert got_pop[:3] == pytest.approx([(r - mean) / pop for r in rewards[:3]])
    assert got_sample[:3] == pytest.approx([(r - mean) / sample for r in rewards[:3]])
    assert got_pop[3] == got_sample[3] == 0.0  # a singleton group: no signal


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_chunked_logprobs_equal_the_full_log_softmax_in_value_and_gradient(
    temperature: float,
) -> None:
    """Log-probs, entropy and both gradients of the chunked head against the full
    ``[N, V]`` log-softmax, for chunks that divide N, do not, and exceed it."""
    torch.manual_seed(0)
    n, hidden_size, vocab = 13, 8, 37
    hidden = torch.randn(n, hidden_size, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,))
    upstream = torch.randn(n, dtype=torch.float64)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    scale = temperature if temperature > 0 else 1.0  # greedy: the logits as they are
    logp = torch.log_softmax(h @ w.T / scale, dim=-1)
    want = logp.gather(-1, targets[:, None])[:, 0]
    want_entropy = -(logp.exp() * logp).sum(-1)
    (want * upstream).sum().backward()
    assert h.grad is not None and w.grad is not None

    for chunk in (1, 4, 13, 64):
        hc, wc = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got, entropy = chunked_logprobs(hc, wc, targets, temperature, chunk)
        (got * upstream).sum().backward()
        assert got.dtype == torch.float32 and not entropy.requires_grad
        assert torch.allclose(got.double(), want, atol=1e-6)
        assert torch.allclose(entropy.double(), want_entropy, atol=1e-5)
        assert torch.allclose(hc.grad, h.grad, atol=1e-6)
        assert torch.allclose(wc.grad, w.grad, atol=1e-6)
    with pytest.raises(TrainError, match="chunk must be >= 1"):
        chunked_logprobs(hidden, weight, targets, temperature, 0)


def test_segments_carry_logprobs_and_versions_through_the_journal() -> None:
    traj = Trajectory("t", "g")
    traj.segments = [
        Segment((1, 2), False),
        Segment((3, 4), True, (-0.5, -0.25), weight_version=3),  # drained here
        Segment((5,), True, (-1.0,), weight_version=4),  # resumed on another worker
        Segment((6,), False),
        Segment((7,), True),  # an engine that gave no log-probs
    ]
    again = Trajectory.from_dict(traj.to_dict())
    assert again.segments == traj.segments
    lp = again.behaviour_logprobs()
    assert lp[2:5] == [-0.5, -0.25, -1.0]
    assert all(math.isnan(x) for x in lp[:2] + lp[5:])
    # a record written before segments had log-probs reads as none
    old = {**traj.to_dict(), "segments": [[[1, 2], False], [[3], True]]}
    assert Trajectory.from_dict(old).segments[1] == Segment((3,), True)
