"""The asynchronous multi-turn agent loop.

Every trajectory is its own task; a batch has many in flight at once::

    reset(seed) -> prompt tokens
    loop:  router.generate(context)  -> response tokens   (resumed elsewhere if drained)
           env.step(decoded response) -> observation tokens, reward, done

Context is kept as token ids (never re-tokenised text), so the trainer scores exactly
the tokens the engines saw and produced. The chat format is the model directory's own
chat template (:class:`ChatFormat`): the prompt is the template's rendering of the user
message (with the environment's tools in the system prompt), a turn's response ends with
the end-of-turn token (added as an environment token when the model hit its budget), and
an observation is the template's user or tool message, then the generation prompt.

**Environment faults** fail one trajectory, never the batch: an environment call that
raises or runs past ``env_timeout_s`` ends the trajectory with ``info["failed"]`` (the
reason) and reward 0; the trainer leaves such trajectories out.

**Interrupted turns** (a worker drained mid-generation returns the partial output) keep
the generated prefix: the turn is resent with ``context + partial`` and the remaining
budget, to whatever worker the router picks, so under greedy decoding the trajectory is
token-for-token the uninterrupted one. Environment progress lives in the trajectory's
:class:`Environment` object, which survives the move.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pearl_hpc.core.tracker import TurnRecord
from pearl_hpc.core.types import Role
from pearl_hpc.engine.types import TurnRequest
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.base import Environment as Env
from pearl_hpc.rollout.router import Router
from pearl_hpc.rollout.tasks import Task, TaskSet
from pearl_hpc.rollout.types import Segment, Trajectory, TurnStats

MARK = "\u2063PEARL\u2063"  # stands for a message's content when the template is split
T = TypeVar("T")


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RolloutConfig:
    """One rollout batch: ``num_groups`` prompts x ``group_size`` samples each."""

    num_groups: int = 4
    group_size: int = 4  # GRPO group: samples of the same prompt
    max_tokens_per_turn: int = 32
    max_context_tokens: int = 768  # a trajectory stops before its context passes this
    temperature: float = 1.0  # 0 = greedy
    seed: int = 0
    record_logprobs: bool = True  # the engines' log-prob of every generated token (mu)
    env_timeout_s: float = 120.0  # one reset() or step(); past it the trajectory fails

    def __post_init__(self) -> None:
        for name in ("num_groups", "group_size", "max_tokens_per_turn", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not self.env_timeout_s > 0:
            raise ConfigError(f"rollout.env_timeout_s must be > 0, got {self.env_timeout_s}")


@dataclass
class ChatFormat:
    """The chat template's pieces around a message, rendered once per role (and tool set).

    A message is the template's text before its content, the content tokenized on its
    own, and the text after it up to the next generation prompt -- so a conversation is
    extended token by token without re-tokenising what the model already saw. A
    tokenizer without a chat template gets the tiny model's ChatML one.
    """

    tokenizer: Tokenizer
    _cache: dict[str, list[int]] = field(default_factory=dict)
    _pieces: dict[Any, tuple[str, str]] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._cache[text]

    def prompt(self, user_text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The first user message (``tools``: JSON-schema specs shown by the template)."""
        key = ("prompt", repr(tools))
        if key not in self._pieces:
            text = self._render([{"role": "user", "content": MARK}], tools)
            self._pieces[key] = _split_at_mark(text)
        head, tail = self._pieces[key]
        return [*self.encode(head), *self._content(user_text), *self.encode(tail)]

    def observation(self, text: str, response_closed: bool, role: str = "user") -> list[int]:
        """What follows a response: the end-of-turn token unless the model wrote it, the
        environment's message as ``role`` (user | tool), then the generation prompt."""
        key = ("observation", role)
        if key not in self._pieces:
            self._pieces[key] = self._after_response(role)
        head, tail = self._pieces[key]
        close = [] if response_closed else [self.tokenizer.eos_token_id]
        return [*close, *self.encode(head), *self._content(text), *self.encode(tail)]

    def _content(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _after_response(self, role: str) -> tuple[str, str]:
        """The template's text between an assistant message's end-of-turn token and the
        next message's content, and after that content."""
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id], skip_special_tokens=False)
        reply = "\u2063R\u2063"
        conversation = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": reply},
            {"role": role, "content": MARK},
        ]
        text = self._render(conversation, None)
        end = text.find(reply + eos)
        if end < 0:
            raise ConfigError(
                f"the chat template does not end an assistant message with {eos!r} (the "
                "tokenizer's eos token); set eos_token to the template's end-of-turn token"
            )
        return _split_at_mark(text[end + len(reply + eos) :])

    def _render(self, messages: list[dict[str, str]], tools: Any) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = list(tools)
        if not getattr(self.tokenizer, "chat_template", None):
            from pearl_hpc.engine.tinymodel import CHAT_TEMPLATE

            kwargs["chat_template"] = CHAT_TEMPLATE
        return str(self.tokenizer.apply_chat_template(messages, **kwargs))


