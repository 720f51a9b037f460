"""The simulator's cost model (pearl_hpc.sim.costmodel), checked by hand against the
formulas of its docstring: data-sheet numbers and model configs are written out here as
literals, the stated efficiencies are taken from the module."""

from __future__ import annotations

import itertools
import math

import pytest

from pearl_hpc.core.weightcost import sync_cost
from pearl_hpc.errors import PearlError
from pearl_hpc.sim import costmodel as cm
from pearl_hpc.sim.costmodel import GPUS, MODELS, CostModel, GpuSpec, SimConfigError

# data sheets (bf16 dense FLOP/s, HBM bytes/s, memory bytes, network bytes/s per worker)
SHEETS = {
    "h800": (989e12, 3.35e12, 80e9, 100e9),
    "h100": (989e12, 3.35e12, 80e9, 100e9),
    "a100": (312e12, 2.039e12, 80e9, 25e9),
}
# model configs (total params, active params, layers, q heads, kv heads, head dim)
CONFIGS = {
    "qwen3-8b": (8.19e9, 8.19e9, 36, 32, 8, 128),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 48, 32, 4, 128),
}
PAIRS = [(g, m) for g in SHEETS for m in CONFIGS]
REL = 1e-12


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


@pytest.fixture(params=PAIRS, ids=[f"{m}-{g}" for g, m in PAIRS])
def pair(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


def test_registries_hold_the_data_sheet_and_config_numbers() -> None:
    assert set(GPUS) == set(SHEETS)
    assert set(MODELS) == set(CONFIGS)
    for name, (flops, hbm, mem, net) in SHEETS.items():
        g = GPUS[name]
        assert (g.bf16_flops, g.hbm_bytes_per_s, g.memory_bytes, g.network_bytes_per_s) == (
            flops,
            hbm,
            mem,
            net,
        )
        assert g.source
    for name, (total, active, layers, qh, kvh, hd) in CONFIGS.items():
        m = MODELS[name]
        assert (m.total_params, m.active_params, m.num_layers) == (total, active, layers)
        assert (m.num_q_heads, m.num_kv_heads, m.head_dim) == (qh, kvh, hd)
        assert m.weight_bytes == 2.0 * total
        assert m.source
    moe = MODELS["qwen3-30b-a3b"]
    assert (moe.num_experts, moe.experts_per_token) == (128, 8)
    # 48 layers * 128 experts * 3 matrices * 2048 hidden * 768 moe_intermediate
    assert moe.expert_params == pytest.approx(48 * 128 * 3 * 2048 * 768, rel=0.01)
    assert MODELS["qwen3-8b"].num_experts == 0
    assert MODELS["qwen3-8b"].expert_params == 0.0


@pytest.mark.parametrize("model,expected", [("qwen3-8b", 147456), ("qwen3-30b-a3b", 98304)])
def test_kv_bytes_per_token(model: str, expected: int) -> None:
    # K and V, bf16: 2 * layers * kv_heads * head_dim * 2 bytes
    layers, kvh, hd = CONFIGS[model][2], CONFIGS[model][4], CONFIGS[model][5]
    assert 2 * layers * kvh * hd * 2 == expected
    assert MODELS[model].kv_bytes_per_token == expected
    for gpu in SHEETS:
        assert CostModel.from_names(gpu, model).kv_bytes_per_token == expected


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_capacity_tokens_formula(pair: tuple[str, str], tp: int) -> None:
    gpu, model = pair
    mem = SHEETS[gpu][2]
    weights = 2.0 * CONFIGS[model][0]
    kv = MODELS[model].kv_bytes_per_token
    usable = tp * (mem * cm.GPU_MEMORY_UTILIZATION - cm.ACTIVATION_RESERVE_BYTES)
    expected = int((usable - weights) / kv)
    cost = CostModel.from_names(gpu, model, tp)
    assert cost.kv_capacity_tokens == expected
    assert expected > 0


def test_kv_capacity_pinned_example() -> None:
    # 2 x H800, Qwen3-8B: 2 * (80e9 * 0.9 - 4e9) - 2 * 8.19e9 = 119.62e9 bytes of KV
    assert cm.GPU_MEMORY_UTILIZATION == 0.9
    assert cm.ACTIVATION_RESERVE_BYTES == 4e9
    assert CostModel.from_names("h800", "qwen3-8b", 2).kv_capacity_tokens == int(119.62e9 / 147456)
    # capacity grows with tp by exactly one GPU's usable memory per extra GPU
    one = CostModel.from_names("h800", "qwen3-8b", 1).kv_capacity_tokens
    two = CostModel.from_names("h800", "qwen3-8b", 2).kv_capacity_tokens
    assert abs((two - one) - 68e9 / 147456) <= 1


def test_decode_iteration_by_hand(pair: tuple[str, str]) -> None:
    gpu, model = pair
    flops, hbm, _, _ = SHEETS[gpu]
    total, active, layers, qh, _, hd = CONFIGS[model]
    spec = MODELS[model]
    for tp in (1, 2, 4):
        cost = CostModel.from_names(gpu, model, tp)
        for n, ctx in [(1, 0.0), (1, 16384.0), (32, 400_000.0), (256, 2_000_000.0)]:
            if spec.num_experts:
                k, e = spec.experts_per_token, spec.num_experts
                touched = 1 - (1 - k / e) ** n
                wbytes = 2 * (total - spec.expert_params) + 2 * spec.expert_params * touched
            else:
                wbytes = 2 * total
            memory_s = (wbytes + ctx * spec.kv_bytes_per_token) / (tp * hbm * cm.MEM_EFFICIENCY)
            compute_s = (2 * active * n + 4 * layers * qh * hd * ctx) / (tp * flops)
            overhead = cm.ITERATION_OVERHEAD_S + (
                2 * layers * cm.ALLREDUCE_LATENCY_S if tp > 1 else 0.0
            )
            expected = max(memory_s, compute_s) + overhead
            assert close(cost.decode_iteration_s(n, ctx), expected), (tp, n, ctx)


def test_decode_pinned_example() -> None:
    # Qwen3-8B on 2 x H800, one sequence, empty context: reading 16.38 GB of weights at
    # 2 * 3.35 TB/s * 0.65, plus 0.8 ms + 72 all-reduces of 8 us.
    cost = CostModel.from_names("h800", "qwen3-8b", 2)
    expected = 16.38e9 / (2 * 3.35e12 * 0.65) + 0.8e-3 + 72 * 8e-6
    assert cost.decode_iteration_s(1, 0) == pytest.approx(expected, rel=1e-12)
    assert 5e-3 < expected < 6e-3


def test_decode_iteration_monotone(pair: tuple[str, str]) -> None:
    gpu, model = pair
    cost = CostModel.from_names(gpu, model)
    seqs = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
    contexts = [0.0, 1e3, 1e4, 1e5, 1e6, 4e6]
    for ctx in contexts:
        times = [cost.decode_iteration_s(n, ctx) for n in seqs]
        assert all(b >= a for a, b in itertools.pairwise(times)), (ctx, times)
        if ctx <= 1e5:  # enough sequences make a short-context batch compute-bound
            assert times[-1] > times[0]
    for n in seqs:
        times = [cost.decode_iteration_s(n, ctx) for ctx in contexts]
        # every context token is read from HBM: strictly increasing
        assert all(b > a for a, b in itertools.pairwise(times)), (n, times)


def test_moe_touched_experts_fraction_bounds() -> None:
    cost = CostModel.from_names("h800", "qwen3-30b-a3b")
    m = cost.model
    dense_part = 2.0 * (m.total_params - m.expert_params)
    experts = 2.0 * m.expert_params

    def fraction(tokens: float) -> float:
        return (cost._weight_bytes_read(tokens) - dense_part) / experts

    # one token touches exactly k of E experts per layer
    assert fraction(1) == pytest.approx(8 / 128, rel=1e-12)
    # fewer than one token (an empty batch) is clamped to one
    assert fraction(0) == fraction(1)
    assert fraction(0.5) == fraction(1)
    previous = 0.0
    for tokens in [1, 2, 3, 8, 16, 64, 128, 512, 4096]:
        f = fraction(tokens)
        assert 8 / 128 <= f <= 1.0
        assert f >= previous
        assert f == pytest.approx(1 - (120 / 128) ** tokens, rel=1e-12)
        assert f <= min(1.0, tokens * 8 / 128) + 1e-12  # union bound
        previous = f
    assert fraction(4096) == pytest.approx(1.0, abs=1e-12)
    # never more than the whole model, never less than the dense part + k/E of experts
    assert cost._weight_bytes_read(10**6) <= m.weight_bytes * (1 + 1e-12)
    assert cost._weight_bytes_read(1) > dense_part
    # a dense model always reads all its weights
    dense = CostModel.from_names("h800", "qwen3-8b")
    for tokens in (0, 1, 100, 10**5):
        assert dense._weight_bytes_read(tokens) == dense.model.weight_bytes


def test_moe_decode_reads_fewer_bytes_than_dense_total() -> None:
    # MoE decode of one sequence is far cheaper than reading all 61 GB of weights
    cost = CostModel.from_names("h800", "qwen3-30b-a3b")
    full_read = cost.model.weight_bytes / (2 * 3.35e12 * cm.MEM_EFFICIENCY)
    assert cost.decode_iteration_s(1, 0) < full_read
    assert cost.decode_iteration_s(4096, 0) >= full_read


def test_mixed_iteration_exceeds_decode(pair: tuple[str, str]) -> None:
    gpu, model = pair
    cost = CostModel.from_names(gpu, model)
    for n, ctx in [(1, 1000.0), (16, 200_000.0), (128, 1_500_000.0)]:
        decode = cost.decode_iteration_s(n, ctx)
        for chunk, span in [(1.0, 1.0), (512.0, 4000.0), (8192.0, 20000.0)]:
            mixed = cost.mixed_iteration_s(n, ctx, chunk, span)
            assert mixed > decode
            assert close(mixed, decode + cost.prefill_chunk_s(chunk, span) + cost.eager_launch_s)
    assert cost.eager_launch_s == pytest.approx(CONFIGS[model][2] * cm.EAGER_LAUNCH_S_PER_LAYER)


def test_prefill_by_hand(pair: tuple[str, str]) -> None:
    gpu, model = pair
    flops = SHEETS[gpu][0]
    _total, active, layers, qh, _, hd = CONFIGS[model]
    moe = MODELS[model].num_experts > 0
    eff = cm.PREFILL_EFFICIENCY_MOE if moe else cm.PREFILL_EFFICIENCY_DENSE
    cost = CostModel.from_names(gpu, model, 2)
    for tokens, span in [(1.0, 1.0), (1000.0, 3000.0), (8192.0, 4096.0)]:
        linear = 2 * active * tokens / (2 * flops * eff)
        attention = 4 * layers * qh * hd * tokens * span / (2 * flops * cm.ATTENTION_EFFICIENCY)
        assert close(cost.prefill_chunk_s(tokens, span), linear + attention)
        it = cost.prefill_iteration_s(tokens, span)
        assert it > cost.prefill_chunk_s(tokens, span) + cost.eager_launch_s
    # a full chunk is compute-bound: prefill throughput well above decode's tokens/s
    full = cost.prefill_iteration_s(cm.CHUNK_TOKENS, cm.CHUNK_TOKENS / 2)
    assert cm.CHUNK_TOKENS / full > 1 / cost.decode_iteration_s(1, 0)


def test_transfer_is_linear(pair: tuple[str, str]) -> None:
    gpu, model = pair
    cost = CostModel.from_names(gpu, model)
    rate = SHEETS[gpu][3] * cm.NETWORK_EFFICIENCY
    base = cost.transfer_s(0)
    assert base == cm.TRANSFER_LATENCY_S
    slope = MODELS[model].kv_bytes_per_token / rate
    for tokens in (1, 100, 4096, 32768):
        assert close(cost.transfer_s(tokens), cm.TRANSFER_LATENCY_S + tokens * slope)
        assert close(cost.transfer_s(2 * tokens) - base, 2 * (cost.transfer_s(tokens) - base))
    # 32K tokens of Qwen3-8B KV over 100 Gb/s at 50%: 4.83 GB / 50 GB/s
    if (gpu, model) == ("h800", "qwen3-8b"):
        assert cost.transfer_s(32768) == pytest.approx(2e-3 + 32768 * 147456 / 50e9)


def test_training_step_inversely_proportional_to_gpus(pair: tuple[str, str]) -> None:
    gpu, model = pair
    flops, _, _, _ = SHEETS[gpu]
    total, active = CONFIGS[model][0], CONFIGS[model][1]
    mfu = cm.TRAIN_MFU_MOE if MODELS[model].num_experts else cm.TRAIN_MFU_DENSE
    cost = CostModel.from_names(gpu, model)

    def sync(g: int) -> float:  # the trainer's part of a version and the engines' reload
        version = sync_cost(2 * total, trainer_ranks=g, tp=2)
        return version.trainer_s + version.pause_s

    tokens = 2_000_000.0
    for g in (1, 2, 8, 16, 64):
        expected = 8 * active * tokens / (g * flops * mfu) + sync(g)
        assert close(cost.training_step_s(tokens, g), expected)
    compute = [(cost.training_step_s(tokens, g) - sync(g)) * g for g in (1, 2, 8, 16, 64)]
    assert all(math.isclose(c, compute[0], rel_tol=1e-9) for c in compute)
    # linear in tokens, and the fixed sync term at zero tokens
    assert close(cost.training_step_s(0, 16), sync(16))
    assert cost.weight_sync_s == sync_cost(2 * total, trainer_ranks=1, tp=2).pause_s
    assert close(
        cost.training_step_s(2 * tokens, 16) - sync(16),
        2 * (cost.training_step_s(tokens, 16) - sync(16)),
    )


def test_reconfig_latencies() -> None:
    for model in CONFIGS:
        cost = CostModel.from_names("h800", model)
        for kind in ("preparation", "finalisation", "activation", "deactivation", "rerole"):
            assert cost.reconfig_s(kind) > 0
    assert CostModel.from_names("h800", "qwen3-8b").reconfig_s("deactivation") == 3.18


def test_names_are_case_insensitive() -> None:
    assert CostModel.from_names("H800", "Qwen3-8B") == CostModel.from_names("h800", "qwen3-8b")


@pytest.mark.parametrize(
    "gpu,model,known",
    [
        ("v100", "qwen3-8b", ["a100", "h100", "h800"]),
        ("h800", "llama-70b", ["qwen3-30b-a3b", "qwen3-8b"]),
        ("", "qwen3-8b", ["a100", "h100", "h800"]),
    ],
)
def test_unknown_names_list_known_ones(gpu: str, model: str, known: list[str]) -> None:
    with pytest.raises(SimConfigError) as info:
        CostModel.from_names(gpu, model)
    message = str(info.value)
    assert "unknown" in message
    assert ", ".join(known) in message
    assert isinstance(info.value, PearlError)  # the CLI turns it into one line, exit 2


@pytest.mark.parametrize("tp", [0, -2])
def test_tp_must_be_positive(tp: int) -> None:
    with pytest.raises(SimConfigError, match="tp must be >= 1"):
        CostModel.from_names("h800", "qwen3-8b", tp)


def test_model_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = GpuSpec("tiny", 100e12, 1e12, 16e9, 10e9, "a made-up 16 GB GPU")
    monkeypatch.setitem(GPUS, "tiny", tiny)
    # 1 x 16 GB: 16e9 * 0.9 - 4e9 = 10.4e9 < 61 GB of Qwen3-30B-A3B weights
    with pytest.raises(SimConfigError, match="does not fit"):
        CostModel.from_names("tiny", "qwen3-30b-a3b", 1)
    # 8 x 16 GB: 83.2e9 - 61e9 > 0 fits
    assert CostModel.from_names("tiny", "qwen3-30b-a3b", 8).kv_capacity_tokens > 0
