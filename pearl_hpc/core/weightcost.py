"""What one weight version costs on its way from the trainer ranks to the engines, by
arithmetic (pure): each stage pearl_hpc runs on a GPU cluster, its bytes over a stated
rate. ``pearl-hpc bench --weights --at-scale`` prints it for Qwen3-8B and Qwen3-30B-A3B
on PEARL's layout; the simulator charges each step :attr:`SyncCost.trainer_s` and
:attr:`SyncCost.pause_s` (the publish between them overlaps generation).

    trainer ranks (every step, before its ack)        trainer_s
      bf16 all-gather of every tensor (FSDP2)            gather_s    W (R-1)/R / train_bus
      trainer 0: device -> pinned host, as it arrives    to_host_s   W / pinned   (overlaps)
      into the version's file in /dev/shm                stage_s     W / host_copy
    publish (the engines keep generating)             publish_s
      its SHA-256, in the background from the stage's    digest_s    W / (hash_core x threads)
        end (beside the stage's own copies its threads
        would slow them several-fold)
      per bucket: host -> device, NCCL broadcast to      broadcast_s W / pageable + B / bcast_bus
        one engine a node, its copy out to /dev/shm,                 + B / pageable (pageable
        each stage overlapping the next bucket's                     the slowest)
      the lead engine hashes each bucket as it lands     verify_s    B / (hash_core x threads)
      (the node's other engines map its file)
    the engine, between two steps                     pause_s
      reload from its host copy, every GPU its shard     load_s      W / (tp x pageable)

Rates not measured here are stated as assumptions (:class:`Links`): NCCL's bus bandwidth
from nccl-tests on the cluster (``pearl-hpc calibrate``), the copy rates of PCIe Gen5.
"""

from __future__ import annotations

from dataclasses import dataclass

BUCKET_BYTES = 1 << 29  # the most a weights bucket holds (unless one block is larger): B
BUCKETS_IN_FLIGHT = 2  # a side of a transfer copies one while the next is sent


@dataclass(frozen=True)
class Links:
    """The rates a version crosses, bytes/s (defaults: PEARL's H800 cluster, 8 x 400 Gb/s
    InfiniBand a node, PCIe Gen5)."""

    train_bus: float = 40e9  # NCCL all-gather bus bandwidth of the trainer ranks (2+ nodes)
    bcast_bus: float = 40e9  # NCCL broadcast bus bandwidth to the engines' nodes (400 Gb/s at 80%)
    pinned: float = 50e9  # device <-> pinned host memory (an H200 measured 53 GB/s)
    pageable: float = 10e9  # device <-> pageable host memory (a file in /dev/shm)
    host_copy: float = 10e9  # host -> host (into the version's file)
    hash_core: float = 1.8e9  # SHA-256 on one core (measured: bench --weights)
    hash_threads: int = 4  # a rank's CPUs (pearl-32gpu: layout.cpus_per_rank)


@dataclass(frozen=True)
class SyncCost:
    """Seconds of each stage of one version (see the module's table)."""

    gather_s: float
    to_host_s: float
    stage_s: float
    digest_s: float
    broadcast_s: float
    verify_s: float
    load_s: float

    @property
    def trainer_s(self) -> float:
        """On the trainer's path, before the step's ack (the copy to the host runs as
        the gather's tensors arrive)."""
        return max(self.gather_s, self.to_host_s) + self.stage_s

    @property
    def publish_s(self) -> float:
        """From trainer 0's copy to every engine holding the version (they generate
        meanwhile)."""
        return self.digest_s + self.broadcast_s + self.verify_s

    @property
    def pause_s(self) -> float:
        """What an engine stops generating for."""
        return self.load_s

    @property
    def total_s(self) -> float:
        """From the step's last update to every engine serving the version."""
        return self.trainer_s + self.publish_s + self.pause_s


def sync_cost(
    weight_bytes: float, trainer_ranks: int, tp: int, links: Links = Links(), *, remote: bool = True
) -> SyncCost:
    """One version of ``weight_bytes`` (in the engines' dtype) from ``trainer_ranks``
    FSDP ranks to engines of ``tp`` GPUs; ``remote``: some engine is on another node than
    trainer 0 (else every engine maps the version: no digest, no broadcast)."""
    w, b = weight_bytes, min(BUCKET_BYTES, weight_bytes)
    hash_rate = links.hash_core * links.hash_threads
    # a bucket's pack, send and copy out, each overlapping the next bucket's: the
    # slowest stage for every byte, the other two for one bucket (filling, draining)
    stages = (links.pageable, links.bcast_bus, links.pageable)
    pipeline = w / min(stages) + sum(b / r for r in stages) - b / min(stages)
    return SyncCost(
        gather_s=w * (trainer_ranks - 1) / trainer_ranks / links.train_bus,
        to_host_s=w / links.pinned,
        stage_s=w / links.host_copy,
        digest_s=w / hash_rate if remote else 0.0,
        broadcast_s=pipeline if remote else 0.0,
        verify_s=b / hash_rate if remote else 0.0,
        load_s=w / (tp * links.pageable),
    )