def _split_at_mark(text: str) -> tuple[str, str]:
    head, found, tail = text.partition(MARK)
    if not found:
        raise ConfigError("the chat template drops a message's content; use a chat model's")
    return head, tail


def tracker_turns(
    trajectories: Sequence[Trajectory], slot_of: Mapping[str, int], role_of: Mapping[str, Role]
) -> list[TurnRecord]:
    """Per-turn telemetry for the runtime tracker: one record per finished turn, credited
    to the worker that finished it (the last one when the turn was resumed elsewhere)."""
    records = []
    for traj in trajectories:
        for turn in traj.turns:
            worker = turn.worker_ids[-1] if turn.worker_ids else ""
            records.append(
                TurnRecord(
                    trajectory_id=traj.trajectory_id,
                    turn_index=turn.turn_index,
                    new_input_tokens=turn.new_input_tokens,
                    generated_tokens=turn.generated_tokens,
                    context_tokens=turn.context_tokens,
                    env_s=turn.env_s,
                    slot_id=slot_of.get(worker, -1),
                    role=role_of.get(worker, Role.COLOCATED),
                    generate_s=turn.generate_s,
                )
            )
    return records


def trajectory_seed(base_seed: int, group: int) -> int:
    """The environment seed of a group (all samples of a group share their task)."""
    return base_seed * 1_000_003 + group


async def run_trajectory(
    router: Router,
    env: Env,
    chat: ChatFormat,
    *,
    trajectory_id: str,
    group_id: str,
    env_seed: int,
    sample_seed: int,
    config: RolloutConfig,
    task: Task | None = None,
    clock: Callable[[], float] = time.perf_counter,
    resume: Trajectory | None = None,
    on_turn: Callable[[Trajectory], None] | None = None,
) -> Trajectory:
    """Run one trajectory to the end (``done`` from the environment or a limit).

    ``task``: the group's row of ``run.tasks`` (None: the environment draws one from the
    seed). ``resume``: the trajectory as journaled after its last finished turn (a
    restarted master); the environment is brought to the same state by replaying the
    recorded actions, then the trajectory goes on. ``on_turn`` sees the trajectory after
    each turn. An environment fault ends it as failed (module docstring).
    """
    traj = resume or Trajectory(trajectory_id=trajectory_id, group_id=group_id)
    if task is not None:
        traj.info["task_id"] = task["id"]
    try:
        await _run_turns(
            router, env, chat, traj, env_seed, sample_seed, config, task, clock, on_turn
        )
    except EnvironmentFault as fault:
        traj.info["failed"] = str(fault)
        traj.done, traj.reward = True, 0.0
        if on_turn is not None:
            on_turn(traj)
    router.table.forget(trajectory_id)
    return traj


class EnvironmentFault(RuntimeError):
    """The environment raised or timed out: its trajectory fails, the batch goes on."""


