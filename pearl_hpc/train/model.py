"""The policy the trainer optimises: a Hugging Face causal LM, loaded, optionally with
activation checkpointing per decoder block, and sharded with FSDP2.

:class:`Policy` is the module a trainer forwards: packed token ids in, each position's
log-prob of its target and entropy out, through the decoder and then the LM head in
chunks (:func:`pearl_hpc.train.objective.chunked_logprobs`), so no ``[N, V]`` logits
exist. Under FSDP2 it is the root module: its forward unshards the embedding, final norm
and LM head, each decoder block unshards its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from pearl_hpc.train.objective import TrainError, chunked_logprobs

log = logging.getLogger(__name__)


class Policy(torch.nn.Module):
    """``lm`` (a Hugging Face causal LM) as per-position log-probs of packed sequences."""

    def __init__(self, lm: Any, temperature: float, chunk: int) -> None:
        super().__init__()
        self.lm = lm
        self.temperature, self.chunk = temperature, chunk
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise TrainError(f"{type(lm).__name__}: an LM head with a bias is not supported")

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids``/``position_ids`` ``[1, N]`` (position ids restart at each packed
        sequence: attention stays within it), ``targets`` ``[N]`` -> (log-probs, entropy)
        ``[N]`` fp32."""
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        weight = self.lm.get_output_embeddings().weight
        return chunked_logprobs(
            out.last_hidden_state[0], weight, targets, self.temperature, self.chunk
        )


def decoder_blocks(lm: Any) -> torch.nn.ModuleList:
    blocks = getattr(lm.get_decoder(), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TrainError(f"{type(lm).__name__}: no decoder blocks at .layers to shard")
    return blocks


def build_policy(
    model_dir: Path,
    device: torch.device,
    *,
    temperature: float,
    chunk: int,
    checkpointing: bool,
    fsdp: bool,
) -> tuple[Any, Policy, bool]:
    """(the HF model, its :class:`Policy`, sharded?) on ``device``, in eval mode (no
    dropout: the no-grad and the gradient pass must agree). ``checkpointing``: each
    decoder block keeps only its input for the backward (torch's checkpoint wrapper,
    applied before sharding). ``fsdp``: every block and then the policy are
    ``fully_shard``-ed over the default process group (without one: not sharded, with a
    warning); the model is built in host memory and sharded there, so a GPU only ever holds
    its shard; on cuda compute is bf16 over fp32 master weights and fp32 reduction."""
    shard = fsdp and dist.is_available() and dist.is_initialized()
    if fsdp and not shard:
        log.warning("GRPOConfig.fsdp is set but there is no process group: not sharding")
    lm: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lm.eval()
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        blocks = decoder_blocks(lm)
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    policy = Policy(lm, temperature, chunk)
    if shard:
        _shard(policy, device)
    policy.to(device)
    return lm, policy, shard


def _shard(policy: Policy, device: torch.device) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    units: list[Any] = [fully_shard(block, **options) for block in decoder_blocks(policy.lm)]
    units.append(fully_shard(policy, **options))
    # the loss is already normalised by the minibatch's global token count: the ranks'
    # gradients add up (FSDP's default would average them), in a plain SUM (gloo has no
    # pre-multiplied sum)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
