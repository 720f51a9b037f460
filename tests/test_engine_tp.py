"""A tensor-parallel engine (TP 2: vLLM's mp executor, two worker processes) takes each
weight version as a file its workers map (pearl_hpc/engine/weightfile.py), never as
tensors pickled through collective_rpc: the trainer's shared file, a gloo broadcast
received straight into an in-memory file, or a copy of bytes; a restart re-applies the
version from the file it holds open after the trainer removed its name. Real vLLM on
CPU (its TP runs here too)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pearl_hpc.core.types import Role
from pearl_hpc.engine.types import TurnRequest
from tests.conftest import vllm_skip_reason

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason())),
]

PROMPT = (5, 6, 7, 8, 9, 10)


def test_a_tp2_engine_loads_every_version_from_a_file(tiny_model_dir: str, tmp_path: Path):
    from safetensors.torch import load_file, save

    from pearl_hpc.engine.client import spawn_worker
    from pearl_hpc.engine.rpc import new_key
    from pearl_hpc.engine.spec import EngineSpec
    from pearl_hpc.train.sync import WeightSync
    from pearl_hpc.weights.shm import SharedStore

    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    changed = {k: v * 1.5 for k, v in state.items()}
    store = SharedStore.create(f"tp-{tmp_path.name}")
    assert store is not None

    async def scenario() -> dict:
        spec = EngineSpec(model_dir=tiny_model_dir, tensor_parallel_size=2)
        # one NUMA node here: vLLM's CPU TP needs its two workers' cores named
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        key = new_key()
        worker = await spawn_worker(spec, "tp2", run_dir=tmp_path, key=key, env=env)
        out: dict = {}
        try:
            c = worker.client

            async def greedy(name: str) -> tuple[int, ...]:
                return (await c.generate(TurnRequest(name, PROMPT, 8))).token_ids

            out["before"] = await greedy("before")
            staged = store.stage(changed, 1)  # as trainer 0 does: mapped, not sent
            assert staged.path is not None and staged.header is not None
            out["mapped"] = await c.map_weights(staged.path, staged.header)
            out["changed"] = await greedy("changed")
            store.stage(state, 2)
            store.unlink_before(2)  # the trainer moved on: v1's name is gone
            await c.deactivate()  # CPU: the engine stops; activate starts it again
            await c.activate(Role.COLOCATED)
            out["restarted"] = await greedy("restarted")
            out["bytes"] = await c.load_weights(3, data=save(changed))  # a memfd copy
            out["from_bytes"] = await greedy("from_bytes")
            await c.load_weights(4, data=save(state))
            out["back"] = await greedy("back")
            network = WeightSync(key, bucket_bytes=1 << 16)  # another node's trainer: gloo
            try:
                await network.form({"tp2": c})
                await network.publish(network.stage(changed, 5))  # into a memfd, bucket by bucket
            finally:
                network.close()
            out["sent"] = [t for t in (await c.stats()).timings if t.op == "weights"][-1]
            out["from_network"] = await greedy("from_network")
        finally:
            await worker.stop()
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        store.close()
    log = (tmp_path / "tp2.log").read_text()
    assert "Worker_TP1" in log  # two worker processes served it
    mapped, from_bytes = out["mapped"].detail, out["bytes"].detail
    assert (mapped["source"], mapped["via"], mapped["version"]) == ("shm", "file", 1)
    assert (from_bytes["source"], from_bytes["via"]) == ("bytes", "file")
    assert out["changed"] != out["before"]
    assert out["restarted"] == out["changed"]  # re-applied from the open file
    assert out["from_bytes"] == out["changed"]  # the same weights another way
    assert out["back"] == out["before"]
    sent = out["sent"].detail
    assert (sent["source"], sent["via"], sent["version"]) == ("broadcast", "file", 5)
    assert out["from_network"] == out["changed"]