async def _env_call(what: str, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    try:
        return await asyncio.wait_for(call(), timeout_s)
    except TimeoutError:
        raise EnvironmentFault(f"environment {what} timed out after {timeout_s:g} s") from None
    except Exception as e:
        raise EnvironmentFault(f"environment {what} raised {type(e).__name__}: {e}") from None


async def _run_turns(
    router: Router,
    env: Env,
    chat: ChatFormat,
    traj: Trajectory,
    env_seed: int,
    sample_seed: int,
    config: RolloutConfig,
    task: Task | None,
    clock: Callable[[], float],
    on_turn: Callable[[Trajectory], None] | None,
) -> None:
    timeout_s = config.env_timeout_s

    def reset() -> Awaitable[str]:
        return env.reset(env_seed) if task is None else env.reset(env_seed, task)

    user_text = await _env_call("reset", reset, timeout_s)
    first = chat.prompt(user_text, getattr(env, "tools", None))
    total_reward = 0.0
    if not traj.segments:
        traj.segments.append(Segment(tuple(first), generated=False))
        start_turn = 0
    else:
        total_reward = await _replay(env, chat, traj, first, timeout_s)
        start_turn = len(traj.turns)
    context = traj.token_ids()
    new_input = len(traj.segments[-1].token_ids)
    eos = chat.tokenizer.eos_token_id
    for turn in range(start_turn, env.max_turns):
        budget = min(config.max_tokens_per_turn, config.max_context_tokens - len(context))
        if budget < 1:
            traj.info["stopped"] = "max_context_tokens"
            break
        t_request = clock()
        generated, workers, interruptions = await _generate(
            router, traj, context, turn, budget, sample_seed, config, eos
        )
        generate_s = clock() - t_request
        context.extend(generated)
        closed = bool(generated) and generated[-1] == eos
        t0 = clock()
        action = chat.tokenizer.decode(generated, skip_special_tokens=True)
        step = await _env_call(f"step {turn}", functools.partial(env.step, action), timeout_s)
        env_s = clock() - t0
        total_reward += _reward_of(step, turn)
        traj.turns.append(
            TurnStats(
                turn,
                new_input,
                len(generated),
                len(context),
                env_s,
                tuple(workers),
                interruptions,
                generate_s,
            )
        )
        if step.done or step.observation is None:
            traj.done = True
            break
        obs = chat.observation(step.observation, closed, getattr(step, "role", "user"))
        traj.segments.append(Segment(tuple(obs), generated=False))
        context.extend(obs)
        new_input = len(obs)
        if on_turn is not None:
            on_turn(traj)
    traj.done = True  # the environment ended it, or a turn / context limit did
    traj.reward = total_reward
    if on_turn is not None:
        on_turn(traj)


async def _generate(
    router: Router,
    traj: Trajectory,
    context: list[int],
    turn: int,
    budget: int,
    sample_seed: int,
    config: RolloutConfig,
    eos: int,
) -> tuple[list[int], list[str], int]:
    """One model turn: the response tokens, the workers that produced them and how many
    times a drain interrupted it (each attempt is its own segment of ``traj``)."""
    generated: list[int] = []
    workers: list[str] = []
    interruptions = 0
    while len(generated) < budget:
        request = TurnRequest(
            request_id=f"{traj.trajectory_id}-t{turn}-a{interruptions}",
            prompt_token_ids=tuple(context + generated),
            max_tokens=budget - len(generated),
            temperature=config.temperature,
            seed=None
            if config.temperature == 0
            else sample_seed * 7919 + turn * 131 + interruptions,
            stop_token_ids=(eos,),
            logprobs=config.record_logprobs,
        )
        result = (await router.generate(traj.trajectory_id, request)).result
        generated.extend(result.token_ids)
        workers.append(result.worker_id)
        traj.weight_versions.add(result.weight_version)
        if result.token_ids:  # one segment per attempt: its own log-probs and weights
            attempt = Segment(
                result.token_ids, True, result.logprobs, weight_version=result.weight_version
            )
            traj.segments.append(attempt)
        if not result.aborted:
            break
        interruptions += 1
    if not generated:
        traj.segments.append(Segment((), generated=True))  # an empty response
    return generated, workers, interruptions


def _reward_of(step: Any, turn: int) -> float:
    """A step's reward, or a fault when the environment answered something else."""
    reward = getattr(step, "reward", None)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvironmentFault(
            f"environment step {turn} answered {type(step).__name__} with reward "
            f"{reward!r}; step() returns an EnvStep with a finite reward"
        )
    return float(reward)


class ReplayError(RuntimeError):
    """A journaled trajectory does not replay: the environment is not deterministic."""


def turn_pieces(traj: Trajectory) -> list[tuple[list[int], list[int] | None]]:
    """Each turn's response (its generated segments joined: a resumed turn has several)
    and the observation after it (None after the last turn), in order."""
    pieces: list[tuple[list[int], list[int] | None]] = []
    response: list[int] | None = None
    for segment in traj.segments[1:]:
        if segment.generated:
            response = (response or []) + list(segment.token_ids)
        else:
            pieces.append((response or [], list(segment.token_ids)))
            response = None
    if response is not None:
        pieces.append((response, None))
    return pieces


async def _replay(
    env: Env, chat: ChatFormat, traj: Trajectory, first: list[int], timeout_s: float
) -> float:
    """Step ``env`` through ``traj``'s recorded actions; the total reward so far."""
    if list(traj.segments[0].token_ids) != first:
        raise ReplayError(f"{traj.trajectory_id}: the environment's prompt differs on replay")
    pieces = turn_pieces(traj)
    total = 0.0
    for i in range(len(traj.turns)):
        generated, observed = pieces[i] if i < len(pieces) else ([], None)
        action = chat.tokenizer.decode(generated, skip_special_tokens=True)
        step = await _env_call(f"step {i} (replay)", functools.partial(env.step, action), timeout_s)
        total += _reward_of(step, i)
        closed = bool(generated) and generated[-1] == chat.tokenizer.eos_token_id
        if step.observation is None or observed is None:
            raise ReplayError(f"{traj.trajectory_id}: the episode ends early on replay")
        if observed != chat.observation(step.observation, closed, getattr(step, "role", "user")):
            raise ReplayError(f"{traj.trajectory_id}: turn {i} observes something else on replay")
    return total


def trajectory_ids(step: int, config: RolloutConfig) -> list[str]:
    """Step ``step``'s trajectory ids in the batch's order (by group, then sample): the
    order :func:`rollout_batch` returns them in, and a replay trains them in."""
    return [
        f"s{step}-g{group}-k{sample}"
        for group in range(config.num_groups)
        for sample in range(config.group_size)
    ]


async def rollout_batch(
    router: Router,
    make_env: Callable[[], Env],
    chat: ChatFormat,
    config: RolloutConfig,
    *,
    step: int = 0,
    on_done: Callable[[Trajectory], None] | None = None,
    on_turn: Callable[[Trajectory], None] | None = None,
    journaled: Mapping[str, Trajectory] | None = None,
    tasks: TaskSet | None = None,
) -> list[Trajectory]:
    """All trajectories of one step, concurrently; ``on_done`` sees each as it finishes,
    ``on_turn`` after each of its turns. ``journaled`` (by trajectory id): what a previous
    master recorded of this step -- finished ones are kept, unfinished ones resumed.
    ``tasks``: group g of step s gets ``tasks.for_group(s, g, num_groups)``."""
    journaled = journaled or {}
    ids = trajectory_ids(step, config)

    async def one(group: int, sample: int) -> Trajectory:
        trajectory_id = ids[group * config.group_size + sample]
        earlier = journaled.get(trajectory_id)
        if earlier is not None and earlier.done:
            return earlier
        traj = await run_trajectory(
            router,
            make_env(),
            chat,
            trajectory_id=trajectory_id,
            group_id=f"s{step}-g{group}",
            env_seed=trajectory_seed(config.seed + step, group),
            sample_seed=(config.seed + step) * 10_007 + group * 101 + sample,
            config=config,
            task=None if tasks is None else tasks.for_group(step, group, config.num_groups),
            resume=earlier,
            on_turn=on_turn,
        )
        if on_done is not None:
            on_done(traj)
        return traj

    runs = [one(g, k) for g in range(config.num_groups) for k in range(config.group_size)]
    return list(await asyncio.gather(*runs))
