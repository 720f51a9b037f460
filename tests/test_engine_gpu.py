"""GPU-only engine and weight-sync paths: CUDA vLLM sleep/wake for borrowing, NCCL weight
groups. They skip with the reason on machines without the hardware (CI, laptops)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from pathlib import Path

import pytest

from pearl_hpc.core.types import Role


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _cuda_vllm() -> bool:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:
        return False


pytestmark = pytest.mark.gpu


def _nccl_member(rank: int, port: int, queue: mp.Queue) -> None:
    import torch

    from pearl_hpc.engine.store import KeyStore, StoreClient
    from pearl_hpc.weights.group import WeightGroup, WeightStream, send_weights

    torch.cuda.set_device(rank)
    key = "ab" * 32  # the run's key (both ranks read the same file in a run)
    _server = KeyStore(key, port=port) if rank == 0 else None  # lives as long as the test
    group = WeightGroup(StoreClient("127.0.0.1", port, key), "nccl-test/", rank, 2, "nccl")
    state = {
        "model.layers.0.w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "model.layers.1.w": torch.arange(12, 24, dtype=torch.bfloat16).reshape(3, 4),
    }
    if rank == 0:  # one bucket per block: two broadcasts through one staging buffer
        send_weights(group, state, 3, bucket_bytes=16)
        queue.put((rank, 3, {n: t.float().tolist() for n, t in state.items()}))
        return
    stream = WeightStream(group, 0)
    got = {n: t.float().cpu().tolist() for n, t in stream}
    stream.finish()
    queue.put((rank, stream.version, got))


@pytest.mark.skipif(_cuda_count() < 2, reason="NCCL weight groups need 2 CUDA GPUs")
def test_nccl_weight_group_broadcasts_from_the_trainer():
    from pearl_hpc.engine.server import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_nccl_member, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [r[1] for r in results] == [3, 3]
    assert results[0][2] == results[1][2]


@pytest.mark.skipif(not _cuda_vllm(), reason="needs vLLM for CUDA (pip install vllm) and a GPU")
def test_cuda_engine_sleeps_and_wakes_for_borrowing(tiny_model_dir: str, tmp_path: Path):
    from pearl_hpc.engine.client import spawn_worker
    from pearl_hpc.engine.rpc import new_key
    from pearl_hpc.engine.spec import EngineSpec
    from pearl_hpc.engine.types import TurnRequest

    async def main() -> None:
        spec = EngineSpec(model_dir=tiny_model_dir, device="cuda", gpu_memory_utilization=0.3)
        worker = await spawn_worker(spec, "g0", run_dir=tmp_path, key=new_key())
        try:
            before = await worker.client.generate(TurnRequest("a", (5, 6, 7, 8), 8))
            release = await worker.client.release()
            stats = await worker.client.stats()
            assert stats.role is None and stats.gpu_total_bytes
            # the sleeping engine gave the device back (0.3 of it held before)
            freed = release.detail["gpu_free_after"] - release.detail["gpu_free_before"]
            assert freed > 0.2 * stats.gpu_total_bytes, release.detail
            activate = await worker.client.activate(Role.COLOCATED)
            after = await worker.client.generate(TurnRequest("b", (5, 6, 7, 8), 8))
            assert after.token_ids == before.token_ids
            print(f"sleep {release.wall_s:.2f} s, wake {activate.wall_s:.2f} s")
        finally:
            await worker.stop()

    asyncio.run(main())


@pytest.mark.skipif(_cuda_count() < 1, reason="the trainer's GPU hand-off needs a CUDA GPU")
def test_trainer_offload_frees_its_gpu_and_onload_restores_it() -> None:
    import torch

    from pearl_hpc.train.offload import Residency

    model = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MiB of fp32 weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    optimizer.step()  # + grads + two Adam moments: ~256 MiB
    weights = model.weight.detach().cpu().clone()
    res = Residency([model], optimizer, torch.device("cuda"))
    assert res.reserve() > 0  # pinned ahead, into torch's cache of pinned blocks
    off = res.offload()
    assert off is not None and off.free_after - off.free_before > 200 << 20
    assert model.weight.untyped_storage().nbytes() == 0  # freed in place, copied to the host
    on = res.onload()
    assert on is not None and model.weight.is_cuda
    assert torch.equal(model.weight.detach().cpu(), weights)


@pytest.mark.skipif(not _cuda_vllm(), reason="needs vLLM for CUDA (pip install vllm) and a GPU")
def test_the_gpu_smoke_checks_pass(tmp_path: Path) -> None:
    """tests/gpu/smoke.py whole: engine, PD over NIXL, sleep/wake, weights into a live
    engine on the trainer's GPU, the trainer's hand-off, nccl-tests (what this machine
    has; a check that cannot run here skips with its reason)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-m", "tests.gpu.smoke", "--out", str(tmp_path), "--eager"],
        cwd=repo, timeout=600,
    )  # fmt: skip
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert run.returncode == 0, report
    assert {c["name"]: c["status"] for c in report["checks"]}["engine"] == "pass"
