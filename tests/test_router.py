"""Routing rules, the agent loop's resume logic and the engine RPC, without vLLM: a small
hand-written fake engine stands in for a worker (the real engines are in
test_engine_vllm.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pearl_hpc.core.routing import RoutingRule
from pearl_hpc.core.types import Mode, Role
from pearl_hpc.engine.rpc import RpcClient, new_key, serve
from pearl_hpc.engine.types import Draining, EngineError, TurnRequest, TurnResult
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig, rollout_batch, run_trajectory
from pearl_hpc.rollout.router import IdleTotals, NoWorkers, Router, RoutingTable

EOS = 0


class FakeEngine:
    """Deterministic 'model': the next token is (sum of context) % 97 + 1, EOS after a
    context-dependent length. Generates one token per ``tick_s``; can be drained."""

    def __init__(self, worker_id: str, tick_s: float = 0.0) -> None:
        self.worker_id = worker_id
        self.tick_s = tick_s
        self.admitting = True
        self.version = 0  # weights it serves
        self.requests: list[TurnRequest] = []
        self._abort = asyncio.Event()

    @staticmethod
    def continuation(context: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        out: list[int] = []
        ctx = list(context)
        while len(out) < max_tokens:
            token = EOS if len(ctx) % 23 == 0 else sum(ctx) % 97 + 1
            out.append(token)
            ctx.append(token)
            if token == EOS:
                break
        return tuple(out)

    async def generate(self, request: TurnRequest) -> TurnResult:
        if not self.admitting:
            raise Draining(f"{self.worker_id} is not admitting work")
        self.requests.append(request)
        if request.prefill_only:
            return self._result(request, (), "length", {"remote": self.worker_id})
        full = self.continuation(request.prompt_token_ids, request.max_tokens)
        produced: tuple[int, ...] = ()
        for i in range(len(full)):
            if self.tick_s:
                await asyncio.sleep(self.tick_s)
            if self._abort.is_set():
                return self._result(request, produced, "abort")
            produced = full[: i + 1]
        return self._result(request, produced, "stop" if produced[-1:] == (EOS,) else "length")

    def _result(
        self, request: TurnRequest, tokens: tuple[int, ...], reason: str, kv: dict | None = None
    ) -> TurnResult:
        return TurnResult(
            request.request_id,
            self.worker_id,
            tokens,
            reason,
            self.version,
            len(request.prompt_token_ids),
            0,
            kv,
        )

    async def drain(self) -> None:
        self.admitting = False
        self._abort.set()


class FakeTokenizer:
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 50 + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return " ".join("|" if i == EOS else str(i) for i in ids)
        return " ".join(str(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(f"{m['role'][0]}:{m['content']}|" for m in messages)  # "|": the eos
        return text + ("a:" if add_generation_prompt else "")


@dataclass
class Step:
    observation: str | None
    reward: float
    done: bool


class CountingEnv:
    max_turns = 3

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, seed: int) -> str:
        return f"task {seed}"

    async def step(self, action: str) -> Step:
        self.turns += 1
        done = self.turns == self.max_turns
        return Step(None if done else f"obs {self.turns}", float(len(action) > 0), done)


def _router(engines: dict[str, FakeEngine], roles: dict[str, Role], mode: Mode) -> Router:
    router = Router(wait_for_workers_s=1.0)
    router.set_workers(engines, roles, mode)  # type: ignore[arg-type]
    return router


# --------------------------------------------------------------------------- pure table


def test_least_loaded_with_stated_tie_break():
    table = RoutingTable()
    table.set_roles({"b": Role.COLOCATED, "a": Role.COLOCATED, "c": Role.COLOCATED})
    assert table.choose(Role.COLOCATED) == "a"  # all equal: smallest id
    table.started("a")
    assert table.choose(Role.COLOCATED) == "b"
    table.started("b")
    table.finished("a")
    table.finished("b")  # equal load again; a and b routed once each, c never
    assert table.choose(Role.COLOCATED) == "c"


def test_sticky_to_prefix_cache_unless_overloaded():
    table = RoutingTable(rule=RoutingRule(slack=2, slack_ratio=0.5))
    table.set_roles({"a": Role.COLOCATED, "b": Role.COLOCATED})
    table.started("b", "traj")
    table.finished("b")
    assert table.choose(Role.COLOCATED, "traj") == "b"  # holds the prefix cache
    for _ in range(3):
        table.started("b")
    assert table.choose(Role.COLOCATED, "traj") == "a"  # 3 more in flight: too busy
    table.set_admitting("a", False)
    assert table.choose(Role.COLOCATED, "traj") == "b"


def test_pd_keeps_the_prefix_on_its_prefill_worker_and_decode_goes_least_loaded():
    table = RoutingTable(mode=Mode.DISAGGREGATED)
    roles = {"p1": Role.PREFILL, "p2": Role.PREFILL, "d1": Role.DECODE, "d2": Role.DECODE}
    table.set_roles(roles)
    table.started("p2", "traj")  # the trajectory's last prefill ran on p2
    table.finished("p2")
    table.started("d2")
    assert table.choose(Role.PREFILL, "traj") == "p2"  # it holds the prefix
    assert table.choose(Role.PREFILL, "other") == "p1"  # no prefix: least routed
    assert table.choose(Role.DECODE, "traj") == "d1"  # decode: least loaded, no stickiness


def test_route_mode_follows_the_table_and_what_exists():
    table = RoutingTable(mode=Mode.DISAGGREGATED)
    table.set_roles({"p": Role.PREFILL, "d": Role.DECODE, "c": Role.COLOCATED})
    assert table.route_mode() is Mode.DISAGGREGATED
    table.set_admitting("d", False)
    assert table.route_mode() is Mode.COLOCATED  # no decode admitting: colocated serves
    table.remove("c")
    assert table.route_mode() is None


def test_idle_time_is_each_routed_workers_time_with_nothing_in_flight():
    now = [0.0]
    table = RoutingTable(clock=lambda: now[0])
    table.set_roles({"a": Role.COLOCATED, "b": Role.COLOCATED})
    start = table.idle_totals()
    now[0] = 1.0
    table.started("a")  # a idle 1 s, then busy
    now[0] = 3.0
    table.finished("a")  # busy 2 s
    now[0] = 4.0
    table.remove("b")  # b idle its whole 4 s, settled on removal
    table.set_roles({"a": Role.COLOCATED, "c": Role.COLOCATED})  # c joins at 4 s
    now[0] = 5.0
    totals = table.idle_totals()
    assert (totals.worker_s, totals.idle_s) == (5.0 + 4.0 + 1.0, 3.0 + 4.0 + 1.0)
    assert totals.since(start).share == 8.0 / 10.0
    now[0] = 6.0
    table.started("c")
    now[0] = 7.0
    later = table.idle_totals()  # over 5..7: a idle 2 s, c idle 1 s of 4 worker-seconds
    assert later.since(totals) == IdleTotals(4.0, 3.0)


def test_a_batch_reaches_its_tail_below_the_level_the_workers_keep_busy():
    from pearl_hpc.master.steps import BatchProgress

    async def scenario() -> None:
        level = [3.0]
        progress = BatchProgress(lambda: level[0], Router())
        progress.begin(5)
        assert not progress.tail.is_set()
        progress.finished_one(None)  # type: ignore[arg-type]
        progress.finished_one(None)  # type: ignore[arg-type]
        assert not progress.tail.is_set()  # 3 left: not below 3
        level[0] = 4.0  # a worker joined: the level rises
        progress.check()
        assert progress.tail.is_set() and progress.tail_t is not None
        resumed = BatchProgress(lambda: 1.0, Router())
        resumed.begin(0)  # every trajectory finished before a resume: all tail
        assert resumed.tail.is_set()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- dispatch


def test_disaggregated_turn_goes_prefill_then_decode_with_kv_params():
    async def main() -> None:
        engines = {"p": FakeEngine("p"), "d": FakeEngine("d")}
        router = _router(engines, {"p": Role.PREFILL, "d": Role.DECODE}, Mode.DISAGGREGATED)
        routed = await router.generate("t", TurnRequest("r", (5, 6, 7), 4))
        assert routed.mode is Mode.DISAGGREGATED and routed.prefill_worker == "p"
        assert engines["p"].requests[0].prefill_only
        assert engines["d"].requests[0].kv_transfer_params == {"remote": "p"}
        assert routed.result.token_ids == FakeEngine.continuation((5, 6, 7), 4)

    asyncio.run(main())


def test_local_prefill_sends_a_turn_whole_to_the_decode_worker_holding_its_prefix():
    """Conditional disaggregation: the decode worker that generated a trajectory's last
    turn holds prompt + output; a turn extending it goes there whole when the rule says
    so (told the uncached tokens, the prompt and the worker's load), else through PD."""

    async def main() -> None:
        asked: list[tuple[int, int, int]] = []
        verdict = [True]

        def rule(uncached: int, prompt: int, decoding: int) -> bool:
            asked.append((uncached, prompt, decoding))
            return verdict[0]

        engines = {"p": FakeEngine("p"), "d1": FakeEngine("d1"), "d2": FakeEngine("d2")}
        roles = {"p": Role.PREFILL, "d1": Role.DECODE, "d2": Role.DECODE}
        router = _router(engines, roles, Mode.DISAGGREGATED)
        router.table.local_prefill = rule
        first = await router.generate("t", TurnRequest("r1", (5, 6, 7), 4))
        assert first.prefill_worker == "p" and asked == []  # nothing held yet
        holder = first.result.worker_id
        context = (5, 6, 7, *first.result.token_ids)
        second = await router.generate("t", TurnRequest("r2", (*context, 9, 9), 4))
        assert second.prefill_worker == holder == second.result.worker_id
        assert asked == [(2, len(context) + 2, 0)]
        assert not engines[holder].requests[-1].prefill_only
        assert engines[holder].requests[-1].kv_transfer_params is None  # prefilled there
        assert len(engines["p"].requests) == 1 and router.local_prefills == {"t": 1}
        assert second.result.token_ids == FakeEngine.continuation((*context, 9, 9), 4)

        context += (9, 9, *second.result.token_ids)
        verdict[0] = False  # the rule prefers the transfer: PD as before
        third = await router.generate("t", TurnRequest("r3", (*context, 8), 4))
        assert third.prefill_worker == "p" and len(engines["p"].requests) == 2
        context += (8, *third.result.token_ids)

        verdict[0] = True
        rewritten = await router.generate("t", TurnRequest("r4", (1, *context), 4))
        assert rewritten.prefill_worker == "p"  # the prompt no longer extends the context
        context = (1, *context, *rewritten.result.token_ids)
        for engine in engines.values():
            engine.version = 1  # a weight update emptied the prefix caches
        await router.generate("u", TurnRequest("r5", (4, 4), 4))  # a turn sees v1
        stale = await router.generate("t", TurnRequest("r6", (*context, 7), 4))
        assert stale.prefill_worker == "p"  # its holder last served v0
        context += (7, *stale.result.token_ids)
        held = router.table.decode_holder["t"].worker_id
        engines[held].admitting = False
        router.table.set_admitting(held, False)
        drained = await router.generate("t", TurnRequest("r7", (*context, 7), 4))
        assert drained.prefill_worker == "p" and router.local_prefills == {"t": 1}
        router.table.forget("t")
        assert "t" not in router.table.decode_holder

    asyncio.run(main())


def test_draining_worker_is_skipped_and_no_workers_times_out():
    async def main() -> None:
        engines = {"a": FakeEngine("a"), "b": FakeEngine("b")}
        engines["a"].admitting = False
        router = _router(engines, {"a": Role.COLOCATED, "b": Role.COLOCATED}, Mode.COLOCATED)
        routed = await router.generate("t", TurnRequest("r", (1, 2), 3))
        assert routed.result.worker_id == "b"
        engines["b"].admitting = False
        with pytest.raises(NoWorkers, match="no admitting rollout worker"):
            await router.generate("t", TurnRequest("r2", (1, 2), 3))

    asyncio.run(main())


def test_paused_admission_holds_new_turns_until_resume():
    async def main() -> None:
        router = _router({"a": FakeEngine("a")}, {"a": Role.COLOCATED}, Mode.COLOCATED)
        router.pause()
        task = asyncio.create_task(router.generate("t", TurnRequest("r", (1,), 2)))
        await asyncio.sleep(0.05)
        assert not task.done()
        router.resume()
        assert (await task).result.token_ids

    asyncio.run(main())


def test_failed_worker_is_removed_and_the_turn_rerouted():
    class Dead(FakeEngine):
        async def generate(self, request: TurnRequest) -> TurnResult:
            raise EngineError("connection lost")

    async def main() -> None:
        engines = {"a": Dead("a"), "b": FakeEngine("b")}
        router = _router(engines, {"a": Role.COLOCATED, "b": Role.COLOCATED}, Mode.COLOCATED)
        routed = await router.generate("t", TurnRequest("r", (1, 2), 3))
        assert routed.result.worker_id == "b" and "a" not in router.clients

    asyncio.run(main())


# --------------------------------------------------------------------------- agent loop


def test_interrupted_trajectories_resume_with_identical_tokens():
    config = RolloutConfig(num_groups=2, group_size=3, max_tokens_per_turn=40, temperature=0)
    chat = ChatFormat(FakeTokenizer())

    async def batch(router: Router) -> list:
        return await rollout_batch(router, CountingEnv, chat, config)

    async def main() -> None:
        reference = await batch(
            _router({"a": FakeEngine("a")}, {"a": Role.COLOCATED}, Mode.COLOCATED)
        )
        slow, other = FakeEngine("slow", tick_s=0.002), FakeEngine("other")
        router = _router(
            {"slow": slow, "other": other},
            {"slow": Role.COLOCATED, "other": Role.COLOCATED},
            Mode.COLOCATED,
        )
        router.table.workers["other"].in_flight = 1000  # everything starts on "slow"
        running = asyncio.create_task(batch(router))
        await asyncio.sleep(0.02)
        router.remove("slow")
        router.table.workers["other"].in_flight = 0
        await slow.drain()
        resumed = await running
        assert [t.token_ids() for t in resumed] == [t.token_ids() for t in reference]
        assert any(turn.interruptions for t in resumed for turn in t.turns)
        for t in resumed:
            assert t.done and t.reward is not None
            assert len(t.loss_mask()) == len(t.token_ids())
            assert t.group_id.startswith("s0-g")

    asyncio.run(main())


def test_trajectory_stops_at_the_context_limit():
    config = RolloutConfig(max_tokens_per_turn=40, max_context_tokens=30, temperature=0)
    chat = ChatFormat(FakeTokenizer())

    async def main() -> None:
        router = _router({"a": FakeEngine("a")}, {"a": Role.COLOCATED}, Mode.COLOCATED)
        traj = await run_trajectory(
            router,
            CountingEnv(),
            chat,
            trajectory_id="t",
            group_id="g",
            env_seed=1,
            sample_seed=1,
            config=config,
        )
        assert len(traj.token_ids()) <= 30 + len(chat.observation("obs 1", True))
        assert traj.done

    asyncio.run(main())


def test_rollout_config_names_the_bad_field():
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        RolloutConfig(group_size=0)


# --------------------------------------------------------------------------- rpc


def test_rpc_calls_errors_and_refuses_a_wrong_key():
    async def main() -> None:
        key = new_key()

        async def echo(x: int) -> int:
            await asyncio.sleep(0.01 * (3 - x))
            return x * 2

        async def busy() -> None:
            raise Draining("w is not admitting work")

        server = await serve({"echo": echo, "busy": busy}, key)
        port = server.sockets[0].getsockname()[1]
        client = RpcClient("w")
        await client.connect("127.0.0.1", port, key)
        assert await asyncio.gather(*[client.call("echo", x=x) for x in range(3)]) == [0, 2, 4]
        with pytest.raises(Draining):
            await client.call("busy")
        with pytest.raises(EngineError, match="unknown rpc op"):
            await client.call("nope")
        await client.close()

        intruder = RpcClient("intruder")
        with pytest.raises(EngineError):
            await intruder.connect("127.0.0.1", port, new_key())
        server.close()

    asyncio.run(main())


def test_tracker_turns_credit_the_worker_that_finished_each_turn():
    from pearl_hpc.rollout.agent import tracker_turns
    from pearl_hpc.rollout.types import Trajectory, TurnStats

    traj = Trajectory("t", "g")
    traj.turns = [
        TurnStats(0, 10, 5, 15, 0.5, ("a",)),
        TurnStats(1, 4, 6, 25, 0.0, ("a", "b"), interruptions=1),
    ]
    records = tracker_turns([traj], {"a": 3, "b": 7}, {"a": Role.COLOCATED, "b": Role.DECODE})
    assert [(r.slot_id, r.role, r.generated_tokens) for r in records] == [
        (3, Role.COLOCATED, 5),
        (7, Role.DECODE, 6),
    ]
    assert records[0].env_s == 0.5 and records[1].context_tokens == 25
