"""Cluster bandwidth calibration: nccl-tests output, a gloo fallback, and the YAML it writes.

::

    slurm/nccl-tests.sh run ─> <test>_perf.txt ─> parse_nccl_tests ──┐
    gloo ranks (local processes | srun tasks) ─> run_gloo_rank ──────┤ summarise
                                                                     v
           ClusterBandwidth ─> configs/clusters/NAME-bandwidth.yaml (cluster_yaml_text)
                  └─> transfer_bytes_per_s in a copy of a workload profile
                      (profile_with_transfer)

The parser, the bus-bandwidth formula, the summaries and the YAML texts are pure
functions; running gloo ranks and writing files are the edges. torch is imported only
inside the gloo functions, so the package imports without it.

Units: nccl-tests prints GB/s meaning 1e9 bytes/s; everything stored here is bytes/s.
"""

from pearl_hpc.calibrate.files import (
    ClusterBandwidth,
    bandwidth_row,
    check_out_path,
    cluster_from_nccl,
    cluster_yaml_text,
    default_profile_out,
    profile_with_transfer,
    read_nccl_dir,
    summarise,
    summarise_nccl,
    write_text,
)
from pearl_hpc.calibrate.gloo import (
    measure_gloo_local,
    run_calibration,
    run_gloo_rank,
    srun_rendezvous,
)
from pearl_hpc.calibrate.nccl import MiB, busbw_factor, parse_nccl_tests

__all__ = [
    "ClusterBandwidth",
    "MiB",
    "bandwidth_row",
    "busbw_factor",
    "check_out_path",
    "cluster_from_nccl",
    "cluster_yaml_text",
    "default_profile_out",
    "measure_gloo_local",
    "parse_nccl_tests",
    "profile_with_transfer",
    "read_nccl_dir",
    "run_calibration",
    "run_gloo_rank",
    "srun_rendezvous",
    "summarise",
    "summarise_nccl",
    "write_text",
]
