"""The run config's ``slurm:`` section: the site settings of every job the run submits
(the base job, each elastic request, the ``--submit`` job), and the elastic jobs'
polling and lease.

A cluster's file (:mod:`.cluster`) gives the values that are true of the cluster
(account, partition, GPU type, MPI plugin, module loads); a run config overrides what
differs, an elastic pool what differs for its partition. Keys that Slurm names keep
Slurm's names (``--time``, ``--mem``, ``--qos``).

Pure: the checks here need no Slurm (``pearl-hpc cluster check`` asks the live one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pearl_hpc.core.schema import spec_field

SLURM_TIME = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}|\d+")  # fullmatch: a Slurm time
SLURM_NAME = re.compile(r"[A-Za-z0-9_.+\-&|]+")  # partitions, accounts, qos, constraints
SLURM_MEM = re.compile(r"\d+[KMGT]?")  # --mem / --mem-per-gpu
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GPU_OPTIONS = ("gres", "gpus-per-node")
CONTAINER_RUNTIMES = ("", "pyxis", "apptainer")


@dataclass(frozen=True)
class ContainerSettings:
    """The image every rank of the run runs in. The launchers (each job's batch step,
    which submits, watches and starts the ranks with srun or MPICH's gforker) stay on
    the host: ``slurm.python`` there needs pearl_hpc without its extras."""

    runtime: str = spec_field(
        "'' (none) | pyxis (srun --container-image: every step of the run's ranks) | "
        "apptainer (apptainer exec --nv IMAGE: every rank's command)",
        default="",
    )
    image: str = spec_field(
        "pyxis: an image enroot imports (/shared/pearl.sqsh, nvcr.io#nvidia/pytorch:25.01-py3); "
        "apptainer: a .sif file; pearl_hpc and its gpu extra installed in it",
        default="",
    )
    mounts: list[str] = spec_field(
        "SRC[:DST[:FLAGS]] each: what the ranks read and write (the runs directory, the "
        "model, the shared filesystem)",
        default=[],
    )
    options: list[str] = spec_field(
        "further options of the runtime (pyxis: srun's, e.g. --container-writable; "
        "apptainer: exec's, e.g. --cleanenv)",
        default=[],
    )
    python: str = spec_field("the image's Python, which has pearl_hpc", default="python3")


@dataclass(frozen=True)
class SlurmSettings:
    """What every job of the run asks of Slurm, and how the elastic jobs are watched."""

    partition: str = spec_field("the base job's partition ('': the cluster's default)", default="")
    account: str = spec_field("--account of every job ('': the user's default account)", default="")
    qos: str = spec_field("--qos of every job ('': the partition's default)", default="")
    time: str = spec_field(
        "the base job's time limit, a Slurm time (e.g. 2-00:00:00; '': the partition's default)",
        default="",
    )
    constraint: str = spec_field(
        "--constraint of every job, node features (e.g. a100&ib; '': none)", default=""
    )
    exclusive: bool = spec_field("the base job's nodes are its own (--exclusive)", default=False)
    mem: str = spec_field(
        "--mem of each node of the base job (e.g. 500G; 0: all of it; '': the default)",
        default="",
    )
    mem_per_gpu: str = spec_field(
        "or --mem-per-gpu of every job, elastic workers too (e.g. 64G; '': the default); "
        "not with mem",
        default="",
    )
    gpu_type: str = spec_field(
        "the GPUs' GRES type (e.g. a100: --gres=gpu:a100:8; '': untyped)", default=""
    )
    gpu_option: str = spec_field(
        "how GPUs are asked: gres (--gres=gpu[:TYPE]:N) | gpus-per-node (--gpus-per-node=[TYPE:]N)",
        default="gres",
    )
    mpi: str = spec_field(
        "srun --mpi of the elastic engine steps (pmi2, pmix, ...: srun --mpi=list)",
        default="pmi2",
    )
    setup: list[str] = spec_field(
        "shell lines every batch job of the run runs first, after env (module load ..., "
        "source VENV/bin/activate); its srun steps inherit what they set",
        default=[],
    )
    env: dict[str, str] = spec_field(
        "variables exported in every batch job of the run (HF_HUB_OFFLINE, NCCL_IB_HCA, "
        "UCX_NET_DEVICES, ...), before setup",
        default={},
    )
    python: str = spec_field(
        "the Python every job of the run runs pearl_hpc with ('': the one running "
        "pearl-hpc now; python3: whichever setup puts first on PATH)",
        default="",
    )
    template: str = spec_field(
        "the base job's script from a site's template file instead of pearl_hpc's: "
        "$options (the #SBATCH lines), $setup (env and setup lines), $command (its exec "
        "line) are filled in ('': none)",
        default="",
    )
    sbatch_extra: list[str] = spec_field(
        "further sbatch options of every job (e.g. --reservation=r1)", default=[]
    )
    srun_extra: list[str] = spec_field(
        "further srun options of every step the run starts (e.g. --cpu-bind=none)", default=[]
    )
    signal_lead_s: int = spec_field(
        "the base job's warning before its time limit or a preemption (--signal=B:USR2@N): "
        "the trainer checkpoints at once",
        default=300,
        ge=1,
    )
    container: ContainerSettings = spec_field(
        "the image the ranks run in (pyxis or apptainer; runtime '': none)",
        default=ContainerSettings(),
    )
    poll_s: float = spec_field("squeue poll interval, seconds", default=1.0, gt=0)
    engine_interface: str = spec_field(
        "what engine and trainer sockets bind on each node: 'hostname' (what the node's "
        "name resolves to; refused if loopback where the run spans nodes), an interface "
        "(e.g. ib0, eth0: also GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless env sets "
        "them) or an IPv4 address",
        default="hostname",
    )
    lease_timeout_s: float = spec_field(
        "an elastic job whose master's lease is this old ends itself (a resume within it "
        "finds the job and adopts it)",
        default=60.0,
        gt=0,
    )


def slurm_problem(s: SlurmSettings) -> str:
    """What is wrong with ``slurm:`` ('' if nothing; pure)."""
    for key in ("partition", "account", "qos", "constraint", "gpu_type", "mpi"):
        value = getattr(s, key)
        if value and not SLURM_NAME.fullmatch(value):
            return f"slurm.{key} {value!r}: letters, digits, _ . + - & | only"
    if s.time and not SLURM_TIME.fullmatch(s.time):
        return f"slurm.time {s.time!r} is not a Slurm time: use MM, MM:SS, HH:MM:SS or D-HH:MM:SS"
    for key in ("mem", "mem_per_gpu"):
        value = getattr(s, key)
        if value and not SLURM_MEM.fullmatch(value):
            return f"slurm.{key} {value!r}: a Slurm size, e.g. 500G, 64000M or 0"
    if s.mem and s.mem_per_gpu:
        return "slurm.mem and slurm.mem_per_gpu are both set; Slurm takes one: keep one"
    if s.gpu_option not in GPU_OPTIONS:
        return f"slurm.gpu_option {s.gpu_option!r}: use gres or gpus-per-node"
    for key in s.env:
        if not ENV_NAME.fullmatch(key):
            return f"slurm.env.{key}: not a shell variable name (letters, digits, _)"
    for i, line in enumerate(s.setup):
        if "\n" in line or not line.strip():
            return f"slurm.setup[{i}]: one non-empty shell line per item"
    if s.python and not re.fullmatch(r"[A-Za-z0-9_./+-]+", s.python):
        return f"slurm.python {s.python!r}: a command or a path (python3, /opt/venv/bin/python)"
    for key in ("sbatch_extra", "srun_extra"):
        for i, option in enumerate(getattr(s, key)):
            if not option.startswith("-") or "\n" in option:
                return f"slurm.{key}[{i}] {option!r}: an option, e.g. --reservation=r1"
    return container_problem(s.container)


def is_ipv4(text: str) -> bool:
    """``text`` is a dotted IPv4 address (what ``slurm.engine_interface`` may name
    besides 'hostname' and an interface; pure)."""
    import socket

    try:
        return socket.inet_aton(text) is not None and text.count(".") == 3
    except OSError:
        return False


def job_env(s: SlurmSettings) -> dict[str, str]:
    """What every job of the run exports (pure): ``slurm.env``, after what
    ``slurm.engine_interface`` implies when it names an interface -- gloo's and NCCL's
    socket interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``: the weight groups'
    traffic and NCCL's bootstrap on the network the run's sockets use, not whichever
    interface comes first). UCX's devices (``UCX_NET_DEVICES``, NIXL's KV path) are left
    to ``slurm.env``: naming an IP interface there would keep UCX off the RDMA devices."""
    iface = s.engine_interface
    named = iface != "hostname" and not is_ipv4(iface)
    implied = {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface} if named else {}
    return {**implied, **s.env}


def container_problem(c: ContainerSettings) -> str:
    """What is wrong with ``slurm.container`` ('' if nothing; pure)."""
    where = "slurm.container"
    if c.runtime not in CONTAINER_RUNTIMES:
        return f"{where}.runtime {c.runtime!r}: use pyxis, apptainer or '' (none)"
    if not c.runtime:
        return ""
    if not c.image or any(ch.isspace() for ch in c.image):
        return f"{where}.image {c.image!r}: the image the ranks run in (no spaces)"
    for i, mount in enumerate(c.mounts):
        parts = mount.split(":")
        if "," in mount or any(ch.isspace() for ch in mount) or not 1 <= len(parts) <= 3:
            return f"{where}.mounts[{i}] {mount!r}: SRC[:DST[:FLAGS]], one mount an item"
        if not all(p.startswith("/") for p in parts[:2]):
            return f"{where}.mounts[{i}] {mount!r}: absolute paths, e.g. /scratch:/scratch"
    for i, option in enumerate(c.options):
        if not option.startswith("-") or "\n" in option:
            return f"{where}.options[{i}] {option!r}: an option, e.g. --container-writable"
    if not re.fullmatch(r"[A-Za-z0-9_./+-]+", c.python):
        return f"{where}.python {c.python!r}: a command or a path in the image (python3)"
    return ""


def container_srun_options(c: ContainerSettings) -> list[str]:
    """What a step's ``srun`` needs to run in the image (pyxis; none otherwise; pure)."""
    if c.runtime != "pyxis":
        return []
    mounts = [f"--container-mounts={','.join(c.mounts)}"] if c.mounts else []
    return [f"--container-image={c.image}", *mounts, *c.options]


