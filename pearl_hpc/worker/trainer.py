"""A trainer rank of the run's MPI world: data-parallel GRPO, and (trainer rank 0) the
weight broadcast to the engines.

    master ──TRAIN(step, batch, checkpoint)──> every trainer rank: GRPO step on its rows
                                    of each minibatch, gradients summed over the gloo/NCCL
                                    group; trainer 0 stages the engines' copy (FSDP: a
                                    gather in their dtype); with ``checkpoint`` every rank
                                    stages its shards, acks, and writes them meanwhile
    master ──SAVE──> every trainer rank: a checkpoint now, complete before the ack
    master ──PUBLISH(version, members)──> trainer 0: re-form the broadcast group if its
                                    members changed, broadcast the weights (WeightSync)
    master ──CATCH_UP(name, host, port)──> trainer 0: latest weights to one engine p2p
    (commands are answered while a step trains: the control loop is this thread,
    training and weight sync run in others)

Trainer rank 0 owns the rendezvous store of the training group and of the weight groups.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from pearl_hpc.comm.layout import RankSpec
from pearl_hpc.comm.messages import (
    Ack,
    CatchUp,
    CatchUpAck,
    Command,
    Failed,
    Hello,
    Leave,
    Publish,
    PublishAck,
    Release,
    ReleaseAck,
    ReportBody,
    Save,
    SaveAck,
    Shutdown,
    Train,
    TrainAck,
)
from pearl_hpc.comm.mpi import WorkerPlane
from pearl_hpc.config.run import RunConfig
from pearl_hpc.engine.spec import engine_spec
from pearl_hpc.rollout.types import Trajectory
from pearl_hpc.rundir import RunDir

log = logging.getLogger(__name__)


class TrainerRank:
    """Serves the master's training and weight commands on one trainer rank."""

    def __init__(
        self,
        comm: Any,  # the trainer ranks' communicator (their launch's world)
        cfg: RunConfig,
        me: RankSpec,
        run_dir: Path,
        model_dir: str,
        key: str,
        host: str,
        resume: bool,
        device: str = "cpu",  # cpu | cuda (this rank's one GPU, cuda:0 once placed)
    ) -> None:
        from pearl_hpc.engine.store import StoreClient
        from pearl_hpc.train.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
        from pearl_hpc.train.grpo import GRPOTrainer
        from pearl_hpc.train.offload import Residency
        from pearl_hpc.train.sync import WeightSync
        from pearl_hpc.weights.group import WeightGroup
        from pearl_hpc.weights.shm import SharedStore, Staged

        self.me, self.key = me, key
        self.model_dir = Path(model_dir)
        self.index, size = comm.Get_rank(), comm.Get_size()
        self.run = RunDir(run_dir)
        # trainer 0: the store of the training group and of the engines' weight groups
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)  # the one GPU the placement left visible
        self.sync = None
        if self.index == 0:  # engines on this node map each version from shared memory
            shared = (
                SharedStore.create(_file_name(run_dir.name)) if cfg.train.shared_memory else None
            )
            t = cfg.train
            self.sync = WeightSync(key, host, t.weight_sync, cfg.run.max_staleness, shared=shared)
        addr = comm.bcast(
            (self.sync.store.host, self.sync.store.port) if self.sync is not None else None, 0
        )
        group = None
        backend = "nccl" if device == "cuda" else "gloo"  # one GPU per trainer rank
        # the trainer ranks' groups meet in trainer 0's store too (NCCL again for each
        # new communicator: the client lives as long as the rank)
        self.store = StoreClient(addr[0], addr[1], key) if size > 1 else None
        if self.store is not None and cfg.train.fsdp:  # FSDP2 shards over the default group
            _join_fsdp_world(self.store, self.index, size, backend)
        elif self.store is not None:  # replicated weights, gradients summed over a group
            group = WeightGroup(self.store, "dp/", self.index, size, backend)
        grpo = grpo_config(cfg, device)
        # a resumed run continues from its newest checkpoint (the launcher dropped newer
        # and incomplete ones; the master trains the steps after it again from their
        # logs); a new run starts from the model's weights
        self.trainer = GRPOTrainer(model_dir, grpo, dp_group=group)
        checkpoint = latest_checkpoint(self.run.checkpoints) if resume else None
        if checkpoint is not None:
            load_checkpoint(self.trainer, checkpoint)
        self.checkpoints = Checkpointer(
            self.run.checkpoints, cfg.train.keep_checkpoints,
            sharded=self.trainer.sharded, lead=self.index == 0,
            saved=self.trainer.version if checkpoint is not None else None,
        )  # fmt: skip
        # an overlap engine time-shares this rank's GPU: the trainer's tensors leave it
        # when the master lends the GPU (Op.RELEASE) and come back for the next step (a
        # no-op on cpu)
        self.residency = Residency(
            [m for m in (self.trainer.policy, self.trainer.ref_policy) if m is not None],
            self.trainer.optimizer,
            self.trainer.device,
        )
        self.wire_dtype = _wire_dtype(cfg, model_dir, device)
        self.latest: Staged | None = None  # trainer 0: the weights the engines get next
        if checkpoint is not None:
            self._copy_weights()
            if self.sync is not None and self.latest is not None:
                self.sync.seed(self.latest)  # engines catch up
        self.clients: dict[str, Any] = {}  # engine name -> EngineClient (trainer 0)
        self.pending: list[tuple[Command, concurrent.futures.Future[ReportBody]]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")
        if cfg.workers.overlap and self.residency.moves:  # while the first rollout runs
            self.pool.submit(self._reserve)
        self.loop = asyncio.new_event_loop()  # engine clients and the weight sync
        threading.Thread(target=self.loop.run_forever, name="weights", daemon=True).start()

    def serve(self, plane: WorkerPlane, hello: Hello) -> int:
        """Serve the master over ``plane`` (joined once the model is loaded: a member
        heartbeats from its hello on) until its LEAVE or SHUTDOWN; 0."""
        self.plane = plane
        plane.report(msgspec.structs.replace(hello, version=self.trainer.version, index=self.index))
        while True:
            cmd = plane.next_command(0.02)
            self._report_finished()
            if cmd is None:
                continue
            body = cmd.body
            if isinstance(body, Train):
                self.pending.append((cmd, self.pool.submit(self._train, body)))
            elif isinstance(body, Save):  # after any step in flight
                self.pending.append((cmd, self.pool.submit(self._save)))
            elif isinstance(body, Release):  # after any step in flight: one thread trains
                self.pending.append((cmd, self.pool.submit(self._lend)))
            elif isinstance(body, Publish) and self.sync is not None:
                self.pending.append((cmd, self._on_loop(self._publish(body))))
            elif isinstance(body, CatchUp) and self.sync is not None:
                self.pending.append((cmd, self._on_loop(self._catch_up(body))))
            elif isinstance(body, Shutdown | Leave):
                self.pool.shutdown(wait=True)
                self.checkpoints.close()  # the save in flight is finished first
                plane.report(Ack(cmd.op), cmd.seq)
                if isinstance(body, Leave):
                    plane.disconnect()
                asyncio.run_coroutine_threadsafe(self._close_clients(), self.loop).result(10)
                self.loop.call_soon_threadsafe(self.loop.stop)
                if self.sync is not None:
                    self.sync.close()  # its files in shared memory too
                return 0
            else:
                plane.report(Failed(f"trainer: unexpected {cmd.op}"), cmd.seq)

    # ------------------------------------------------------------------ commands
    def _train(self, cmd: Train) -> TrainAck:
        trajectories = msgspec.msgpack.decode(cmd.trajectories, type=list[Trajectory])
        onload = self.residency.onload()
        stats = self.trainer.train_step(trajectories)
        checkpoint_s = self.checkpoints.save(self.trainer) if cmd.checkpoint else 0.0
        full = self._copy_weights()
        if cmd.export and full:  # trainer 0: the engines' copy, as a Hugging Face directory
            from pearl_hpc.rundir import version_dir
            from pearl_hpc.train.export import write_hf

            out = version_dir(self.run.exports, self.trainer.version)
            if not out.exists():  # (a replayed step's is there already)
                write_hf(self.model_dir, full, out)
        return TrainAck(
            step=cmd.step,
            version=stats.version,
            mean_reward=stats.mean_reward,
            max_staleness=stats.max_staleness,
            loss=stats.loss,
            num_tokens=stats.num_tokens,
            wall_s=stats.wall_s,
            clip_frac=stats.clip_frac,
            mismatch_mean=stats.mismatch_mean,
            mismatch_max=stats.mismatch_max,
            capped_frac=stats.capped_frac,
            behaviour_coverage=stats.behaviour_coverage,
            grad_norm=stats.grad_norm,
            entropy=stats.entropy,
            lr=stats.lr,
            onload=onload,
            checkpoint_s=checkpoint_s,
            saved=self.checkpoints.take_saved(),
        )

    def _save(self) -> SaveAck:
        """A checkpoint of the current version, on disk before the ack."""
        t0 = time.perf_counter()
        self.checkpoints.save(self.trainer)
        self.checkpoints.wait()
        return SaveAck(self.trainer.version, time.perf_counter() - t0)

    def _copy_weights(self) -> dict[str, Any]:
        """Trainer 0's copy of the weights the engines get next, in their dtype (in
        shared memory, for the engines on this node), taken before the step's ack (the
        next step may change the model while they travel); under FSDP every rank takes
        part in the gather (in the engines' dtype), to trainer 0's host memory. Returns
        the copy (``{}`` on other ranks)."""
        if not (self.trainer.sharded or self.index == 0):
            return {}
        full = self.trainer.state_dict(self.wire_dtype)
        if self.sync is not None:
            self.latest = self.sync.stage(full, self.trainer.version, self.wire_dtype)
        return full

    def _reserve(self) -> None:
        """Pin the host memory of a lend ahead (the first lend is then as fast as the
        next); where pinning fails (a low locked-memory limit), the lend pins as it goes."""
        try:
            took = self.residency.reserve()
        except Exception:
            log.warning(
                "trainer %d: pinning a lend's host memory failed", self.index, exc_info=True
            )
            return
        log.info("trainer %d: a lend's host memory pinned in %.1f s", self.index, took)

    def _lend(self) -> ReleaseAck:
        """The master lends this rank's GPU to an overlap engine: the trainer's tensors
        move to host memory before the ack (the engine wakes after it)."""
        return ReleaseAck(self.residency.offload())

    async def _client(self, name: str, host: str, port: int) -> Any:
        from pearl_hpc.engine.client import EngineClient

        known = self.clients.get(name)
        if known is not None and known[0] == (host, port):
            return known[1]
        client = EngineClient(name)
        await client.connect(host, port, self.key)
        self.clients[name] = ((host, port), client)
        return client

    async def _publish(self, cmd: Publish) -> PublishAck:
        assert self.sync is not None
        from pearl_hpc.engine.types import EngineError
        from pearl_hpc.train.sync import MembersLost

        members, unreachable = {}, []
        for name, (host, port) in sorted(cmd.members.items()):
            try:
                members[name] = await self._client(name, host, port)
            except (EngineError, OSError) as exc:  # died since the master listed it
                log.warning("weights to %s: %s", name, exc)
                self.clients.pop(name, None)
                unreachable.append(name)
        while True:  # each time round, one member or more fewer
            try:
                out = await self._broadcast(members, cmd.version)
                return msgspec.structs.replace(out, unreachable=unreachable)
            except MembersLost as exc:  # died before or during it: again without them
                log.warning("%s", exc)
                for dead in exc.names:
                    self.clients.pop(dead, None)
                    members.pop(dead, None)
                    unreachable.append(dead)

    async def _broadcast(self, members: dict[str, Any], version: int) -> PublishAck:
        assert self.sync is not None
        latest = self.latest  # once: the training thread may stage the next meanwhile
        if latest is None or latest.version < version:  # a newer one goes instead
            have = None if latest is None else latest.version
            raise RuntimeError(f"publish v{version}: trainer 0 holds v{have}")
        if not members:  # none serving (a resumed step's batch all in its log, a replay):
            self.sync.seed(latest)  # each engine catches up to it as it starts serving
            return PublishAck(latest.version, 0.0, 0.0, 0, 0, [])
        form_s = 0.0
        if set(members) != set(self.sync.members):  # a new epoch of the broadcast group
            t0 = time.perf_counter()
            await self.sync.form(members)
            form_s = time.perf_counter() - t0
        seconds = await self.sync.publish(latest)
        return PublishAck(
            version=latest.version,
            seconds=seconds,
            form_s=form_s,
            members=len(members),
            mapped=self.sync.mapped,
            unreachable=[],
        )

    async def _catch_up(self, cmd: CatchUp) -> CatchUpAck:
        assert self.sync is not None
        client = await self._client(cmd.name, cmd.host, cmd.port)
        return CatchUpAck(await self.sync.catch_up(cmd.name, client))

    async def _close_clients(self) -> None:
        for _, client in self.clients.values():
            await client.close()

    def _on_loop(self, coro: Any) -> concurrent.futures.Future[ReportBody]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _report_finished(self) -> None:
        for item in [p for p in self.pending if p[1].done()]:
            self.pending.remove(item)
            cmd, future = item
            try:
                self.plane.report(future.result(), cmd.seq)
            except Exception as exc:
                log.exception("trainer %d: %s failed", self.index, cmd.op)
                self.plane.report(Failed(f"{type(exc).__name__}: {exc}"), cmd.seq)


def grpo_config(cfg: RunConfig, device: str = "cpu") -> Any:
    """The trainer's settings from the run config: ``train:``, and ``run.seed``, the
    rollout's temperature, token budget, staleness and steps (the schedule's horizon), on
    ``device`` (the rank's placement: cpu | cuda)."""
    from pearl_hpc.train.grpo import GRPOConfig

    t = cfg.train
    checkpointing = t.activation_checkpointing
    return GRPOConfig(
        lr=t.lr,
        lr_warmup_steps=t.lr_warmup_steps,
        lr_schedule=t.lr_schedule,
        lr_min=t.lr_min,
        total_steps=cfg.run.steps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        minibatch_size=t.minibatch_size,
        epochs=t.epochs,
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        micro_batch_tokens=t.micro_batch_tokens,
        logprob_chunk=t.logprob_chunk,
        activation_checkpointing=device == "cuda" if checkpointing is None else checkpointing,
        seed=cfg.run.seed,
        device=device,
        max_staleness=cfg.run.max_staleness,
        temperature=cfg.run.temperature,
        max_completion_tokens=cfg.run.max_turns * cfg.run.max_tokens_per_turn,
        correction=t.correction,
        is_cap=t.is_cap,
        sequence_mask=t.sequence_mask,
        loss_type=t.loss_type,
        kl_coef=t.kl_coef,
        kl_bias_correction=t.kl_bias_correction,
        advantage_std=t.advantage_std,
        fsdp=t.fsdp,
    )


def _join_fsdp_world(store: Any, index: int, size: int, backend: str) -> None:
    """torch.distributed's default group over the trainer ranks (FSDP2 shards over it):
    no engine lives in a trainer rank's process, so the default group is theirs. On NCCL
    its communicator is made now (bound to the rank's GPU), not at the first step's
    collective: its buffers are on the GPU before an overlap engine sizes itself to what
    is free there."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=120)
    dist.init_process_group(
        backend, store=dist.PrefixStore("fsdp/", store), rank=index, world_size=size,
        timeout=timeout, device_id=torch.device("cuda", 0) if backend == "nccl" else None,
    )  # fmt: skip


def _wire_dtype(cfg: RunConfig, model_dir: str, device: str) -> Any:
    """The dtype the engines hold the weights in, which the trainer sends them: engines
    whose device is ``auto`` resolve as this rank did (one torch build per cluster)."""
    import torch

    from pearl_hpc.engine.spec import weights_dtype

    engines = device if cfg.engine.device == "auto" else cfg.engine.device
    return getattr(torch, weights_dtype(engine_spec(cfg, model_dir, device=engines)))


def _file_name(name: str) -> str:
    """``name`` with only the characters a file name may safely carry."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"
