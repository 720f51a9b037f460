"""Messages of the MPI control plane: flat typed records, sent as msgpack bytes.

The master sends a :class:`Command` to one member over that member's *link* (the base
job's world, or the merged communicator of the elastic job component it joined with);
members answer with a :class:`Report` on the same link. No command is collective:
nothing a member does can block another member or the master.

    master ──Command(seq, Train | Publish | CatchUp | Release | Save | Leave | Shutdown)──> member
    member ──Report(member_id, seq, TrainAck | PublishAck | ... | Hello | Heartbeat)──> master

Every body is a ``msgspec.Struct`` whose tag names it on the wire; a command's ack
echoes its ``seq``. Nothing on the plane is pickled: bytes from a member (an elastic rank
that joined from another job) are decoded into these types or refused
(:class:`msgspec.DecodeError` / :class:`msgspec.ValidationError`). An elastic rank's
:class:`Hello` carries a proof that it holds the run's key (:mod:`pearl_hpc.comm.mpi`).
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

TAG_COMMAND = 11
TAG_REPORT = 12


class Op(StrEnum):
    """A command's name (its body's wire tag), as acks and logs name it."""

    # point to point: one member
    RELEASE = "release"  # trainer: free the device for an overlap engine; stay in the plane
    TRAIN = "train"  # trainer: one training step
    SAVE = "save"  # trainer: a checkpoint of the current version, now (after any step)
    PUBLISH = "publish"  # trainer 0: broadcast the latest weights to the serving engines
    CATCH_UP = "catch_up"  # trainer 0: the latest weights to one engine
    LEAVE = "leave"  # leave the plane (Disconnect) and exit: the job is being given back
    SHUTDOWN = "shutdown"  # the run is over: leave and exit


# ------------------------------------------------------------------------- commands
class Release(msgspec.Struct, frozen=True, tag=Op.RELEASE.value):
    """Move this trainer rank's tensors to host memory: an overlap engine wakes on its
    GPU after the ack. They come back with the next :class:`Train`."""


class Train(msgspec.Struct, frozen=True, tag=Op.TRAIN.value):
    """One GRPO step over the batch (every trainer rank gets the whole batch)."""

    step: int  # the training step (0-based)
    # the batch: msgpack of list[pearl_hpc.rollout.types.Trajectory], encoded by the
    # master and decoded by the trainer with that type (the record is rollout's)
    trajectories: bytes
    checkpoint: bool = False  # then save a checkpoint (written while the next step runs)
    export: bool = False  # trainer 0 then writes the new weights as a Hugging Face directory


class Save(msgspec.Struct, frozen=True, tag=Op.SAVE.value):
    """Every trainer rank: a checkpoint of the current version, complete before the ack
    (Slurm's warning signal: the job ends soon)."""


class Publish(msgspec.Struct, frozen=True, tag=Op.PUBLISH.value):
    """Trainer 0: the weights of ``version`` to every serving engine."""

    version: int  # the weight version to send (trainer 0 sends a newer one if it has it)
    members: dict[str, tuple[str, int]]  # engine name -> its engine socket (host, port)


class CatchUp(msgspec.Struct, frozen=True, tag=Op.CATCH_UP.value):
    """Trainer 0: the latest weights to one engine, point to point."""

    name: str  # the engine's name in the weight group
    host: str  # its engine socket
    port: int


class Leave(msgspec.Struct, frozen=True, tag=Op.LEAVE.value):
    """Leave the plane (both sides Disconnect): this member's job is given back."""


class Shutdown(msgspec.Struct, frozen=True, tag=Op.SHUTDOWN.value):
    """The run is over: ack, leave, exit."""


CommandBody = Release | Train | Save | Publish | CatchUp | Leave | Shutdown


class Command(msgspec.Struct, frozen=True):
    seq: int  # the master's command counter; the ack echoes it
    body: CommandBody

    @property
    def op(self) -> Op:
        return Op(str(type(self.body).__struct_config__.tag))


# -------------------------------------------------------------------------- reports
class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """A member's first report: who it is and where it runs."""

    process: str  # "trainer" | "engine"
    node: str  # the host it runs on (Slurm's node name)
    pid: int
    local_id: int = 0  # SLURM_LOCALID: its index among its job step's tasks on the node
    job_id: str = ""  # SLURM_JOB_ID ('' outside Slurm)
    gpu_ids: tuple[str, ...] = ()  # its GPUs as the role table names them
    rank: int = -1  # a base rank's rank in the base world (-1: elastic)
    group: str = ""  # an elastic rank's job component ("123+1"; '': base)
    host: str = ""  # an engine rank's engine socket
    port: int = 0
    version: int = 0  # a trainer rank's weight version (resumed from its checkpoint)
    index: int = 0  # a trainer rank's index among the trainer ranks
    # an elastic rank's HMAC-SHA256 under the run's key of the master's nonce and this
    # hello without it (pearl_hpc.comm.mpi.hello_proof); b'' from a base rank
    proof: bytes = b""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Alive (sent every ``heartbeat_interval_s``)."""


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """A command done that returns nothing (LEAVE, SHUTDOWN)."""

    op: Op


class Move(msgspec.Struct, frozen=True):
    """One move of a trainer rank's tensors between its GPU and host memory."""

    op: str  # "offload" (lent to an overlap engine) | "onload" (back for training)
    wall_s: float
    free_before: int  # bytes free on the device before the move (0 on cpu)
    free_after: int

    def fields(self) -> dict[str, float]:
        """As the ``handover`` event logs it (``offload_s``, ``offload_free_before``...)."""
        return {
            f"{self.op}_s": round(self.wall_s, 4),
            f"{self.op}_free_before": self.free_before,
            f"{self.op}_free_after": self.free_after,
        }


class TrainAck(msgspec.Struct, frozen=True, tag="trained"):
    """A training step done, as this trainer rank saw it."""

    step: int
    version: int  # the weight version after the step (every rank's must agree)
    mean_reward: float
    max_staleness: int  # the most versions a trained trajectory lagged
    loss: float
    num_tokens: int  # tokens trained on
    wall_s: float  # the step's time on this rank
    # the step's off-policy figures (pearl_hpc/train/objective.py)
    clip_frac: float = 0.0
    mismatch_mean: float = 0.0
    mismatch_max: float = 0.0
    capped_frac: float = 0.0
    behaviour_coverage: float = 0.0
    grad_norm: float = 0.0  # mean pre-clip gradient norm over the step's updates
    entropy: float = 0.0  # mean entropy per policy token before the update (nats)
    lr: float = 0.0  # the step's learning rate
    onload: Move | None = None  # the rank's GPU came back from an overlap engine first
    checkpoint_s: float = 0.0  # the step's wait for its checkpoint (staging it)
    saved: list[int] = []  # versions whose checkpoints completed since the last ack


class SaveAck(msgspec.Struct, frozen=True, tag="saved"):
    """A checkpoint of ``version`` is complete."""

    version: int
    seconds: float


class ReleaseAck(msgspec.Struct, frozen=True, tag="released"):
    """The rank's GPU is free for an overlap engine."""

    offload: Move | None = None  # None: nothing moved (cpu)


class PublishAck(msgspec.Struct, frozen=True, tag="published"):
    """The weights went to the serving engines."""

    version: int  # the version sent (the latest trainer 0 held)
    seconds: float  # the broadcast
    form_s: float  # forming a new weight group first (0: the same members)
    members: int  # engines in the broadcast
    mapped: int  # of them, on trainer 0's node: mapped from shared memory
    unreachable: list[str]  # engines that died since the master listed them


class CatchUpAck(msgspec.Struct, frozen=True, tag="caught_up"):
    seconds: float


class Failed(msgspec.Struct, frozen=True, tag="error"):
    """A command failed on the member."""

    message: str


ReportBody = (
    Hello | Heartbeat | Ack | TrainAck | SaveAck | ReleaseAck | PublishAck | CatchUpAck | Failed
)


class Report(msgspec.Struct, frozen=True):
    # "base:3" (the base world's rank 3) or "123+1:0" (job 123 component 1, rank 0)
    member_id: str
    seq: int  # the command acknowledged; -1 for unsolicited reports
    body: ReportBody


_ENCODER = msgspec.msgpack.Encoder()
_COMMANDS = msgspec.msgpack.Decoder(Command)
_REPORTS = msgspec.msgpack.Decoder(Report)


def encode(message: Command | Report) -> bytes:
    return _ENCODER.encode(message)


def decode_command(data: bytes | bytearray | memoryview) -> Command:
    return _COMMANDS.decode(data)


def decode_report(data: bytes | bytearray | memoryview) -> Report:
    return _REPORTS.decode(data)
