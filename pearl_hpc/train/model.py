"""The policy the trainer optimises: a Hugging Face causal LM, loaded, optionally with
activation checkpointing per decoder block, and sharded with FSDP2.

:class:`Policy` is the module a trainer forwards: packed token ids in, each position's
log-prob of its target and entropy out, through the decoder and then the LM head in
chunks (:func:`pearl_hpc.train.objective.chunked_logprobs`), so no ``[N, V]`` logits
exist. Under FSDP2 it is the root module: its forward unshards the embedding, final norm
and LM head, each decoder block unshards its own.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM

from pearl_hpc.train.objective import TrainError, chunked_logprobs

log = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint wrapper's


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
    warning). A sharded model is built on the meta device, allocated shard by shard on
    ``device``, and each rank reads only its rows of every weight from the safetensors
    files (:func:`load_shards`): no rank ever holds the whole model, on the host or the
    GPU. On cuda compute is bf16 over fp32 master weights and fp32 reduction."""
    shard = fsdp and dist.is_available() and dist.is_initialized()
    if fsdp and not shard:
        log.warning("GRPOConfig.fsdp is set but there is no process group: not sharding")
    attention = attention_kernel(device, bf16=shard)
    if shard:
        lm: Any = empty_model(model_dir, torch.float32, attention)
    else:
        lm = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attention
        )
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
        materialize(policy, lm, device)
        load_shards(lm, weight_files(model_dir))
    else:
        policy.to(device)
    return lm, policy, shard


def empty_model(model_dir: Path, dtype: torch.dtype, attention: str = "sdpa") -> Any:
    """The model of ``model_dir``'s config on the meta device (no memory, no weights)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        return lm.to(dtype)


def materialize(module: torch.nn.Module, lm: Any, device: torch.device | str) -> None:
    """Allocate ``module`` (holding the meta-device ``lm``) on ``device``, uninitialised
    but for the buffers computed at construction (rotary frequencies): the weights come
    next, from :func:`load_shards`."""
    module.to_empty(device=device)
    for sub in lm.modules():
        if hasattr(sub, "original_inv_freq"):
            lm._init_weights(sub)


def attention_kernel(device: torch.device, *, bf16: bool) -> str:
    """transformers' attention: ``flash_attention_2`` where it runs (cuda, bf16 compute:
    FSDP2's mixed precision, the flash-attn package installed), so a packed micro-batch
    runs varlen, each trajectory attending within itself; else ``sdpa``, where a packed
    micro-batch carries an N x N block-diagonal mask (its compute covers the masked
    blocks too)."""
    if device.type == "cuda" and bf16 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint (one file, or an index of several) ->
    its file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise TrainError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), "pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 (not a dict)


def load_shards(lm: Any, files: dict[str, Path]) -> None:
    """Fill ``lm``'s parameters and persistent buffers from the checkpoint ``files``: each
    rank reads only its FSDP2 shard of a sharded tensor (a block of rows: dim-0 chunks of
    ``ceil(rows / ranks)``; a fused MoE tensor's rows are experts, each read from its
    per-expert tensors in the checkpoint), cast to the parameter's dtype."""
    tied = getattr(lm.config, "tie_word_embeddings", False)
    fused = _fused_sources(lm)
    handles: dict[Path, Any] = {}

    def read(key: str, start: int | None = None, rows: int = 0) -> torch.Tensor:
        if key not in files and tied and key == "lm_head.weight":
            key = "model.embed_tokens.weight"
        if key not in files:
            raise TrainError(f"the checkpoint has no tensor {key!r} for the model")
        path = files[key]
        handle = handles.get(path) or handles.setdefault(path, safe_open(str(path), "pt"))
        if start is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[start : start + rows]

    for name, tensor in _checkpointed(lm):
        key = name.replace(CHECKPOINT_PREFIX, "")
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        rows = local.shape[0] if local.dim() else 0
        first = _first_row(name, tensor) if local.dim() else None  # None: not sharded
        start, sharded = first or 0, first is not None
        sources = fused(key)
        if sources:  # rows are experts: expert e's tensors, concatenated
            part = torch.stack([
                torch.cat([read(s.replace("*", str(e))) for s in sources])
                for e in range(start, start + rows)
            ]) if rows else local  # fmt: skip
        elif sharded:
            part = read(key, start, rows)
        else:
            part = read(key)
        with torch.no_grad():
            local.copy_(part.reshape(local.shape).to(local.dtype))


