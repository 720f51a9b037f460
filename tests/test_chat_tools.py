"""The chat template's own pieces (tools in the system prompt, results in the tool role)
with the tiny model's real tokenizer, and hand-written tool calls through the agent loop
into the code and calc environments (an engine that answers with scripted text: the
loop, the template, the environment and the sandbox are the real ones)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pearl_hpc.core.types import Mode, Role
from pearl_hpc.engine.types import TurnRequest, TurnResult
from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig, run_trajectory
from pearl_hpc.rollout.envs import make_env
from pearl_hpc.rollout.envs.code import CODE_TOOLS
from pearl_hpc.rollout.router import Router
from pearl_hpc.rollout.sandbox import sandbox_problem

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=str(sandbox_problem()))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_pieces_are_the_templates_rendering(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    prompt = chat.prompt("Solve it.", CODE_TOOLS)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Solve it."}],
        tools=CODE_TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(prompt) == rendered
    assert '"name": "submit"' in rendered and "<tool_call>" in rendered
    response = tokenizer.encode("calling a tool", add_special_tokens=False)
    tool = chat.observation("42", response_closed=False, role="tool")
    user = chat.observation("try again", response_closed=False, role="user")
    conversation = [
        {"role": "user", "content": "Solve it."},
        {"role": "assistant", "content": "calling a tool"},
    ]
    for piece, message in (
        (tool, {"role": "tool", "content": "42"}),
        (user, {"role": "user", "content": "try again"}),
    ):
        whole = tokenizer.apply_chat_template(
            [*conversation, message], tools=CODE_TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.decode(prompt + response + piece) == whole
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(tool)


class ScriptedEngine:
    """Answers the n-th turn of a trajectory with ``script[n]`` (tokenized, then the end
    of turn): the text a policy would write."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.turns: dict[str, int] = {}
        self.prompts: list[tuple[int, ...]] = []

    async def generate(self, request: TurnRequest) -> TurnResult:
        trajectory = request.request_id.rsplit("-t", 1)[0]
        turn = self.turns.get(trajectory, 0)
        self.turns[trajectory] = turn + 1
        self.prompts.append(request.prompt_token_ids)
        text = self.script[min(turn, len(self.script) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: request.max_tokens - 1]
        ids = (*ids, self.tokenizer.eos_token_id)
        return TurnResult(request.request_id, "s", ids, "stop", 0, len(request.prompt_token_ids), 0)


def call(name: str, **arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def play(tokenizer, env, script: list[str]):
    engine = ScriptedEngine(tokenizer, script)
    router = Router(wait_for_workers_s=1.0)
    router.set_workers({"s": engine}, {"s": Role.COLOCATED}, Mode.COLOCATED)  # type: ignore[dict-item]
    config = RolloutConfig(max_tokens_per_turn=512, max_context_tokens=8192, temperature=0)
    traj = asyncio.run(
        run_trajectory(
            router,
            env,
            ChatFormat(tokenizer),
            trajectory_id="t",
            group_id="g",
            env_seed=0,
            sample_seed=0,
            config=config,
        )
    )
    return traj, engine


RIGHT = (
    "def has_close_elements(numbers, threshold):\n"
    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
    "               for j, b in enumerate(numbers) if i != j)\n"
)
WRONG = "def has_close_elements(numbers, threshold):\n    return False\n"


@needs_sandbox
def test_a_hand_written_solution_earns_its_share_of_the_hidden_tests(tokenizer) -> None:
    script = [call("run_examples", code=RIGHT), call("submit", code=RIGHT)]
    traj, engine = play(tokenizer, make_env("code", split="all"), script)
    assert traj.reward == 1.0 and len(traj.turns) == 2 and not traj.info.get("failed")
    second_prompt = tokenizer.decode(engine.prompts[1])
    assert "<tool_response>\nexample 1: ok\nexample 2: ok\n</tool_response>" in second_prompt
    wrong, _ = play(tokenizer, make_env("code", split="all"), [call("submit", code=WRONG)])
    assert wrong.reward == pytest.approx(3 / 7)


@needs_sandbox
def test_calc_takes_standard_tool_calls(tokenizer) -> None:
    env = make_env("calc", tool_format="hermes", max_turns=3)
    target = asyncio.run(make_env("calc").reset(0)).split("What is ")[1].split("?")[0]
    script = [call("python", code=f"print({target})"), "<answer>X</answer>"]
    traj, engine = play(tokenizer, env, script)
    observed = tokenizer.decode(engine.prompts[1])
    assert "<tool_response>" in observed and '"name": "calc"' in tokenizer.decode(engine.prompts[0])
    assert traj.reward > 1.0  # the tool's value hit the target (correct_weight) + format


def test_an_environment_fault_fails_its_trajectory_only(tokenizer) -> None:
    class Broken:
        max_turns = 3

        def __init__(self, where: str) -> None:
            self.where = where

        async def reset(self, seed: int) -> str:
            if self.where == "reset":
                raise KeyError("no such task")
            return "go"

        async def step(self, action: str):
            if self.where == "hang":
                await asyncio.sleep(60)
            return {"reward": 1}  # not an EnvStep

    engine = ScriptedEngine(tokenizer, ["hi"])
    router = Router(wait_for_workers_s=1.0)
    router.set_workers({"s": engine}, {"s": Role.COLOCATED}, Mode.COLOCATED)  # type: ignore[dict-item]
    config = RolloutConfig(max_tokens_per_turn=8, temperature=0, env_timeout_s=0.5)

    async def run(where: str):
        return await run_trajectory(
            router,
            Broken(where),
            ChatFormat(tokenizer),
            trajectory_id=where,
            group_id="g",
            env_seed=0,
            sample_seed=0,
            config=config,
        )

    reset, hang, bad = asyncio.run(asyncio.wait_for(_all(run), 30))
    assert reset.info["failed"] == "environment reset raised KeyError: 'no such task'"
    assert hang.info["failed"] == "environment step 0 timed out after 0.5 s"
    assert "answered dict with reward None" in bad.info["failed"]
    assert all(t.done and t.reward == 0.0 for t in (reset, hang, bad))


async def _all(run):
    return await asyncio.gather(run("reset"), run("hang"), run("bad"))