def in_container(c: ContainerSettings, argv: list[str]) -> list[str]:
    """``argv`` as it runs in the image: apptainer wraps it; under pyxis (or with no
    container) it is unchanged, srun's options do it (pure)."""
    if c.runtime != "apptainer":
        return list(argv)
    binds = [word for mount in c.mounts for word in ("--bind", mount)]
    return ["apptainer", "exec", "--nv", *binds, *c.options, c.image, *argv]


TEMPLATE_KEYS = ("options", "setup", "command")


def template_problem(text: str) -> str:
    """What is wrong with a batch script template ('' if nothing; pure): ``$command``
    must be in it, and no placeholder but :data:`TEMPLATE_KEYS`."""
    import string

    template = string.Template(text)
    if not template.is_valid():
        return "a lone $ (write $$ for a dollar sign)"
    names = set(template.get_identifiers())
    unknown = sorted(names - set(TEMPLATE_KEYS))
    if unknown:
        return f"${unknown[0]} is not a placeholder: use $options, $setup, $command ($$ for $)"
    if "command" not in names:
        return "$command is missing: the job would not run the world"
    return ""


def slurm_minutes(time: str) -> int:
    """A Slurm time (checked by :func:`slurm_problem`) in whole minutes, at least 1
    (pure): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif len(parts) == 3:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    else:  # MM or MM:SS
        seconds = parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)
    return max(1, seconds // 60)


def gpu_request(s: SlurmSettings, gpus: int) -> list[str]:
    """The option asking for ``gpus`` GPUs a node (none for 0), typed when the cluster
    types them (pure)."""
    if not gpus:
        return []
    if s.gpu_option == "gpus-per-node":
        return [f"--gpus-per-node={s.gpu_type + ':' if s.gpu_type else ''}{gpus}"]
    return [f"--gres=gpu:{s.gpu_type + ':' if s.gpu_type else ''}{gpus}"]


def site_options(s: SlurmSettings, *, qos: str = "", account: str = "", constraint: str = "",
                 mem: str | None = None) -> list[str]:  # fmt: skip
    """The sbatch options every job of the run carries (pure); a pool's own values go in
    the keywords and win over the run's (``mem``: the pool's, '' for none -- an elastic
    worker takes part of a node -- None for the base job's ``slurm.mem``)."""
    mem = s.mem if mem is None else mem
    values = {
        "account": account or s.account,
        "qos": qos or s.qos,
        "constraint": constraint or s.constraint,
        "mem": mem,
        "mem-per-gpu": "" if mem else s.mem_per_gpu,
    }
    return [f"--{key}={value}" for key, value in values.items() if value] + list(s.sbatch_extra)