def _first_row(name: str, tensor: torch.Tensor) -> int | None:
    """The first row of ``tensor`` this rank holds, if it is an FSDP2 shard (dim-0
    chunks of ``ceil(rows / ranks)``); None for a whole tensor."""
    if not isinstance(tensor, DTensor):
        return None
    if tensor.placements != (Shard(0),):
        raise TrainError(f"{name}: placed {tensor.placements}, not FSDP2's Shard(0)")
    per = -(-tensor.shape[0] // tensor.device_mesh.size())
    return per * tensor.device_mesh.get_local_rank()


def _fused_sources(lm: Any) -> Any:
    """``key -> the checkpoint tensors it fuses`` (``*``: the expert's index; None: not
    fused), from transformers' conversion mapping of the model type (Qwen3-MoE: each
    expert's gate and up projections into ``experts.gate_up_proj``, its down projection
    into ``experts.down_proj``)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    rules = []
    for conversion in get_checkpoint_conversion_mapping(lm.config.model_type) or []:
        patterns = list(getattr(conversion, "source_patterns", []))
        if not any("*" in p for p in patterns):
            continue  # a renaming, not a fusion of per-expert tensors
        for target in conversion.target_patterns:
            rules.append((target, patterns))

    def sources(key: str) -> list[str] | None:
        for target, patterns in rules:
            if key.endswith(target):
                prefix = key[: -len(target)]
                return [prefix + pattern for pattern in patterns]
        return None

    return sources


def checkpoint_layout(lm: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``lm``'s state dict) in the layout of a Hugging Face checkpoint, as
    engines and ``from_pretrained`` read it (a fused MoE tensor back into its experts'
    tensors; the same dict for a model without fused tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(lm, state))


def full_weights(lm: Any, dtype: torch.dtype, sharded: bool) -> dict[str, torch.Tensor]:
    """``lm``'s state dict as host copies in ``dtype`` (floating-point tensors). Sharded
    (FSDP2): every rank casts its shard of each tensor and all-gathers it, so ``dtype``
    is what crosses the links; rank 0 keeps the copies, the others get ``{}``."""
    if not sharded:
        return host_copies(lm.state_dict(), dtype)
    lead = dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, tensor in lm.state_dict().items():
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if lead:
            out.update(host_copies({name: full}, None, wait=False))
    if lead and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def host_copies(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None, *, wait: bool = True
) -> dict[str, torch.Tensor]:
    """Detached CPU copies; floating-point tensors in ``dtype`` (cast on the GPU; None:
    as they are), others as they are. From a GPU every copy is in flight at once into
    pinned memory, with one wait (``wait``: the caller waits itself): torch keeps freed
    pinned blocks for the next copy of the same sizes, so after the first call (which
    pins them) a step's copy runs at the link's speed (an H200: 1.5 GiB of bf16 in
    0.03 s, against 3 s into pageable memory)."""
    out: dict[str, torch.Tensor] = {}
    from_gpu = False
    for name, tensor in state.items():
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if tensor.is_cuda:
            from_gpu = True
            out[name] = torch.empty(tensor.shape, dtype=cast, pin_memory=True)
            out[name].copy_(tensor.detach(), non_blocking=True)
        else:
            out[name] = tensor.detach().to("cpu", cast, copy=True)
    if from_gpu and wait:
        torch.cuda.synchronize()
    return out


def _checkpointed(lm: Any) -> list[tuple[str, torch.Tensor]]:
    """``lm``'s parameters and persistent buffers (what a checkpoint holds), by name."""
    out = list(lm.named_parameters())
    for prefix, module in lm.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


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
