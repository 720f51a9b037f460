"""GRPO: the pure parts (advantages, loss, log-probabilities) against hand-computed values,
and the trainer on the tiny Qwen3 model: learning from rewards, versions, checkpoints and
the batches it must refuse."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors import safe_open  # noqa: E402

from pearl_hpc.engine.tinymodel import build_tiny_model  # noqa: E402
from pearl_hpc.errors import ConfigError  # noqa: E402
from pearl_hpc.rollout.types import Segment, Trajectory  # noqa: E402
from pearl_hpc.train.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint  # noqa: E402
from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from pearl_hpc.train.objective import (  # noqa: E402
    TrainError,
    group_advantages,
    grpo_loss,
)
from tests.factories import run_reporting  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per session; test_weights.py's fixture reuses the same directory."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# Two prompts, each with a rewarded and an unrewarded completion.
EXAMPLES = [
    ("g-add", "What is 2 + 3?", " answer: 5", 1.0),
    ("g-add", "What is 2 + 3?", " error timeout", 0.0),
    ("g-sum", "compute the sum of 4 and 9", " result 13 done", 1.0),
    ("g-sum", "compute the sum of 4 and 9", " please think step", 0.0),
]


def make_batch(
    tokenizer: Any, version: int = 0, examples: Sequence[tuple[str, str, str, float]] = EXAMPLES
) -> list[Trajectory]:
    """Prompt segment + generated completion segment + a short environment segment."""
    out = []
    for i, (group, prompt, completion, reward) in enumerate(examples):
        segments = [
            Segment(tuple(tokenizer.encode(prompt)), generated=False),
            Segment(tuple(tokenizer.encode(completion)), generated=True),
            Segment(tuple(tokenizer.encode(" observation: ok")), generated=False),
        ]
        out.append(Trajectory(f"t{i}", group, segments, reward, True, {version}))
    return out


def policy_logprob(trainer: GRPOTrainer, trajectory: Trajectory) -> float:
    """Summed log-probability of the trajectory's generated tokens under the trainer."""
    mask = torch.tensor(trajectory.loss_mask()[1:], dtype=torch.float32)
    return float((trainer.logprobs(trajectory.token_ids()) * mask).sum())


# --------------------------------------------------------------------------- advantages


def test_advantages_normalise_within_each_group() -> None:
    adv = group_advantages([1.0, 0.0, 3.0, 1.0, 2.0], ["a", "a", "b", "b", "b"], eps=0.0)
    assert adv[:2] == pytest.approx([1.0, -1.0])
    std_b = math.sqrt(2 / 3)
    assert adv[2:] == pytest.approx([1 / std_b, -1 / std_b, 0.0])


def test_singleton_and_zero_variance_groups_get_zero() -> None:
    adv = group_advantages([5.0, 1.0, 1.0, 0.0, 1.0], ["solo", "same", "same", "x", "x"])
    assert adv[:3] == [0.0, 0.0, 0.0]
    assert adv[3] < 0 < adv[4]
    assert group_advantages([], []) == []


def test_advantages_reject_bad_input() -> None:
    with pytest.raises(TrainError, match="2 rewards but 1 group ids"):
        group_advantages([1.0, 2.0], ["a"])
    with pytest.raises(TrainError, match=r"positions \[1\] are not finite"):
        group_advantages([1.0, math.nan], ["a", "a"])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.floats(-100, 100, allow_nan=False)),
        min_size=1,
        max_size=24,
    )
)
@example([("a", 0.0), ("a", 0.001953125)])  # spread > 1e-3 but std ~ 1e-3: eps shows
def test_advantages_have_zero_mean_and_unit_std_per_group(
    items: list[tuple[str, float]],
) -> None:
    groups = [g for g, _ in items]
    rewards = [r for _, r in items]
    adv = group_advantages(rewards, groups)
    for group in set(groups):
        values = [a for a, g in zip(adv, groups, strict=True) if g == group]
        raw = [r for r, g in zip(rewards, groups, strict=True) if g == group]
        assert abs(sum(values) / len(values)) < 1e-6
        spread = max(raw) - min(raw)
        raw_mean = sum(raw) / len(raw)
        raw_std = math.sqrt(sum((r - raw_mean) ** 2 for r in raw) / len(raw))
        if raw_std > 1e-3:  # std / (std + eps) is within 1e-3 of 1 from std = 999 eps on
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            assert std == pytest.approx(1.0, rel=1e-3)
        elif spread == 0:
            assert values == [0.0] * len(values)


