"""Teach the tiny random model one reply, by supervised fine-tuning, for tests that need
real engines to write something specific (a tool call in Qwen3's format): the tiny model
never would on its own. Test-only; a few seconds on 2 cores."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path


def teach_reply(
    model_dir: str,
    out_dir: Path,
    prompts: Sequence[Sequence[int]],
    reply: Sequence[int],
    *,
    steps: int = 150,
    lr: float = 3e-3,
) -> Path:
    """A copy of ``model_dir`` in ``out_dir`` whose greedy reply to each of ``prompts``
    is ``reply`` (token ids, its end-of-turn token included)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = [list(p) + list(reply) for p in prompts]
    for step in range(steps):
        ids = torch.tensor([rows[step % len(rows)]])
        labels = ids.clone()
        labels[0, : len(rows[step % len(rows)]) - len(reply)] = -100  # the reply's loss only
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in Path(model_dir).iterdir():  # the tokenizer and its chat template
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def greedy(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The model's greedy continuation, by transformers (a check before an engine runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]
