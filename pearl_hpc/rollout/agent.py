"""The asynchronous multi-turn agent loop.

Every trajectory is its own task; a batch has many in flight at once::

    reset(seed) -> prompt tokens
    loop:  router.generate(context)  -> response tokens   (resumed elsewhere if drained)
           env.step(decoded response) -> observation tokens, reward, done

Context is kept as token ids (never re-tokenised text), so the trainer scores exactly
the tokens the engines saw and produced. The chat format is ChatML: a turn's response
ends with ``<|im_end|>`` (added as an environment token when the model hit its budget),
then ``\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``.

**Interrupted turns** (a worker drained mid-generation returns the partial output) keep
the generated prefix: the turn is resent with ``context + partial`` and the remaining
budget, to whatever worker the router picks, so under greedy decoding the trajectory is
token-for-token the uninterrupted one. Environment progress lives in the trajectory's
:class:`Environment` object, which survives the move.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl_hpc.core.tracker import TurnRecord
from pearl_hpc.core.types import Role
from pearl_hpc.engine.types import TurnRequest
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.router import Router
from pearl_hpc.rollout.types import Segment, Trajectory, TurnStats


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Env(Protocol):
    max_turns: int

    async def reset(self, seed: int) -> str: ...
    async def step(self, action: str) -> Any: ...


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

    def __post_init__(self) -> None:
        for name in ("num_groups", "group_size", "max_tokens_per_turn", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {self.temperature}")


@dataclass
class ChatFormat:
    """Token pieces of the ChatML format, encoded once."""

    tokenizer: Tokenizer
    _cache: dict[str, list[int]] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._cache[text]

    def prompt(self, user_text: str) -> list[int]:
        return [
            *self.encode("<|im_start|>user\n"),
            *self.tokenizer.encode(user_text, add_special_tokens=False),
            *self.encode("<|im_end|>\n<|im_start|>assistant\n"),
        ]

    def observation(self, text: str, response_closed: bool) -> list[int]:
        close = [] if response_closed else [self.tokenizer.eos_token_id]
        return [
            *close,
            *self.encode("\n<|im_start|>user\n"),
            *self.tokenizer.encode(text, add_special_tokens=False),
            *self.encode("<|im_end|>\n<|im_start|>assistant\n"),
        ]


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
    clock: Callable[[], float] = time.perf_counter,
    resume: Trajectory | None = None,
    on_turn: Callable[[Trajectory], None] | None = None,
) -> Trajectory:
    """Run one trajectory to the end (``done`` from the environment or a limit).

    ``resume``: the trajectory as journaled after its last finished turn (a restarted
    master); the environment is brought to the same state by replaying the recorded
    actions, then the trajectory goes on. ``on_turn`` sees the trajectory after each turn.
    """
    first = chat.prompt(await env.reset(env_seed))
    total_reward = 0.0
    if resume is None:
        traj = Trajectory(trajectory_id=trajectory_id, group_id=group_id)
        traj.segments.append(Segment(tuple(first), generated=False))
        start_turn = 0
    else:
        traj, total_reward = resume, await _replay(env, chat, resume, first)
        start_turn = len(traj.turns)
    context = traj.token_ids()
    new_input = len(traj.segments[-1].token_ids)
    eos = chat.tokenizer.eos_token_id
    for turn in range(start_turn, env.max_turns):
        budget = min(config.max_tokens_per_turn, config.max_context_tokens - len(context))
        if budget < 1:
            traj.info["stopped"] = "max_context_tokens"
            break
        generated: list[int] = []
        workers: list[str] = []
        interruptions = 0
        while len(generated) < budget:
            request = TurnRequest(
                request_id=f"{trajectory_id}-t{turn}-a{interruptions}",
                prompt_token_ids=tuple(context + generated),
                max_tokens=budget - len(generated),
                temperature=config.temperature,
                seed=None
                if config.temperature == 0
                else sample_seed * 7919 + turn * 131 + interruptions,
                stop_token_ids=(eos,),
                logprobs=config.record_logprobs,
            )
            routed = await router.generate(trajectory_id, request)
            result = routed.result
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
        context.extend(generated)
        closed = bool(generated) and generated[-1] == eos
        t0 = clock()
        step = await env.step(chat.tokenizer.decode(generated, skip_special_tokens=True))
        env_s = clock() - t0
        total_reward += float(step.reward)
        traj.turns.append(
            TurnStats(
                turn, new_input, len(generated), len(context), env_s, tuple(workers), interruptions
            )
        )
        if step.done or step.observation is None:
            traj.done = True
            break
        obs = chat.observation(step.observation, closed)
        traj.segments.append(Segment(tuple(obs), generated=False))
        context.extend(obs)
        new_input = len(obs)
        if on_turn is not None:
            on_turn(traj)
    traj.done = True  # the environment ended it, or a turn / context limit did
    traj.reward = total_reward
    if on_turn is not None:
        on_turn(traj)
    router.table.forget(trajectory_id)
    return traj


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


async def _replay(env: Env, chat: ChatFormat, traj: Trajectory, first: list[int]) -> float:
    """Step ``env`` through ``traj``'s recorded actions; the total reward so far."""
    if list(traj.segments[0].token_ids) != first:
        raise ReplayError(f"{traj.trajectory_id}: the environment's prompt differs on replay")
    pieces = turn_pieces(traj)
    total = 0.0
    for i in range(len(traj.turns)):
        generated, observed = pieces[i] if i < len(pieces) else ([], None)
        step = await env.step(chat.tokenizer.decode(generated, skip_special_tokens=True))
        total += float(step.reward)
        closed = bool(generated) and generated[-1] == chat.tokenizer.eos_token_id
        if step.observation is None or observed is None:
            raise ReplayError(f"{traj.trajectory_id}: the episode ends early on replay")
        if observed != chat.observation(step.observation, closed):
            raise ReplayError(f"{traj.trajectory_id}: turn {i} observes something else on replay")
    return total


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
) -> list[Trajectory]:
    """All trajectories of one step, concurrently; ``on_done`` sees each as it finishes,
    ``on_turn`` after each of its turns. ``journaled`` (by trajectory id): what a previous
    master recorded of this step -- finished ones are kept, unfinished ones resumed."""
    journaled = journaled or {}

    async def one(group: int, sample: int) -> Trajectory:
        trajectory_id = f"s{step}-g{group}-k{sample}"
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
            resume=earlier,
            on_turn=on_turn,
        )
        if on_done is not None:
            on_done(traj)
        return traj

    tasks = [one(g, k) for g in range(config.num_groups) for k in range(config.group_size)]
    return list(await asyncio.gather(*tasks))