# --------------------------------------------------------------------------- loss


def test_loss_at_ratio_one_is_minus_the_token_mean_advantage() -> None:
    logprobs = torch.log(torch.rand(2, 4) * 0.9 + 0.05)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([0.5, -2.0])
    loss, metrics = grpo_loss(logprobs, logprobs.clone(), adv, mask, clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(-(3 * 0.5 + 1 * -2.0) / 4)
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["num_tokens"] == 4 and metrics["kl"] == 0.0


def test_clipping_stops_the_gradient_beyond_the_clip_range() -> None:
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # ratio 1.5 > 1.2 with a positive advantage: the clipped branch, no gradient
    new = torch.full((1, 3), math.log(1.5), requires_grad=True)
    loss, metrics = grpo_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["clip_frac"] == 1.0
    assert new.grad is not None and float(new.grad.abs().sum()) == 0.0
    # the same ratio with a negative advantage is not clipped (pessimistic bound)
    new.grad = None
    loss, metrics = grpo_loss(new, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(1.5)
    assert metrics["clip_frac"] == 0.0 and float(new.grad.abs().sum()) > 0
    # within the trust region the ratio passes through
    inside = torch.full((1, 3), math.log(1.1))
    loss, _ = grpo_loss(inside, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(-1.1)


def test_masked_tokens_get_no_gradient() -> None:
    logprobs = torch.randn(2, 5).clamp(max=-0.1).requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.float32)
    loss, _ = grpo_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.2
    )
    loss.backward()
    assert logprobs.grad is not None
    assert torch.all(logprobs.grad[mask == 0] == 0)
    assert torch.all(logprobs.grad[mask == 1] != 0)


def test_kl_term_and_degenerate_batches() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    adv = torch.tensor([0.0])
    loss, metrics = grpo_loss(
        logprobs,
        logprobs,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.1,
        ref_logprobs=logprobs,
    )
    assert float(loss) == 0.0 and metrics["kl"] == 0.0
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, metrics = grpo_loss(
        logprobs, logprobs, adv, mask, clip_low=0.2, clip_high=0.2, kl_coef=0.1, ref_logprobs=ref
    )
    k3 = [(0.5 - math.log(0.5) - 1), (2.0 - math.log(2.0) - 1)]  # exp(d) - d - 1, d = ref - lp
    assert metrics["kl"] == pytest.approx(sum(k3) / 2)
    assert float(loss) == pytest.approx(0.1 * sum(k3) / 2)
    with pytest.raises(TrainError, match="kl_coef > 0 needs ref_logprobs"):
        grpo_loss(logprobs, logprobs, adv, mask, clip_low=0.2, clip_high=0.2, kl_coef=0.1)
    with pytest.raises(TrainError, match="must have one shape"):
        grpo_loss(logprobs, logprobs[:, :1], adv, mask, clip_low=0.2, clip_high=0.2)
    loss, metrics = grpo_loss(
        logprobs, logprobs, adv, torch.zeros(1, 2), clip_low=0.2, clip_high=0.2
    )
    assert float(loss) == 0.0 and metrics["num_tokens"] == 0.0  # all masked: 0, not NaN


# --------------------------------------------------------------------------- model


def test_token_logprobs_match_a_manual_log_softmax(tiny_model_dir: Path, tokenizer: Any) -> None:
    trainer = GRPOTrainer(tiny_model_dir)
    ids = torch.tensor([tokenizer.encode("What is 12 + 7? answer: 19")])
    got = trainer.logprobs(ids[0].tolist())
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits
    manual = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert got.shape == (ids.shape[1] - 1,)
    assert torch.allclose(got, manual, atol=1e-5)


def test_training_raises_the_rewarded_completions(tiny_model_dir: Path, tokenizer: Any) -> None:
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, minibatch_size=2, epochs=2))
    assert trainer.version == 0
    before = [policy_logprob(trainer, t) for t in make_batch(tokenizer)]
    for step in range(4):
        stats = trainer.train_step(make_batch(tokenizer, version=trainer.version))
        assert stats.version == trainer.version == step + 1
    after = [policy_logprob(trainer, t) for t in make_batch(tokenizer)]
    for (_, _, _, reward), b, a in zip(EXAMPLES, before, after, strict=True):
        assert (a > b) if reward else (a < b), (reward, b, a)
    assert stats.num_trajectories == 4 and stats.mean_reward == 0.5
    assert stats.num_tokens == sum(t.num_generated() for t in make_batch(tokenizer))
    assert stats.grad_norm > 0 and stats.wall_s > 0 and stats.max_staleness == 0
    assert 0.0 <= stats.clip_frac <= 1.0


