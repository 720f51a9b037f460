"""GPU smoke checks: one command on a machine with one (or more) CUDA GPUs, under ~9
minutes, through the product's own engine workers, weight sync and trainer.

    python -m tests.gpu.smoke [--model DIR] [--out DIR] [--deadline-s 480] [--eager]

Checks, in order (each timed; a later one is "not run" once the deadline passed). The
engine checks (1-4) need vLLM for CUDA and skip with the reason without it; the trainer
checks (5-9) need torch with CUDA only:

1. ``engine``: a cuda engine worker starts (start time) and answers a greedy turn.
2. ``pd``: a second worker as decode, the first as prefill (NIXL, KV buffer on the GPU,
   both on one GPU): the disaggregated turn's tokens equal the colocated ones; the role
   change times (colocated -> prefill restarts the engine with NIXL kv_both; prefill ->
   colocated is in place, no restart).
3. ``sleep``: release (sleep level 1) frees the engine's memory (the device's free bytes
   before and after) and wake gives the same greedy tokens.
4. ``weights``: a trainer on this process's GPU publishes changed weights to the
   engine on the same GPU, which maps them from shared memory (no communicator: NCCL
   refuses two ranks on one GPU); the engine's tokens change, survive a sleep/wake, and a
   point-to-point catch-up over gloo (host-staged, several buckets) gives a second engine
   the same tokens. (HF's greedy tokens on the same weights are reported,
   not required: GPU kernels differ between HF and vLLM.)
5. ``train``: GRPO steps on the GPU: the loss is finite, every step moves the weights
   (step time and peak GPU memory reported).
6. ``stage``: trainer 0's path to the engines on its node: the bf16 host copy of the
   weights, staged into a shared-memory version file, mapped back as an engine maps it,
   equals the trainer's weights (times of each part reported).
7. ``offload``: the trainer's hand-off frees its GPU memory and brings back the same
   weights; a forward pass after it matches the one before (the share of the GPU an
   overlap engine would start with then is reported).
8. ``fsdp``: the trainer sharded with FSDP2 on one rank (NCCL, bf16 compute) gathers
   exactly the unsharded trainer's weights, and its logits agree to bf16 precision; lent
   (its shards to host memory: free memory rises) and reloaded, its logits are unchanged.
9. ``nccl-tests``: ``all_reduce_perf`` (``$NCCL_TESTS_BIN``, else built by
   ``slurm/nccl-tests.sh build`` from ``$NCCL_TESTS_SRC`` without MPI, else PATH) over
   every GPU in one process, parsed by ``pearl-hpc calibrate``'s parser: bandwidth with
   2+ GPUs; with one, the parser must refuse the 1-rank run (what a wrong ``srun --mpi``
   gives) and the output's figures are reported.

Without a GPU it says why and exits 0; a failed check exits 1. ``--out DIR`` writes
``smoke.json`` (every check's status, seconds and figures) there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pearl_hpc.core.types import Role
from pearl_hpc.engine.types import TurnRequest

PROMPT = (5, 6, 7, 8, 9, 10, 11, 12)  # token ids of the tiny model's 1K vocabulary
TOKENS = 24


@dataclass
class Check:
    name: str
    status: str = "not run"  # pass | fail | skip | not run
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__}, cuda {torch.version.cuda})"
    return None


def no_vllm_reason() -> str | None:
    """Why the engine checks cannot run here (None: they can)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM for CUDA is not installed (pip install -e '.[gpu]')"
    from pearl_hpc.engine.spec import check_vllm

    try:
        check_vllm()
    except Exception as exc:
        return str(exc)
    return None


