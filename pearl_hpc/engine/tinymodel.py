"""Build a tiny Qwen3-style model and tokenizer locally (no hub access).

Tests, benchmarks and the embedded default run real vLLM engines and a real GRPO trainer
on this model. On GPU clusters a real Hugging Face model directory is used unchanged.

- Tokenizer: byte-level BPE trained with ``tokenizers`` on generated text (arithmetic,
  tool calls, chat words), wrapped in ``PreTrainedTokenizerFast`` with a ChatML template.
- Model: ``Qwen3ForCausalLM`` with hidden 64, 2 layers, 4 heads, 2 KV heads and
  ``head_dim`` 32 (vLLM's CPU attention needs head_dim >= 32), random init seeded, fp32,
  untied embeddings (so ``state_dict()`` names every tensor the engine holds).

``initializer_range`` sets how peaked the random model's next-token distribution is: at
0.02 it repeats one token whatever the prompt; the default 0.5 makes greedy outputs
depend on the prompt while sampling still explores (GRPO needs both).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER = "pearl-tiny-model.json"  # written last: a directory without it is incomplete

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with tools and the tool role in the Qwen3 / Hermes layout: tool specs in the
# system message inside <tools>, calls as <tool_call> JSON, results in <tool_response>
# inside a user turn (consecutive results share it).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    '{{- \'# Tools\\n\\nCall a tool by writing <tool_call>{\\"name\\": NAME, '
    '\\"arguments\\": {...}}</tool_call>. The tools:\\n<tools>\' }}'
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATE_VERSION = 2  # in the marker: a model built with another template is rebuilt


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; the defaults are what tests and the local default use."""

    vocab_size: int = 1024  # BPE target size (the trained vocab may be a little smaller)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # >= 32 for vLLM CPU attention
    max_position_embeddings: int = 2048
    initializer_range: float = 0.5
    seed: int = 0
    num_experts: int = 0  # > 0: a Qwen3-MoE (every block's MLP routed to experts)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32


def default_model_dir() -> Path:
    """Where ``pearl-hpc tiny-model`` builds by default (``$PEARL_HPC_CACHE`` or ~/.cache)."""
    root = os.environ.get("PEARL_HPC_CACHE") or Path.home() / ".cache" / "pearl_hpc"
    return Path(root) / "tiny-qwen3"


def corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Generated training text for the tokenizer: the words the environments use."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "of",
        "to",
        "is",
        "what",
        "compute",
        "answer",
        "result",
        "tool",
        "call",
        "python",
        "calculator",
        "print",
        "observation",
        "user",
        "assistant",
        "system",
        "please",
        "value",
        "sum",
        "product",
        "step",
        "think",
        "number",
        "error",
        "timeout",
        "ok",
        "done",
        "reward",
    ]
    lines = []
    for _ in range(num_lines):
        a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(1, 9)
        op = rng.choice("+-*")
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(f"What is {a} {op} {b}? <calc>{a}{op}{b}</calc> = {eval(f'{a}{op}{b}')}")
        elif kind == 1:
            lines.append(f"<python>print({a} {op} {b} * {c})</python>")
        elif kind == 2:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))))
        else:
            lines.append(f"observation: {rng.randint(-9999, 99999)} answer: {a % 97}")
    return lines


def build_tokenizer(spec: TinyModelSpec) -> Any:  # a PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: Path | str, spec: TinyModelSpec | None = None) -> Path:
    """Build (or reuse) the tiny model in ``out_dir``; returns the directory.

    Deterministic for a given spec. A complete directory (marker file present, same
    spec) is reused as is; anything else there is overwritten.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / MARKER
    built = {**asdict(spec), "template_version": TEMPLATE_VERSION}
    if marker.exists() and json.loads(marker.read_text()) == built:
        return out
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)

    tokenizer = build_tokenizer(spec)
    moe: dict[str, Any] = {}
    config_cls: Any = Qwen3Config
    model_cls: Any = Qwen3ForCausalLM
    if spec.num_experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
        moe = {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "decoder_sparse_step": 1,
        }
    config = config_cls(
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = model_cls(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(built))
    return out