def test_kl_to_the_initial_model_is_reported(tiny_model_dir: Path, tokenizer: Any) -> None:
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, kl_coef=0.1))
    first = trainer.train_step(make_batch(tokenizer))
    second = trainer.train_step(make_batch(tokenizer, version=1))
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    assert second.kl > 0


def test_stale_unfinished_and_foreign_trajectories_are_refused(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(max_staleness=1))
    unrewarded = make_batch(tokenizer)
    unrewarded[1].reward = None
    unrewarded[3].done = False
    with pytest.raises(TrainError, match=r"not done or reward None: t1, t3"):
        trainer.train_step(unrewarded)
    with pytest.raises(TrainError, match="no trajectories"):
        trainer.train_step([])
    with pytest.raises(TrainError, match="newer than the trainer's 0"):
        trainer.train_step(make_batch(tokenizer, version=1))
    trainer.train_step(make_batch(tokenizer, version=0))
    stats = trainer.train_step(make_batch(tokenizer, version=0))  # one behind: accepted
    assert stats.max_staleness == 1 and trainer.version == 2
    mixed = make_batch(tokenizer, version=2)
    mixed[2].weight_versions = {0, 2}  # a turn generated by version 0: too old now
    with pytest.raises(TrainError, match=r"oldest accepted: v1\): t2 \(v0\).*max_staleness"):
        trainer.train_step(mixed)
    foreign = make_batch(tokenizer, version=2)
    foreign[0].segments.append(Segment((10**6,), generated=True))
    with pytest.raises(TrainError, match="t0 hold token ids outside the model's vocabulary"):
        trainer.train_step(foreign)
    assert trainer.version == 2  # refused batches change nothing


def test_state_dict_is_full_detached_fp32_cpu(tiny_model_dir: Path) -> None:
    trainer = GRPOTrainer(tiny_model_dir)
    state = trainer.state_dict()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    assert set(state) == set(trainer.model.state_dict())
    for tensor in state.values():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert not tensor.requires_grad
    before = state["lm_head.weight"].clone()
    with torch.no_grad():
        trainer.model.get_parameter("lm_head.weight").add_(1.0)
    assert torch.equal(state["lm_head.weight"], before)  # a copy, not a view of the params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("lr", math.inf),
        ("clip_low", -0.1),
        ("clip_high", 0.0),
        ("micro_batch_tokens", 1),
        ("lr_schedule", "linear"),
        ("kl_coef", -1.0),
        ("epochs", 0),
        ("minibatch_size", 1.5),
        ("grad_clip", 0.0),
        ("seed", -1),
        ("max_staleness", True),
        ("device", "tpu"),
        ("fsdp", "yes"),
        ("weight_decay", math.nan),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"GRPOConfig\.{field} must"):
        GRPOConfig(**{field: value})


