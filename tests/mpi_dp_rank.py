"""One of the training ranks of tests/test_grpo_dp.py, launched by ``mpiexec -n N``:
the ranks form a gloo group (rendezvous at rank 0's store, its port sent over MPI),
train one GRPO step data-parallel on the same batch and write what they got.

    mpiexec -n 2 python -m tests.mpi_dp_rank MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from pearl_hpc.engine.store import KeyStore, StoreClient
from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
from pearl_hpc.weights.group import WeightGroup
from tests.factories import uneven_batch

DP_CONFIG = GRPOConfig(lr=1e-2, minibatch_size=4, epochs=2, correction="tis", sequence_mask=3.5)
OFF_POLICY = ("mismatch_mean", "mismatch_max", "capped_frac", "masked_sequences")


def main(model_dir: str, out_dir: str) -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    key = comm.bcast(os.urandom(32).hex() if rank == 0 else None, root=0)  # as rpc.key
    server = KeyStore(key) if rank == 0 else None
    port = comm.bcast(server.port if server is not None else None, root=0)
    group = WeightGroup(StoreClient("127.0.0.1", port, key), "dp", rank, size)
    trainer = GRPOTrainer(model_dir, DP_CONFIG, dp_group=group)
    stats = trainer.train_step(uneven_batch())
    out = Path(out_dir)
    torch.save(trainer.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "loss": stats.loss,
                "grad_norm": stats.grad_norm,
                "kl": stats.kl,
                **{k: getattr(stats, k) for k in OFF_POLICY},
            }
        )
    )
    comm.Barrier()  # rank 0's store outlives every rank's last collective
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
