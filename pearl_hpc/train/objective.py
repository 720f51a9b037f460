"""The GRPO objective, pure: group-relative advantages, the off-policy correction of
stale / mismatched samples, the clipped surrogate and its aggregation, the trainer's
log-probabilities from the last hidden state in chunks of positions. Tensors and lists
in, tensors and floats out; the trainer (:mod:`pearl_hpc.train.grpo`) owns the model,
the optimizer and the disk.

With ``pi`` the policy being trained, ``pi_old`` its log-probs before the step's update
(recomputed by the trainer), ``mu`` the engine's (the behaviour policy that sampled the
token, recorded per token), ``r = pi / pi_old`` and ``w = pi_old / mu``::

    none       L_t = -min(r A, clip(r, 1-eps_low, 1+eps_high) A)
    tis        L_t = -min(w, C) * min(r A, clip(r) A)            (truncated IS: TRL, slime)
    decoupled  L_t = -[w <= C] w * min(r A, clip(r) A)           (AReaL; pi_old is the proximal)

plus ``beta * k3(pi, pi_ref)`` (times ``r`` with the bias correction), aggregated as
``bnpo`` (token mean over the minibatch), ``grpo`` (mean of per-sequence token means)
or ``dr_grpo`` (token sum / (sequences x max_completion_tokens)).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pearl_hpc.config.run import CORRECTIONS, LOSS_TYPES
from pearl_hpc.errors import PearlError


class TrainError(PearlError):
    """A batch the trainer cannot use, or a checkpoint it cannot read; the message names the
    trajectories or the file, and what to change."""


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6, std: str = "population"
) -> list[float]:
    """``(r - mean_g) / (std_g + eps)`` within each group, in input order; ``std``:
    ``population`` (divide by n) or ``sample`` (n - 1: TRL's and verl's).

    A singleton group, or one whose rewards are all equal, gets 0.0 for every member: it
    says nothing about which answer is better (verl gives a singleton its raw reward)."""
    if len(rewards) != len(group_ids):
        raise TrainError(
            f"group_advantages: {len(rewards)} rewards but {len(group_ids)} group ids; "
            "pass one group id per reward"
        )
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise TrainError(f"group_advantages: rewards at positions {bad} are not finite")
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        members[group].append(index)
    out = [0.0] * len(rewards)
    for indices in members.values():
        values = [float(rewards[i]) for i in indices]
        if max(values) == min(values):
            continue  # singleton or zero variance: no signal
        mean = sum(values) / len(values)
        dof = len(values) - (1 if std == "sample" else 0)
        spread = math.sqrt(sum((v - mean) ** 2 for v in values) / dof)
        for i, v in zip(indices, values, strict=True):
            out[i] = (v - mean) / (spread + eps)
    return out


@dataclass(frozen=True)
class Correction:
    """The off-policy correction of a batch (:func:`behaviour_weights`): a detached weight
    per token on the policy term, and what it took to get there (sums, for the step's
    mismatch figures; several data-parallel ranks add theirs up)."""

    weights: torch.Tensor  # [B, L]: 1 where no correction applies
    mismatch_sum: float  # sum over policy tokens with a behaviour log-prob of |log(pi_old/mu)|
    mismatch_max: float
    measured_tokens: float  # policy tokens with a behaviour log-prob
    capped_tokens: float  # tokens whose weight the cap clamped (tis) or dropped (decoupled)
    masked_sequences: float  # sequences the sequence mask dropped


def behaviour_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: str,
    cap: float = 2.0,
    sequence_mask: float = 0.0,
) -> Correction:
    """Importance weights ``w = pi_old / mu`` of the policy term, per token.

    ``old_logprobs``: the trainer's pre-update log-probs (pi_old); ``behaviour_logprobs``:
    the engine's (mu), NaN where unknown (such tokens get weight 1); ``mask``: policy
    tokens. ``correction``: ``none`` (w = 1), ``tis`` (w = min(w, cap)), ``decoupled``
    (w where w <= cap, else 0: AReaL's behaviour-weight cap). ``sequence_mask`` > 0: a
    sequence whose mean |log w| over its measured tokens exceeds it gets weight 0 (in
    the spirit of MIS / OPSM: too far off-policy to learn from)."""
    if correction not in CORRECTIONS:
        raise TrainError(f"correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
    known = torch.isfinite(behaviour_logprobs) & (mask > 0)
    log_w = torch.where(known, old_logprobs - behaviour_logprobs, torch.zeros_like(old_logprobs))
    log_w = log_w.detach()
    raw = torch.exp(log_w)
    over = known & (raw > cap)
    if correction == "tis":
        weights = torch.clamp(raw, max=cap)
    elif correction == "decoupled":
        weights = torch.where(over, torch.zeros_like(raw), raw)
    else:
        weights = torch.ones_like(raw)
    gap = log_w.abs() * known
    per_seq = known.sum(dim=-1)
    dropped = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if sequence_mask > 0:
        dropped = (per_seq > 0) & (gap.sum(dim=-1) / per_seq.clamp(min=1) > sequence_mask)
        weights = weights * (~dropped).unsqueeze(-1).to(weights.dtype)
    return Correction(
        weights=weights,
        mismatch_sum=float(gap.sum()),
        mismatch_max=float(gap.max()) if gap.numel() else 0.0,
        measured_tokens=float(known.sum()),
        capped_tokens=float(over.sum()) if correction != "none" else 0.0,
        masked_sequences=float(dropped.sum()),
    )


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    loss_type: str = "bnpo",
    kl_bias_correction: bool = False,
    num_tokens_total: float | None = None,
    num_sequences_total: float | None = None,
    max_completion_tokens: int = 1024,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate (PPO-style; the ratio clipped to ``[1 - clip_low,
    1 + clip_high]``: DAPO's clip-higher with ``clip_high > clip_low``), weighted per
    token by ``weights`` (the off-policy correction, :func:`behaviour_weights`), plus an
    optional k3 KL to a reference (times the ratio with ``kl_bias_correction``).

    ``logprobs``, ``old_logprobs``, ``mask`` (and ``ref_logprobs``, ``weights``): ``[B, L]``;
    ``advantages``: ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, L]``.
    How the per-token losses add up (``loss_type``, TRL's names): ``bnpo`` -- the mean over
    every policy token of the minibatch; ``grpo`` -- the mean over sequences of each one's
    token mean; ``dr_grpo`` -- the sum over tokens divided by sequences x
    ``max_completion_tokens``. Metrics (floats, per policy token): ``loss``, ``clip_frac``
    (where the clipped branch is active), ``kl`` (mean k3 to the reference; 0 without one),
    ``approx_kl`` (to the old policy), ``ratio_mean``, ``ratio_max``, ``num_tokens``.

    ``num_tokens_total`` / ``num_sequences_total``: the minibatch's global token /
    sequence counts, when data-parallel ranks each hold part of it (their losses and mean
    metrics then add up to the whole minibatch's).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise TrainError(
            f"grpo_loss: logprobs {tuple(logprobs.shape)}, old_logprobs "
            f"{tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.shape[0] != logprobs.shape[0]:
        raise TrainError(
            f"grpo_loss: {advantages.shape[0]} advantages for a batch of {logprobs.shape[0]}"
        )
    if kl_coef > 0 and ref_logprobs is None:
        raise TrainError("grpo_loss: kl_coef > 0 needs ref_logprobs (the reference model's)")
    if loss_type not in LOSS_TYPES:
        raise TrainError(f"grpo_loss: loss_type must be one of {', '.join(LOSS_TYPES)}")
    mask = mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype)
    num_tokens = mask.sum()
    tokens = (num_tokens if num_tokens_total is None else mask.new_tensor(num_tokens_total)).clamp(
        min=1.0
    )  # an all-masked batch gives loss 0, not NaN
    sequences = float(logprobs.shape[0] if num_sequences_total is None else num_sequences_total)

    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()

    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - logprobs
        kl = torch.exp(delta) - delta - 1.0  # k3: unbiased, always >= 0
        if kl_coef > 0:
            per_token = per_token + kl_coef * (kl * ratio if kl_bias_correction else kl)
    if loss_type == "bnpo":
        loss = (per_token * mask).sum() / tokens
    elif loss_type == "grpo":
        per_seq = (per_token * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        loss = per_seq.sum() / max(sequences, 1.0)
    else:
        loss = (per_token * mask).sum() / (max(sequences, 1.0) * max_completion_tokens)

    with torch.no_grad():
        active = ((ratio > 1.0 + clip_high) & (advantages > 0)) | (
            (ratio < 1.0 - clip_low) & (advantages < 0)
        )
        on = mask > 0
        n = float(tokens)
        metrics = {
            "loss": float(loss),
            "clip_frac": float((active.to(mask.dtype) * mask).sum()) / n,
            "kl": float((kl * mask).sum()) / n,
            "approx_kl": float((((ratio - 1.0) - log_ratio) * mask).sum()) / n,
            "ratio_mean": float((ratio * mask).sum()) / n if float(num_tokens) else 1.0,
            "ratio_max": float(ratio[on].max()) if bool(on.any()) else 1.0,
            "num_tokens": float(num_tokens),
        }
    return loss, metrics


def lr_at(config: Any, version: int) -> float:
    """The learning rate of the step that makes ``version + 1`` (``config``: a
    GRPOConfig): linear warm-up over ``lr_warmup_steps`` steps, then ``lr`` (constant) or
    a cosine from ``lr`` to ``lr_min`` at ``total_steps`` (0: no horizon, constant)."""
    warmup = config.lr_warmup_steps
    if version < warmup:
        return float(config.lr * (version + 1) / warmup)
    if config.lr_schedule == "constant" or config.total_steps <= warmup:
        return float(config.lr)
    progress = min(1.0, (version - warmup) / (config.total_steps - warmup))
    return float(
        config.lr_min + (config.lr - config.lr_min) * 0.5 * (1 + math.cos(math.pi * progress))
    )


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs of the targets and the entropy per position, from the hidden states and
    the LM head's weight, a chunk of positions at a time: neither pass holds more than one
    chunk's ``[chunk, V]`` logits (the backward recomputes them)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(out)
        lse = torch.empty_like(out)
        for s in range(0, n, chunk):
            logits = _scaled_logits(hidden[s : s + chunk], weight, temperature)
            lse[s : s + chunk] = norm = torch.logsumexp(logits, dim=-1)
            out[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None])[:, 0] - norm
            logp = logits.sub_(norm[:, None])  # in place: one [chunk, V] buffer
            entropy[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = _scale(ctx.temperature)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            g = grad[s : s + ctx.chunk]
            # d(logit_t - lse)/d logits = onehot(t) - softmax, times the upstream grad
            d = torch.exp(_scaled_logits(h, weight, ctx.temperature) - lse[s : s + ctx.chunk, None])
            d.mul_(-g[:, None])
            d.scatter_add_(-1, targets[s : s + ctx.chunk, None], g[:, None])
            if scale != 1.0:
                d.div_(scale)
            d = d.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s : s + ctx.chunk] = d @ weight
            if need_weight:
                grad_weight.addmm_(d.t().float(), h.float())
        return grad_hidden, grad_weight.to(weight.dtype) if need_weight else None, None, None, None


def _scale(temperature: float) -> float:
    """What the logits are divided by: the sampling temperature (0 = greedy: logits as
    they are, as vLLM reports a greedy request's log-probs)."""
    return temperature if temperature > 0 else 1.0


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight).float()
    scale = _scale(temperature)
    return logits / scale if scale != 1.0 else logits


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(targets[i] | position i), entropy at i)`` for ``hidden`` ``[N, H]`` and an
    LM head ``weight`` ``[V, H]``: fp32 ``[N]`` each, of the distribution the engine
    samples from (logits divided by ``temperature``; 0: as they are), ``chunk`` positions
    at a time, so memory is O(chunk x V) in the forward and the backward instead of the
    ``[N, V]`` logits (at 32K tokens and Qwen3's 151,936-token vocabulary: 0.6 GB a
    1,024-position chunk against 20 GB of fp32 logits). Gradients flow to ``hidden``
    and ``weight``; the entropy carries none."""
    if chunk < 1:
        raise TrainError(f"chunked_logprobs: chunk must be >= 1, got {chunk}")
    out: tuple[torch.Tensor, torch.Tensor] = _ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk)
    )
    return out