def test_config_from_dict_is_strict_and_the_trainer_checks_its_inputs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert GRPOConfig.from_dict({"lr": 1e-4, "epochs": 2}) == GRPOConfig(lr=1e-4, epochs=2)
    with pytest.raises(ConfigError, match=r"unknown GRPO setting\(s\) learning_rate; valid: lr"):
        GRPOConfig.from_dict({"learning_rate": 1e-4})
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        GRPOTrainer(tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            GRPOTrainer(tiny_model_dir, GRPOConfig(device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda_matches_the_cpu_contract(
    tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, device="cuda"))
    stats = trainer.train_step(make_batch(tokenizer))
    assert stats.version == 1 and math.isfinite(stats.loss)
    state = trainer.state_dict()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values())
    saver = Checkpointer(tmp_path / "checkpoints", 2, sharded=False, lead=True)
    saver.save(trainer)  # AdamW's moments staged in pinned host memory
    saver.close()
    again = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, device="cuda"))
    load_checkpoint(again, latest_checkpoint(tmp_path / "checkpoints"))
    moments = [s["exp_avg"] for s in again.optimizer.state.values()]
    assert moments and all(m.is_cuda for m in moments)
    assert all(torch.equal(a, b) for a, b in zip(
        again.state_dict().values(), state.values(), strict=True))  # fmt: skip


# --------------------------------------------------------------------------- FSDP2 on gloo


def _id_batch(rank: int) -> list[Trajectory]:
    """One group of two from raw token ids: 6 prompt and 4 generated tokens each."""
    out = []
    for i, reward in enumerate((1.0, 0.0)):
        prompt = tuple(range(50 + 10 * rank, 56 + 10 * rank))
        completion = tuple(300 + 40 * rank + 7 * i + k for k in range(4))
        segments = [Segment(prompt, False), Segment(completion, True)]
        out.append(Trajectory(f"r{rank}-{i}", f"g{rank}", segments, reward, True, {0}))
    return out


def _uneven_batch() -> list[Trajectory]:
    """Three groups of trajectories from 7 to 37 tokens (policy tokens 2 to 22, mu on
    some): rows that pack unevenly, so the ranks' shares and micro-batches differ."""
    out = []
    for i in range(9):
        prompt = tuple(range(40 + i, 45 + 2 * i))
        completion = tuple(200 + 13 * i + k for k in range(2 + (7 * i) % 21))
        mu = tuple(-0.5 - 0.01 * k for k in range(len(completion))) if i % 2 else ()
        segments = [Segment(prompt, False), Segment(completion, True, mu)]
        out.append(Trajectory(f"u{i}", f"g{i % 3}", segments, float(i % 4) / 3, True, {0}))
    return out


# minibatches of 5 and 4 rows, each rank's share packed into micro-batches of <= 32
# tokens; a KL term (the reference sharded like the policy)
UNEVEN = {
    "lr": 1e-2, "minibatch_size": 5, "micro_batch_tokens": 32, "epochs": 2, "kl_coef": 0.05,
    "max_staleness": 4,  # the same batch, step after step
}  # fmt: skip