class Smoke:
    def __init__(self, model_dir: str, work: Path, eager: bool) -> None:
        from pearl_hpc.engine.rpc import new_key
        from pearl_hpc.engine.spec import EngineSpec

        extra = {"enforce_eager": True} if eager else {}
        self.spec = EngineSpec(
            model_dir=model_dir,
            device="cuda",
            gpu_memory_utilization=0.25,
            kv_buffer_device="cuda",
            max_model_len=1024,
            vllm_args=extra,
        )
        self.model_dir, self.work, self.key = model_dir, work, new_key()
        self.workers: dict[str, Any] = {}
        self.greedy: tuple[int, ...] = ()
        self.trainer: Any = None
        self.long_hidden, self.long_layers = 2048, 28  # 1.6B + 0.6B of embeddings

    async def spawn(self, name: str, role: Role | None) -> Any:
        from pearl_hpc.engine.client import spawn_worker

        worker = await spawn_worker(
            self.spec, name, run_dir=self.work, key=self.key, role=role, slot_id=len(self.workers)
        )
        self.workers[name] = worker
        return worker.client

    async def turn(self, client: Any, rid: str, **kw: Any) -> Any:
        return await client.generate(TurnRequest(rid, PROMPT, TOKENS, **kw))

    # ------------------------------------------------------------------ checks

    async def engine(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        g0 = await self.spawn("g0", Role.COLOCATED)
        start_s = time.perf_counter() - t0
        result = await self.turn(g0, "a")
        assert result.token_ids, "the engine generated nothing"
        self.greedy = result.token_ids
        stats = await g0.stats()
        return {"start_s": round(start_s, 1), "tokens": len(result.token_ids),
                "gpu_free_gib": _gib(stats.gpu_free_bytes)}  # fmt: skip

    async def pd(self) -> dict[str, Any]:
        from pearl_hpc.engine.nixl import nixl_problem

        if nixl_problem():  # (the backend of torch's CUDA major: nixl-cu12 or nixl-cu13)
            raise Skip(nixl_problem())
        g0 = self.workers["g0"].client
        to_prefill = await g0.set_role(Role.PREFILL)
        g1 = await self.spawn("g1", Role.DECODE)
        pre = await self.turn(g0, "p", prefill_only=True)
        assert pre.kv_transfer_params, f"prefill returned no kv_transfer_params: {pre}"
        dec = await self.turn(g1, "p-d", kv_transfer_params=pre.kv_transfer_params)
        stats = await g1.stats()
        back = await g0.set_role(Role.COLOCATED)
        await self.workers.pop("g1").stop()
        assert dec.token_ids == self.greedy, f"PD {dec.token_ids} != colocated {self.greedy}"
        assert stats.kv_bytes_received > 0, "the decode worker received no KV bytes"
        assert back.detail.get("in_place"), f"prefill -> colocated restarted: {back}"
        return {"to_prefill_s": round(to_prefill.wall_s, 1), "back_s": round(back.wall_s, 3),
                "kv_bytes": stats.kv_bytes_received}  # fmt: skip

    async def sleep(self) -> dict[str, Any]:
        g0 = self.workers["g0"].client
        release = await g0.release()
        stats = await g0.stats()
        freed = release.detail["gpu_free_after"] - release.detail["gpu_free_before"]
        wake = await g0.activate(Role.COLOCATED)
        after = await self.turn(g0, "s")
        assert freed > 0.15 * stats.gpu_total_bytes, f"sleep freed {_gib(freed)} GiB only"
        assert after.token_ids == self.greedy, "tokens after wake differ"
        return {"sleep_s": round(release.wall_s, 2), "wake_s": round(wake.wall_s, 2),
                "freed_gib": _gib(freed)}  # fmt: skip

    async def weights(self) -> dict[str, Any]:
        import torch

        from pearl_hpc.train.sync import WeightSync
        from pearl_hpc.weights.shm import SharedStore

        g0 = self.workers["g0"].client
        self.trainer = self._trainer()
        with torch.no_grad():  # a stand-in for a step: every weight moves
            for p in self.trainer.model.parameters():
                p.mul_(1.5)
        sync = WeightSync(shared=SharedStore.create("smoke"))  # mapped from /dev/shm
        try:
            await sync.form({"g0": g0})
            staged = sync.stage(self.trainer.state_dict(), 1)  # as the engine holds them
            publish_s = await sync.publish(staged)
            mapped = sorted(sync.nearby)
            changed = await self.turn(g0, "w")
            await g0.release()
            await g0.activate(Role.COLOCATED)
            survived = await self.turn(g0, "w2")
            g1 = await self.spawn("late", Role.COLOCATED)
            network = WeightSync(bucket_bytes=1 << 20)  # gloo: host-staged, several buckets
            network.seed(staged)
            catch_up_s = await network.catch_up("late", g1)
            late = await self.turn(g1, "w3")
            await self.workers.pop("late").stop()
        finally:
            sync.close()
        hf = _hf_greedy(self.trainer.model, len(changed.token_ids))
        assert mapped == ["g0"], f"the engine on the trainer's GPU did not map it: {mapped}"
        assert changed.weight_version == 1 and changed.token_ids != self.greedy
        assert survived.token_ids == changed.token_ids, "weights did not survive sleep"
        assert late.token_ids == changed.token_ids, "the caught-up engine differs"
        return {"publish_shm_s": round(publish_s, 3), "catch_up_gloo_s": round(catch_up_s, 3),
                "hf_greedy_equal": hf == changed.token_ids}  # fmt: skip

    def _trainer(self) -> Any:
        """The unsharded cuda trainer the weights, train, stage and offload checks share."""
        from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer

        if self.trainer is None:
            self.trainer = GRPOTrainer(self.model_dir, GRPOConfig(device="cuda", seed=0))
        return self.trainer

    async def train(self) -> dict[str, Any]:
        import math

        import torch

        from pearl_hpc.rollout.types import Segment, Trajectory

        t = self._trainer()
        steps, times, losses = 3, [], []
        torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            before = [p.detach().clone() for p in t.model.parameters()]
            batch = [
                Trajectory(
                    f"s{step}-{i}", f"g{i // 2}",
                    [Segment(PROMPT, generated=False),
                     Segment(tuple(range(20 + i, 36 + i)), generated=True)],
                    reward=float(i % 2), done=True, weight_versions={t.version},
                )
                for i in range(4)
            ]  # fmt: skip
            stats = t.train_step(batch)
            times.append(stats.wall_s)
            losses.append(stats.loss)
            moved = sum(
                not torch.equal(a, p) for a, p in zip(before, t.model.parameters(), strict=True)
            )
            assert math.isfinite(stats.loss), f"step {step}: loss {stats.loss}"
            assert moved > 0, f"step {step} moved no weight"
        assert t.version == steps, f"version {t.version} after {steps} steps"
        return {"steps": steps, "step_s": [round(x, 3) for x in times],
                "loss": [round(x, 5) for x in losses],
                "peak_gpu_mib": torch.cuda.max_memory_allocated() >> 20}  # fmt: skip

    async def stage(self) -> dict[str, Any]:
        import torch

        from pearl_hpc.train.sync import WeightSync
        from pearl_hpc.weights.shm import SharedStore, map_version

        t = self._trainer()
        shared = SharedStore.create("smoke-stage")
        if shared is None:
            raise Skip("no /dev/shm here")
        sync, bf16, v = WeightSync(shared=shared), torch.bfloat16, t.version
        live = {n: p.detach() for n, p in t.model.state_dict().items()}
        figures: dict[str, Any] = {}
        try:
            # trainer 0's copy: the first pins its host memory, the next (once the first
            # is dropped, as each step drops the last) reuses it
            full = _clocked(figures, "host_copy_s", lambda: t.state_dict(bf16))
            staged = _clocked(figures, "stage_s", lambda f=full: sync.stage(f, v, bf16))
            del full
            _clocked(figures, "host_copy_again_s", lambda: t.state_dict(bf16))
            assert staged.path is not None and staged.header is not None, "not in shared memory"
            version, views = _clocked(
                figures, "map_s", lambda: map_version(staged.path, staged.header)
            )
            model = {n: x.to(bf16).cpu() for n, x in live.items()}
            differ = [n for n, x in views if not torch.equal(x, model[n])]
            num_bytes = sum(x.numel() * x.element_size() for _, x in views)
        finally:
            sync.close()
        assert version == v, f"mapped v{version}, the trainer is at v{v}"
        assert len(views) == len(model), f"{len(views)} tensors mapped of {len(model)}"
        assert not differ, f"mapped tensors differ from the trainer's: {differ[:4]}"
        return {"tensors": len(views), "mib": num_bytes >> 20, **figures}

    async def offload(self) -> dict[str, Any]:
        import torch

        from pearl_hpc.engine.vllm_engine import fitted_utilization
        from pearl_hpc.train.offload import Residency

        t = self._trainer()
        ids = torch.tensor([PROMPT], device=t.device)
        with torch.no_grad():
            before = t.model(ids).logits.float().cpu()
        res = Residency([t.model], t.optimizer, t.device)
        reserve_s = res.reserve()  # pinned ahead: the first lend as fast as the next
        moves = [(res.offload(), res.onload()) for _ in range(2)]
        with torch.no_grad():
            after = t.model(ids).logits.float().cpu()
        off = moves[0][0]
        assert all(a is not None and b is not None for a, b in moves)
        assert off is not None and off.free_after > off.free_before, "offload freed nothing"
        assert torch.equal(before, after), "the weights changed across the hand-off"
        total = torch.cuda.mem_get_info()[1]
        share = fitted_utilization(0.85, off.free_after, total, 1 << 30)  # an overlap engine's
        return {"reserve_s": round(reserve_s, 3),
                "offload_s": [round(a.wall_s, 3) for a, _ in moves if a is not None],
                "onload_s": [round(b.wall_s, 3) for _, b in moves if b is not None],
                "freed_mib": (off.free_after - off.free_before) >> 20,
                "overlap_engine_share": share}  # fmt: skip

    async def fsdp(self) -> dict[str, Any]:
        import copy

        import torch
        import torch.distributed as dist

        from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
        from pearl_hpc.train.offload import Residency

        plain = GRPOTrainer(self.model_dir, GRPOConfig(device="cuda", seed=0))
        bf16 = copy.deepcopy(plain.model)  # FSDP2's mixed precision: bf16 parameters only
        for param in bf16.parameters():
            param.data = param.data.to(torch.bfloat16)
        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            sharded = GRPOTrainer(self.model_dir, GRPOConfig(device="cuda", seed=0, fsdp=True))
            assert sharded.sharded, "the trainer did not shard"
            full, reference = sharded.state_dict(), plain.state_dict()
            ids = torch.tensor([PROMPT], device="cuda")
            with torch.no_grad():
                a = plain.model(ids).logits.float()
                r = bf16(ids).logits.float()
                b = sharded.model(ids).logits.float()
            del plain, bf16  # alone on the GPU, as on a trainer rank: its freed blocks return
            shards = sum(_local_bytes(p) for p in sharded.model.parameters())
            lent = Residency([sharded.model], sharded.optimizer, sharded.device)
            held = torch.cuda.memory_allocated()
            off = lent.offload()  # the shards leave the GPU ...
            left = held - torch.cuda.memory_allocated()
            on = lent.onload()  # ... and return
            with torch.no_grad():
                c = sharded.model(ids).logits.float()
        finally:
            dist.destroy_process_group()
        assert full.keys() == reference.keys(), "the gathered names differ"
        assert all(torch.equal(full[k], reference[k]) for k in full), "gathered weights differ"
        scale = float(a.abs().max())
        gap_fp32, gap_bf16 = float((a - b).abs().max()), float((r - b).abs().max())
        figures = {"tensors": len(full), "max_abs_logit": round(scale, 3),
                   "gap_to_fp32": round(gap_fp32, 4), "gap_to_bf16_params": round(gap_bf16, 4),
                   "equal_after_lending": bool(torch.equal(b, c))}  # fmt: skip
        print(f"      fsdp  figures {figures}", flush=True)
        assert gap_bf16 <= 2e-2 * scale, f"FSDP2 logits off the bf16 model's: {figures}"
        assert off is not None and on is not None
        figures |= {"shards_mib": shards >> 20, "lent_left_gpu_mib": left >> 20,
                    "lent_freed_mib": (off.free_after - off.free_before) >> 20}  # fmt: skip
        if left < shards:
            figures["fsdp_tensors"] = _fsdp_tensors(sharded.model)
        assert left >= shards, f"lending the FSDP2 trainer left shards on the GPU: {figures}"
        assert torch.equal(b, c), "the shards changed across the hand-off"
        return figures

    async def long(self) -> dict[str, Any]:
        """One GRPO step on two 32K-token trajectories of a random Qwen3 of PEARL's
        vocabulary, FSDP2 on this one GPU (bf16 compute), activation checkpointing and
        chunked log-probs: the peak GPU memory next to the memory plan's figure."""
        import torch
        import torch.distributed as dist

        from pearl_hpc.bench.train import build_model

        model = build_model(self.work / "long", self.long_hidden, self.long_layers, 151_936,
                            LONG_TOKENS, head_dim=128)  # fmt: skip
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            torch.cuda.reset_peak_memory_stats()
            return long_step(model, "cuda", LONG_TOKENS)
        finally:
            dist.destroy_process_group()

    async def nccl_tests(self) -> dict[str, Any]:
        import torch

        from pearl_hpc.calibrate.nccl import parse_nccl_tests
        from pearl_hpc.errors import CalibrationError

        gpus = torch.cuda.device_count()
        binary, env = self._nccl_tests_binary()
        run = subprocess.run(
            [binary, "-b", "8M", "-e", "512M", "-f", "4", "-g", str(gpus)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert run.returncode == 0, f"{binary} exited {run.returncode}: {run.stderr[-1500:]}"
        if gpus >= 2:
            result = parse_nccl_tests(run.stdout, expected_ranks=gpus)
            return {"ranks": result.num_ranks, "avg_busbw_gb_per_s": result.avg_busbw_gb_per_s}
        try:  # one GPU: a 1-rank run, which calibration must not take as bandwidth
            parse_nccl_tests(run.stdout)
        except CalibrationError as exc:
            rows = [line.split() for line in run.stdout.splitlines() if line[:1] == " "]
            largest = [r for r in rows if r and r[0].isdigit()][-1:]
            return {"one_rank_refused": str(exc)[:300], "largest_row": " ".join(largest[0])
                    if largest else None}  # fmt: skip
        raise AssertionError("the parser took a 1-rank run as bandwidth")

    def _nccl_tests_binary(self) -> tuple[str, dict[str, str]]:
        """$NCCL_TESTS_BIN, else all_reduce_perf built from $NCCL_TESTS_SRC by the
        product's script (no MPI: one process drives every GPU), else the PATH's; with
        the environment to run it in (the build's NCCL on the library path)."""
        env = dict(os.environ)
        if env.get("NCCL_TESTS_BIN"):
            return env["NCCL_TESTS_BIN"], env
        if not env.get("NCCL_TESTS_SRC"):
            found = shutil.which("all_reduce_perf")
            if not found:
                raise Skip("all_reduce_perf not found: set NCCL_TESTS_BIN, or NCCL_TESTS_SRC "
                           "to an nccl-tests source to build")  # fmt: skip
            return found, env
        import torch

        build = self.work / "nccl-tests"
        env |= {"PEARL_NCCL_TESTS_DIR": str(build), "PEARL_NCCL_TESTS_MPI": "0",
                "PEARL_NCCL_TESTS": "all_reduce_perf"}  # fmt: skip
        env.setdefault("NCCL_HOME", str(_pip_nccl_home(self.work / "nccl-home")))
        major, minor = torch.cuda.get_device_capability()
        env.setdefault(
            "NVCC_GENCODE", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
        )
        script = Path(__file__).resolve().parents[2] / "slurm" / "nccl-tests.sh"
        done = subprocess.run(["bash", str(script), "build"], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, f"nccl-tests build failed: {done.stderr[-1500:]}"
        libs = [env["NCCL_HOME"] + "/lib", env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = ":".join(x for x in libs if x)
        return str(build / "bin" / "all_reduce_perf"), env

    async def close(self) -> None:
        for worker in self.workers.values():
            try:
                await worker.stop()
            except Exception:
                worker.kill()


def _pip_nccl_home(home: Path) -> Path:
    """An NCCL_HOME for the build from the NCCL that torch's wheel brings (the pip
    package ``nvidia-nccl-cu*``: ``nccl.h`` and ``libnccl.so.2``, without the
    ``libnccl.so`` link the build needs), found wherever that package keeps them."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    headers = [h for root in roots for h in root.glob("**/include/nccl.h")]
    libs = [lib for root in roots for lib in root.glob("**/libnccl.so.2")]
    if not headers or not libs:
        raise Skip(f"no pip NCCL (nvidia-nccl-cu*) under {roots}: set NCCL_HOME")
    (home / "lib").mkdir(parents=True, exist_ok=True)
    (home / "include").unlink(missing_ok=True)
    (home / "include").symlink_to(headers[0].parent)
    for name in ("libnccl.so.2", "libnccl.so"):
        (home / "lib" / name).unlink(missing_ok=True)
        (home / "lib" / name).symlink_to(libs[0])
    return home


def _clocked(figures: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its wall time in ``figures[name]`` (the GPU's work finished)."""
    import torch

    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    figures[name] = round(time.perf_counter() - t0, 4)
    return out


LONG_TOKENS = 32_768  # PEARL's trajectories


def long_step(model_dir: str | Path, device: str, tokens: int) -> dict[str, Any]:
    """One step of two ``tokens``-token trajectories, FSDP2 over the process group (one
    rank), checkpointed and chunked, beside the memory plan of the same shapes (cuda:
    the peak allocated; the plan counts bf16 activations, as FSDP2's mixed precision
    computes on cuda)."""
    import json
    import random

    import torch

    from pearl_hpc.config.memory import ModelShape, trainer_memory
    from pearl_hpc.rollout.types import Segment, Trajectory
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer

    chunk = 1024
    config = GRPOConfig(device=device, fsdp=True, micro_batch_tokens=tokens, minibatch_size=2,
                        activation_checkpointing=True, logprob_chunk=chunk, lr=1e-5)  # fmt: skip
    trainer = GRPOTrainer(model_dir, config)
    rng = random.Random(0)
    batch = []
    for i in range(2):
        ids = [rng.randrange(1, trainer.vocab_size) for _ in range(tokens)]
        prompt, generated = tuple(ids[: tokens // 4]), tuple(ids[tokens // 4 :])
        segments = [Segment(prompt, False), Segment(generated, True)]
        batch.append(Trajectory(f"l{i}", "g", segments, float(i), True, {0}))
    stats = trainer.train_step(batch)
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = ModelShape.from_config("long", hf_config)
    plan = trainer_memory(shape, ranks=1, fsdp=True, tokens=tokens, checkpointing=True,
                          chunk=chunk, kl=False)  # fmt: skip
    out = {"params_b": round(shape.params / 1e9, 2), "tokens": tokens,
           "step_s": round(stats.wall_s, 2), "plan_gib": _gib(int(plan.total))}  # fmt: skip
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        out |= {"peak_gib": _gib(peak), "peak_vs_plan": round(peak / plan.total, 3)}
    return out


def _fsdp_tensors(model: Any) -> dict[str, int]:
    """Where FSDP2's own references to each parameter live (device, storage kept), for
    a lend that left memory behind."""
    import collections

    import torch

    counts: collections.Counter[str] = collections.Counter()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            for attr in ("_sharded_param_data", "sharded_param", "_unsharded_param"):
                tensor = getattr(fsdp_param, attr, None)
                if isinstance(tensor, torch.Tensor):
                    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                    kept = local.untyped_storage().size() > 0
                    counts[f"{attr}:{local.device.type}:{'kept' if kept else 'freed'}"] += 1
    return dict(counts)


def _local_bytes(param: Any) -> int:
    """The bytes of a parameter on this rank (a DTensor's local shard)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return int(local.numel() * local.element_size())


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def _hf_greedy(model: Any, n: int) -> tuple[int, ...]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=next(model.parameters()).device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)  # fmt: skip
    return tuple(int(t) for t in out[0, len(PROMPT) :])


async def run_checks(smoke: Smoke, deadline_s: float, only: set[str] | None = None) -> list[Check]:
    # (name, check, what it needs: "vllm" = vLLM for CUDA, "engine" = the engine check)
    steps: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]], str]] = [
        ("engine", smoke.engine, "vllm"),
        ("pd", smoke.pd, "engine"),
        ("sleep", smoke.sleep, "engine"),
        ("weights", smoke.weights, "engine"),
        ("train", smoke.train, ""),
        ("stage", smoke.stage, ""),
        ("offload", smoke.offload, ""),
        ("fsdp", smoke.fsdp, ""),
        ("long", smoke.long, ""),
        ("nccl-tests", smoke.nccl_tests, ""),
    ]
    no_vllm = no_vllm_reason()
    checks, t_start = [], time.perf_counter()
    for name, fn, needs in steps:
        if only is not None and name not in only:
            continue
        check = Check(name)
        checks.append(check)
        left = deadline_s - (time.perf_counter() - t_start)
        if needs and no_vllm:
            check.status, check.detail = "skip", {"why": no_vllm}
        elif needs == "engine" and not any(
            c.name == "engine" and c.status == "pass" for c in checks
        ):
            check.detail["why"] = "the engine check did not pass"
        elif left <= 0:
            check.detail["why"] = "deadline passed"
        else:
            await _timed(check, fn, left)
        print(f"{check.name:>10}  {check.status:<5}  {check.seconds:6.1f} s  {check.detail}",
              flush=True)  # fmt: skip
    return checks


async def _timed(check: Check, fn: Callable[[], Awaitable[dict[str, Any]]], left: float) -> None:
    t0 = time.perf_counter()
    try:
        check.detail = await asyncio.wait_for(fn(), timeout=left)
        check.status = "pass"
    except Skip as why:
        check.status, check.detail = "skip", {"why": str(why)}
    except Exception as exc:
        check.status = "fail"
        check.detail = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        traceback.print_exc()
    check.seconds = round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build the tiny model)")
    parser.add_argument("--out", help="write smoke.json (or --name's file) here")
    parser.add_argument("--name", default="smoke", help="the report's file name (no .json)")
    parser.add_argument("--deadline-s", type=float, default=480.0)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs/compile (faster)")
    parser.add_argument("--checks", help="comma-separated checks to run (default: all)")
    parser.add_argument(
        "--hidden", type=int, help="build a random model of this width (head_dim 128) instead "
        "of the tiny one, for the trainer's figures at a realistic size"
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=16, help="its layers (with --hidden)")
    args = parser.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu smoke: skipped: {reason}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="pearl-gpu-smoke-"))
    model_dir = args.model or str(_build_model(work, args.hidden, args.layers))
    smoke = Smoke(model_dir, work, args.eager)
    only = set(args.checks.split(",")) if args.checks else None

    async def body() -> list[Check]:
        try:
            return await run_checks(smoke, args.deadline_s, only)
        finally:
            await smoke.close()

    checks = asyncio.run(body())
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = {"model": model_dir, "checks": [asdict(c) for c in checks]}
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    return 1 if any(c.status == "fail" for c in checks) else 0


def _build_model(work: Path, hidden: int | None, layers: int) -> Path:
    from pearl_hpc.engine.tinymodel import TinyModelSpec, build_tiny_model

    if hidden is None:
        return build_tiny_model(work / "tiny-qwen3")
    spec = TinyModelSpec(
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 256),
        head_dim=128, initializer_range=0.02,
    )  # fmt: skip
    t0 = time.perf_counter()
    model = build_tiny_model(work / f"qwen3-{hidden}x{layers}", spec)
    print(f"gpu smoke: built a {hidden}x{layers} model in {time.perf_counter() - t0:.1f} s")
    return model


if __name__ == "__main__":
    sys.exit(main())