def _fsdp_member(
    rank: int, store_file: str, model_dir: str, checkpoints: str, steps: int, out: Any
) -> None:
    """One of two FSDP2 ranks fed the whole batch as the master feeds it: shard, train
    ``steps`` steps, count the rows and tokens it forwards, gather the full weights,
    checkpoint its shards, resume from them, train one more step; report what it saw."""
    import traceback

    try:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        dist.init_process_group(
            "gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2
        )
        config = GRPOConfig(fsdp=True, **UNEVEN)
        trainer = GRPOTrainer(model_dir, config)
        assert trainer.sharded
        assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
        seen = {"rows": 0, "tokens": 0}

        def count(_module: Any, args: tuple[Any, ...]) -> None:
            if args[1].numel() == 2 and not args[0].any():
                return  # an empty forward (the other rank has more micro-batches)
            seen["rows"] += int((args[1] == 0).sum())  # a packed row starts at position 0
            seen["tokens"] += int(args[1].numel())

        trainer.policy.register_forward_pre_hook(count)
        stats = [trainer.train_step(_uneven_batch()) for _ in range(steps)]
        counted = dict(seen)  # in these steps
        state = trainer.state_dict()
        saver = Checkpointer(Path(checkpoints), 2, sharded=True, lead=rank == 0)
        saver.save(trainer)
        saver.close()  # this rank's shards written (trainer 0: the checkpoint complete)
        dist.barrier()
        resumed = GRPOTrainer(model_dir, config)
        load_checkpoint(resumed, Path(checkpoints) / f"v{steps:06d}")
        again = resumed.state_dict()
        moments = _adam(trainer) == _adam(resumed)
        same = all(torch.equal(state[k], again[k]) for k in state) and moments
        adam = _full_adam(trainer)  # gathered: what a resharded resume must hold
        trainer.train_step(_uneven_batch())  # one more step (a resume on 1 rank: the same)
        after = trainer.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        dist.destroy_process_group()
        arrays = {k: v.numpy() for k, v in state.items()}  # by value (no shared memory)
        later = {k: v.numpy() for k, v in after.items()}
        out.put((rank, (stats, counted, shapes, arrays, same, resumed.version, adam, later)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _adam(trainer: GRPOTrainer) -> list[bytes]:
    """This rank's AdamW state (its shards), as bytes: equal means bitwise equal."""
    out = []
    for state in trainer.optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            local = value.to_local() if hasattr(value, "to_local") else value
            out.append(local.detach().cpu().numpy().tobytes())
    return out


def _full_adam(trainer: GRPOTrainer) -> dict[str, bytes]:
    """The whole AdamW state by parameter name (gathered under FSDP; every rank calls
    it), as bytes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    return {
        f"{name}/{key}": value.numpy().tobytes()
        for name, entries in state.get("state", {}).items()
        for key, value in entries.items()
    }


@pytest.mark.parametrize(("model", "steps"), [("dense", 1), ("moe", 2)])
def test_fsdp2_ranks_fed_the_whole_batch_each_train_their_share_and_equal_one_process(
    request: pytest.FixtureRequest, tmp_path: Path, model: str, steps: int
) -> None:
    """Two FSDP2 ranks on gloo, each given the whole batch: each forwards only its share
    of every minibatch (balanced by tokens, packed into micro-batches of different sizes;
    the rank with fewer runs empty forwards), and each step -- loss, gradient norm, every
    weight -- equals one process training the whole batch. The MoE's decoder blocks,
    experts included, are sharded the same way (rows of a fused expert tensor are
    experts), and its gathered weights come out in the checkpoint's per-expert layout."""
    import multiprocessing as mp

    model_dir = request.getfixturevalue("tiny_model_dir" if model == "dense" else "tiny_moe_dir")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (str(tmp_path / "store"), str(model_dir), str(tmp_path / "checkpoints"), steps, out)
    procs = [ctx.Process(target=_fsdp_member, args=(r, *args), daemon=True) for r in (0, 1)]
    results = run_reporting(procs, out, {0, 1}, timeout_s=240)

    batch = _uneven_batch()
    single = GRPOTrainer(model_dir, GRPOConfig(**UNEVEN))
    ones = [single.train_step(batch) for _ in range(steps)]
    expected = single.state_dict()
    (stats0, seen0, shapes0, state0, same0, version0, adam0, later0) = results[0]
    (stats1, seen1, _, state1, same1, _, _, _) = results[1]
    assert shapes0 == {k: tuple(v.shape) for k, v in expected.items()}  # lm_head included
    assert state1 == {}  # gathered into rank 0's host memory only
    # the checkpoint resumes into the shards: weights and AdamW state bitwise
    assert same0 and same1 and version0 == steps

    # resharded: the two ranks' checkpoint on one process, bitwise what they held; one
    # more step equals theirs (to float rounding: their gradients add up in another order)
    one = GRPOTrainer(model_dir, GRPOConfig(**UNEVEN))
    load_checkpoint(one, tmp_path / "checkpoints" / f"v{steps:06d}")
    assert one.version == steps and _full_adam(one) == adam0
    loaded = one.state_dict()
    assert all(torch.equal(loaded[k], torch.from_numpy(v)) for k, v in state0.items())
    one.train_step(_uneven_batch())
    for name, tensor in one.state_dict().items():
        assert torch.allclose(torch.from_numpy(later0[name]), tensor, rtol=1e-5, atol=1e-5), name
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as checkpoint:
        assert set(state0) == set(checkpoint.keys())  # the checkpoint's layout and names

    tokens = sum(len(t.token_ids()) for t in batch)
    # each row once in the no-grad pass and once per epoch in the gradient pass, on one
    # rank, without padding; the ranks' tokens balanced
    assert seen0["rows"] + seen1["rows"] == 3 * len(batch) * steps
    assert seen0["tokens"] + seen1["tokens"] == 3 * tokens * steps
    assert 0.4 < seen0["tokens"] / (3 * tokens * steps) < 0.6
    assert stats0[0].forwards == stats1[0].forwards >= 2 * 5  # micro-batches: 2 a pass
    for mine, one in zip([*stats0, *stats1], ones * 2, strict=True):
        assert mine.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-6)
        assert mine.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
        assert mine.entropy == pytest.approx(one.entropy, rel=1e-4)
        assert mine.kl == pytest.approx(one.kl, rel=1e-3, abs=1e-7)
    for name, tensor in expected.items():
        # AdamW normalises each entry's gradient: an entry whose gradient is float noise
        # (an embedding row barely used) moves by up to lr either way; 1e-4 is a hundredth
        # of one update
        assert torch.allclose(torch.from_numpy(state0[name]), tensor, rtol=1e-4, atol=1e-4), name


def _fsdp_lender(store_file: str, model_dir: str, out: Any) -> None:
    """An FSDP2 rank that lends its device between two steps (its shards, their
    gradients and AdamW state to host memory and back: CPU to CPU here, the copies a
    CUDA trainer makes to pinned memory), beside one that keeps it."""
    import traceback

    try:
        import torch.distributed as dist

        from pearl_hpc.train.offload import IN_HOST, ON_DEVICE, Residency

        dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
        config = GRPOConfig(lr=1e-2, fsdp=True, minibatch_size=2)
        lender, keeper = GRPOTrainer(model_dir, config), GRPOTrainer(model_dir, config)
        lent = Residency([lender.policy], lender.optimizer, lender.device)
        lent._move(IN_HOST)  # lent before its first step (the first rollout's overlap)
        lent._move(ON_DEVICE)
        for trainer in (lender, keeper):
            trainer.train_step(_id_batch(0))

        def tensors() -> list[torch.Tensor]:
            shards = [p.to_local() for p in lender.model.parameters()]
            grads = [p.grad.to_local() for p in lender.model.parameters() if p.grad is not None]
            adam = [v.to_local() for s in lender.optimizer.state.values() for v in s.values()
                    if v.dim()]  # fmt: skip
            return shards + grads + adam

        for trainer in (lender, keeper):  # a forward last: the root keeps its unsharded copy
            trainer.logprobs([5, 6, 7, 8])
        lent._move(IN_HOST)
        held = tensors()
        moved = len(held) > 0 and all(t.untyped_storage().nbytes() == 0 for t in held)
        del held
        lent._move(ON_DEVICE)
        a, b = lender.train_step(_id_batch(0)), keeper.train_step(_id_batch(0))
        same = all(torch.equal(x, y) for x, y in zip(
            lender.state_dict().values(), keeper.state_dict().values(), strict=True))  # fmt: skip
        dist.destroy_process_group()
        out.put((0, (moved, same, a.loss == b.loss, a.grad_norm == b.grad_norm)))
    except BaseException:
        out.put((0, traceback.format_exc()))


def test_an_fsdp2_trainer_lends_its_device_and_trains_on_as_if_it_had_kept_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Lending a sharded trainer's GPU frees the storage of every shard, gradient and
    AdamW moment (after a no-grad forward too) and brings it back; the next step is bit
    for bit the step of a trainer that kept it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(
        target=_fsdp_lender, args=(str(tmp_path / "store"), str(tiny_model_dir), out), daemon=True
    )
    moved, same, loss_same, norm_same = run_reporting([proc], out, {0}, timeout_s=240)[0]
    assert moved, "some shard, gradient or AdamW moment kept its storage"
    assert same and loss_same and norm_same
