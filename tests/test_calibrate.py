"""Cluster bandwidth calibration: the nccl-tests parser on hand-written outputs (current
and legacy formats, 2 and 8 ranks), the bus-bandwidth formula, the YAML files, the
build/run script's plumbing, and a real 2-rank gloo measurement through the CLI."""

# ruff: noqa: E501  (nccl-tests lines are wider than 100 columns and are kept verbatim)

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pearl_hpc import calibrate as cal
from pearl_hpc.cli import main
from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.errors import CalibrationError, ConfigError
from pearl_hpc.slurm.parse import expand_hostlist

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "nccl-tests.sh"
PROFILE = REPO_CONFIGS / "profiles" / "qwen3-8b-h800-tp2.yaml"

# sendrecv_perf, nccl-tests 2.14 format, 2 ranks on 2 nodes (one GPU each, over the
# network); in-place #wrong is N/A; NCCL INFO lines are interleaved as with NCCL_DEBUG=INFO.
SENDRECV_2 = """\
# nccl-tests version 2.14.1 nccl-headers=22305 nccl-library=22305
# Collective test starting: sendrecv_perf
# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41234 on     gpu001 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  38811 on     gpu002 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
gpu001:41234:41234 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>
gpu001:41234:41234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1     57.6   18.20   18.20       0     57.6   18.22   18.22     N/A
     4194304       1048576     float     sum      -1    133.2   31.50   31.50       0    133.0   31.53   31.53     N/A
    16777216       4194304     float     sum      -1    410.2   40.90   40.90       0    409.8   40.94   40.94     N/A
    67108864      16777216     float     sum      -1   1504.7   44.60   44.60       0   1503.2   44.64   44.64     N/A
   268435456      67108864     float     sum      -1   5886.7   45.60   45.60       0   5880.9   45.65   45.65     N/A
  1073741824     268435456     float     sum      -1  23444.1   45.80   45.80       0  23420.7   45.85   45.85     N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 37.7856
#
# Collective test concluded: sendrecv_perf
"""

# all_reduce_perf, 2 GPUs of one node (NVLink); n = 2, so busbw = algbw * 2(1)/2 = algbw.
ALL_REDUCE_2 = """\
# nThread 1 nGpus 2 minBytes 8 maxBytes 134217728 step: 64(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   9001 on     gpu001 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   9001 on     gpu001 device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    11.02    0.00    0.00      0    10.87    0.00    0.00      0
         512           128     float     sum      -1    11.31    0.05    0.05      0    11.12    0.05    0.05      0
       32768          8192     float     sum      -1    13.40    2.45    2.45      0    13.21    2.48    2.48      0
     2097152        524288     float     sum      -1    19.88  105.49  105.49      0    19.75  106.19  106.19      0
   134217728      33554432     float     sum      -1    892.1  150.45  150.45      0    890.4  150.74  150.74      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 52.3941
#
"""

# sendrecv_perf from an older nccl-tests: no redop/root columns, the max-error column
# "error", no Group in the rank lines, no test name in the output.
LEGACY_SENDRECV = """\
# nThread 1 nGpus 1 minBytes 33554432 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  20311 on      node1 device  0 [0x1a] Tesla V100-SXM2-32GB
#   Rank  1 Pid  20312 on      node2 device  0 [0x1a] Tesla V100-SXM2-32GB
#
#                                                   out-of-place                       in-place
#       size         count    type     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)             (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
    33554432       8388608   float   3101.2   10.82   10.82  0e+00   3099.8   10.82   10.82  0e+00
    67108864      16777216   float   6131.5   10.94   10.94  0e+00   6140.2   10.93   10.93  0e+00
   134217728      33554432   float    12201   11.00   11.00  0e+00    12190   11.01   11.01  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 10.9204
#
"""


def nccl_output(
    test: str, num_ranks: int, sizes: list[int], busbw_gb_per_s: list[float], *, wrong: int = 0
) -> str:
    """nccl-tests' printout for ``num_ranks`` ranks on nodes of 8 GPUs: times derived from
    the given busbw through nccl-tests' formula, fields at its printf widths."""
    factor = cal.busbw_factor(test, num_ranks)
    lines = [
        f"# Collective test starting: {test}_perf",
        f"# nThread 1 nGpus 1 minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) "
        "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0",
        "#",
        "# Using devices",
        *(
            f"#  Rank {r:2d} Group  0 Pid {5000 + r:6d} on {'node' + str(r // 8):>10s} device"
            f" {r % 8:2d} [0000:{r % 8:02x}:00] NVIDIA H100 80GB HBM3"
            for r in range(num_ranks)
        ),
        "#",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
        "     (us)  (GB/s)  (GB/s)",
    ]
    for i, (size, busbw) in enumerate(zip(sizes, busbw_gb_per_s, strict=True)):
        algbw = busbw / factor
        time_us = size / (algbw * 1e3)
        bad = wrong if i == len(sizes) - 1 else 0
        half = f"  {time_us:7.1f}  {algbw:6.2f}  {busbw:6.2f}  {bad:6d}"
        lines.append(f"{size:12d}  {size // 4:12d}  {'float':>8s}  {'sum':>6s}  {-1:6d}{half * 2}")
    avg = sum(busbw_gb_per_s) / len(busbw_gb_per_s)
    lines += [f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}"]
    lines += [
        f"# Avg bus bandwidth    : {avg:g} ",
        "#",
        f"# Collective test concluded: {test}_perf",
    ]
    return "\n".join(lines) + "\n"


SIZES_8 = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
ALL_REDUCE_8 = nccl_output("all_reduce", 8, SIZES_8, [60.5, 301.2, 402.7, 455.3, 471.9])
SENDRECV_8 = nccl_output("sendrecv", 8, SIZES_8, [21.3, 44.1, 47.2, 48.0, 47.6])


# --------------------------------------------------------------------------- parser
def test_sendrecv_two_ranks_current_format() -> None:
    result = cal.parse_nccl_tests(SENDRECV_2)
    assert result.test == "sendrecv" and result.num_ranks == 2 and result.num_nodes == 2
    assert result.gpu_names == ("NVIDIA H100 80GB HBM3",)
    assert [r.size_bytes >> 20 for r in result.rows] == [1, 4, 16, 64, 256, 1024]
    last = result.rows[-1]
    assert (last.count, last.dtype, last.redop, last.root) == (268435456, "float", "sum", -1)
    assert last.out_of_place.time_us == 23444.1 and last.out_of_place.num_wrong == 0
    assert last.in_place is not None and last.in_place.num_wrong is None  # N/A
    assert result.avg_busbw_gb_per_s == 37.7856  # from the footer, not recomputed
    summary = cal.summarise_nccl(result)
    assert summary.peak_busbw_bytes_per_s == pytest.approx(45.85e9)  # in-place, 1 GiB
    assert summary.peak_size_bytes == 1 << 30
    assert summary.avg_busbw_bytes_per_s == pytest.approx(37.7856e9)


def test_all_reduce_two_ranks_one_node_and_explicit_name() -> None:
    result = cal.parse_nccl_tests(ALL_REDUCE_2, test="all_reduce_perf")
    assert (result.test, result.num_ranks, result.num_nodes) == ("all_reduce", 2, 1)
    assert len(result.rows) == 5 and result.rows[0].size_bytes == 8
    # the largest size (128 MiB >= 64 MiB) carries the peak
    assert cal.summarise_nccl(result).peak_busbw_bytes_per_s == pytest.approx(150.74e9)
    assert result.avg_busbw_gb_per_s == 52.3941


def test_eight_ranks_and_the_busbw_formula() -> None:
    reduce8 = cal.parse_nccl_tests(ALL_REDUCE_8)
    send8 = cal.parse_nccl_tests(SENDRECV_8)
    assert (reduce8.test, reduce8.num_ranks, reduce8.num_nodes) == ("all_reduce", 8, 1)
    assert (send8.test, send8.num_ranks) == ("sendrecv", 8)
    for result, factor in ((reduce8, 2 * 7 / 8), (send8, 1.0)):
        assert cal.busbw_factor(result.test, 8) == factor
        for row in result.rows:  # busbw = algbw * factor, up to the printed 2 decimals
            m = row.out_of_place
            assert m.busbw_gb_per_s == pytest.approx(m.algbw_gb_per_s * factor, abs=0.02)
    # peak at large sizes: rows >= 64 MiB only (sendrecv peaks at 256 MiB, not 1 GiB)
    peak = cal.summarise_nccl(send8)
    assert (peak.peak_busbw_bytes_per_s, peak.peak_size_bytes) == (48.0e9, 256 << 20)


def test_busbw_factors_and_rows() -> None:
    assert cal.busbw_factor("all_reduce", 2) == 1.0
    assert cal.busbw_factor("all_gather", 4) == 0.75
    assert cal.busbw_factor("reduce_scatter", 8) == 0.875
    assert cal.busbw_factor("broadcast", 16) == cal.busbw_factor("sendrecv", 16) == 1.0
    row = cal.bandwidth_row("all_reduce", 1_000_000_000, 0.5, 4)
    assert (row.algbw_bytes_per_s, row.busbw_bytes_per_s, row.time_us) == (2e9, 3e9, 5e5)
    with pytest.raises(CalibrationError, match="no bus-bandwidth rule"):
        cal.busbw_factor("all_to_nowhere", 2)


def test_peak_falls_back_to_the_largest_size_below_64_mib() -> None:
    rows = [
        cal.bandwidth_row("sendrecv", size, size / 1e9 / bw, 2)
        for size, bw in ((1 << 20, 3.0), (4 << 20, 2.0))
    ]
    summary = cal.summarise("sendrecv", 2, rows)
    assert summary.peak_size_bytes == 4 << 20
    assert summary.peak_busbw_bytes_per_s == pytest.approx(2e9)


def test_legacy_format_without_redop_root_or_test_name() -> None:
    with pytest.raises(CalibrationError, match="does not name its test"):
        cal.parse_nccl_tests(LEGACY_SENDRECV)
    result = cal.parse_nccl_tests(LEGACY_SENDRECV, test="sendrecv_perf")
    assert (result.test, result.num_ranks, result.num_nodes) == ("sendrecv", 2, 2)
    row = result.rows[0]
    assert (row.redop, row.root, row.dtype) == (None, None, "float")
    assert row.out_of_place.num_wrong is None  # the legacy column is a max error, not a count
    assert result.rows[2].out_of_place.time_us == 12201
    assert cal.summarise_nccl(result).peak_busbw_bytes_per_s == pytest.approx(11.01e9)


def test_srun_label_prefixes_are_ignored() -> None:
    labelled = "".join(f"0: {line}\n" for line in SENDRECV_2.splitlines())
    assert cal.parse_nccl_tests(labelled).rows == cal.parse_nccl_tests(SENDRECV_2).rows


def one_rank_run(host: str) -> str:
    """What one task prints when srun's --mpi plugin does not match nccl-tests' MPI: a test
    of its own, on one rank (rank 0, on its node)."""
    return SENDRECV_2.replace("#  Rank  1 Group  0 Pid  38811 on     gpu002", "# dropped").replace(
        "gpu001", host
    )


def test_a_run_of_separate_one_rank_tests_is_refused() -> None:
    single = one_rank_run("gpu001")
    with pytest.raises(CalibrationError, match="ran on 1 rank: a bandwidth needs 2"):
        cal.parse_nccl_tests(single)
    # two tasks' printouts interleaved (tee of one srun): rank 0 twice, two headers
    a, b = one_rank_run("gpu001").splitlines(), one_rank_run("gpu002").splitlines()
    interleaved = "\n".join(x for pair in zip(a, b, strict=True) for x in pair) + "\n"
    with pytest.raises(CalibrationError, match=r"second '# nThread' header: every task ran"):
        cal.parse_nccl_tests(interleaved)
    ranks_twice = SENDRECV_2.replace("Rank  1 Group", "Rank  0 Group")
    with pytest.raises(CalibrationError, match=r"rank 0 is listed twice.*srun --mpi=list"):
        cal.parse_nccl_tests(ranks_twice)
    assert cal.parse_nccl_tests(SENDRECV_2, expected_ranks=2).num_ranks == 2
    with pytest.raises(CalibrationError, match="ran on 2 ranks, srun started 16 tasks"):
        cal.parse_nccl_tests(SENDRECV_2, expected_ranks=16)


def test_wrong_values_are_an_error() -> None:
    bad = nccl_output("all_reduce", 8, SIZES_8, [60.5, 301.2, 402.7, 455.3, 471.9], wrong=3)
    with pytest.raises(CalibrationError, match=r"#wrong > 0\) at sizes 1073741824 B"):
        cal.parse_nccl_tests(bad)
    footer_only = ALL_REDUCE_2.replace("values : 0 OK", "values : 2 FAILED")
    with pytest.raises(CalibrationError, match="Out of bounds values : 2 FAILED"):
        cal.parse_nccl_tests(footer_only, test="all_reduce")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no data rows"),
        (SENDRECV_2.split("#        (B)")[0], "no data rows"),  # died before the first size
        (SENDRECV_2.split("# Out of bounds")[0], "ends before the '# Avg bus bandwidth'"),
        (SENDRECV_2 + SENDRECV_2, "a second test starts"),
    ],
)
def test_unusable_output_is_an_error(text: str, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        cal.parse_nccl_tests(text, where="x.txt")


def test_first_host_and_srun_rendezvous() -> None:
    assert expand_hostlist("gpu[03-04,9],cpu1")[0] == "gpu03"
    assert expand_hostlist("node7") == ["node7"]
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1234"}
    env["SLURM_STEP_NODELIST"] = "n[2-3]"
    assert cal.srun_rendezvous(env) == (3, 8, "tcp://n2:21234")
    env |= {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert cal.srun_rendezvous(env)[2] == "tcp://10.0.0.5:29500"
    with pytest.raises(ConfigError, match="SLURM_PROCID and SLURM_NTASKS not set"):
        cal.srun_rendezvous({})


# --------------------------------------------------------------------------- YAML files
def write_nccl_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "all_reduce_perf.txt").write_text(ALL_REDUCE_8)
    (path / "sendrecv_perf.txt").write_text(SENDRECV_8)
    (path / "sendrecv_perf.err").write_text("srun: warning: not parsed\n")
    return path


def test_profile_with_transfer_replaces_one_line_and_keeps_the_rest() -> None:
    text = PROFILE.read_text()
    new = cal.profile_with_transfer(text, 4.8e10, note="BW: measured", where="p.yaml")
    before, after = yaml.safe_load(text), yaml.safe_load(new)
    assert after.pop("transfer_bytes_per_s") == 4.8e10
    before.pop("transfer_bytes_per_s")
    assert after == before
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines(), strict=True) if a != b]
    assert changed == [
        (
            "transfer_bytes_per_s: 5.0e+10       # BW: 800 Gb/s InfiniBand = 100 GB/s, 50% effective",
            "transfer_bytes_per_s: 4.8000e+10    # BW: measured",
        )
    ]
    with pytest.raises(CalibrationError, match="one top-level 'transfer_bytes_per_s:' line"):
        cal.profile_with_transfer(text + "transfer_bytes_per_s: 1.0e+9\n", 1e9, note="", where="p")


def test_calibrate_from_nccl_dir_writes_cluster_and_profile(tmp_path: Path) -> None:
    out = tmp_path / "clusters" / "eight-bandwidth.yaml"
    nccl = write_nccl_dir(tmp_path / "nccl")
    profile_out = tmp_path / "p.yaml"
    args = ["--nccl-dir", str(nccl), "--out", str(out), "--profile", str(PROFILE)]
    code = main(["calibrate", *args, "--profile-out", str(profile_out)])
    assert code == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["source"] == "nccl-tests" and doc["num_ranks"] == 8 and doc["num_nodes"] == 1
    assert doc["gpu"] == "NVIDIA H100 80GB HBM3"
    assert doc["p2p_bytes_per_s"] == 48.0e9
    assert doc["allreduce_busbw_bytes_per_s"] == 471.9e9
    assert doc["broadcast_bytes_per_s"] is None  # not measured
    assert doc["sizes_bytes"] == SIZES_8
    assert set(doc["tests"]) == {"all_reduce", "sendrecv"}
    assert "measured_at" in doc and out.read_text().startswith("# Cluster bandwidth")
    profile = load_profile(tmp_path / "p.yaml")
    assert profile.transfer_bytes_per_s == 48.0e9
    shipped = load_profile(PROFILE)
    assert profile.replace(transfer_bytes_per_s=shipped.transfer_bytes_per_s) == shipped
    copy = (tmp_path / "p.yaml").read_text()
    assert copy.count("\n#") >= PROFILE.read_text().count("\n#")  # comments kept


def test_calibrate_refuses_what_it_should_not_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster_config = tmp_path / "local.yaml"
    cluster_config.write_text("name: local\nbase: {nodes: 1}\n")
    nccl = str(write_nccl_dir(tmp_path / "nccl"))
    assert main(["calibrate", "--nccl-dir", nccl, "--out", str(cluster_config)]) == 2
    assert "not a bandwidth file" in capsys.readouterr().err
    assert cluster_config.read_text() == "name: local\nbase: {nodes: 1}\n"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "all_reduce_perf.txt").write_text(
        nccl_output("all_reduce", 2, [1 << 20], [1.0], wrong=1)
    )
    out = tmp_path / "x.yaml"
    assert main(["calibrate", "--nccl-dir", str(tmp_path / "bad"), "--out", str(out)]) == 2
    assert "wrong values" in capsys.readouterr().err and not out.exists()


# --------------------------------------------------------------------------- the script
def fake_toolchain(tmp_path: Path) -> dict[str, str]:
    """A CUDA, NCCL and MPI folder with only the files the script checks, and an
    nccl-tests source whose Makefile records its variables."""
    for folder, files in (
        ("cuda", ["bin/nvcc", "include/cuda_runtime.h"]),
        ("nccl", ["include/nccl.h", "lib/libnccl.so"]),
        ("mpi", ["include/mpi.h"]),
    ):
        for name in files:
            (tmp_path / folder / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / name).write_text("")
    (tmp_path / "cuda" / "bin" / "nvcc").chmod(0o755)
    src = tmp_path / "src"
    (src / "src").mkdir(parents=True)
    (src / "Makefile").write_text("all:\n\t@false\n")  # the script builds in src/
    (src / "src" / "Makefile").write_text(
        "$(BUILDDIR)/%_perf:\n"
        "\t@mkdir -p $(BUILDDIR) && touch $@ && chmod +x $@\n"
        "\t@echo MPI=$(MPI) MPI_HOME=$(MPI_HOME) CUDA_HOME=$(CUDA_HOME) NCCL_HOME=$(NCCL_HOME)"
        " > $(BUILDDIR)/vars\n"
    )
    return {
        "CUDA_HOME": str(tmp_path / "cuda"),
        "NCCL_HOME": str(tmp_path / "nccl"),
        "MPI_HOME": str(tmp_path / "mpi"),
        "NCCL_TESTS_SRC": str(src),
        "PEARL_NCCL_TESTS_DIR": str(tmp_path / "build"),
    }


def script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PEARL_"))}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=clean | env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_script_build_passes_the_toolchain_to_make(tmp_path: Path) -> None:
    env = fake_toolchain(tmp_path)
    done = script("build", env=env)
    assert done.returncode == 0, done.stderr
    build = tmp_path / "build" / "bin"
    assert (build / "sendrecv_perf").exists()
    assert (build / "vars").read_text().split() == [
        "MPI=1",
        f"MPI_HOME={tmp_path / 'mpi'}",
        f"CUDA_HOME={tmp_path / 'cuda'}",
        f"NCCL_HOME={tmp_path / 'nccl'}",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_script_build_finds_a_distribution_mpi_from_its_wrapper(tmp_path: Path) -> None:
    """/usr/bin/mpicc of a distribution MPI: the headers are not beside bin/ but where
    the wrapper's -I points (Debian: /usr/lib/x86_64-linux-gnu/openmpi/include)."""
    env = fake_toolchain(tmp_path)
    del env["MPI_HOME"]
    mpi = tmp_path / "lib" / "openmpi"
    (mpi / "include").mkdir(parents=True)
    (mpi / "include" / "mpi.h").write_text("")
    bin_dir = tmp_path / "usr-bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "mpicc"
    wrapper.write_text(f"#!/bin/sh\necho gcc -I{mpi}/include -pthread -L{mpi}/lib -lmpi\n")
    wrapper.chmod(0o755)
    done = script("build", env=env | {"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert f"MPI_HOME={mpi}" in (tmp_path / "build" / "bin" / "vars").read_text().split()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_script_builds_without_mpi_for_one_process(tmp_path: Path) -> None:
    """PEARL_NCCL_TESTS_MPI=0 (one process drives the node's GPUs): no MPI needed; only
    the tests named are built."""
    env = fake_toolchain(tmp_path)
    del env["MPI_HOME"]
    done = script(
        "build", env=env | {"PEARL_NCCL_TESTS_MPI": "0", "PEARL_NCCL_TESTS": "all_reduce_perf"}
    )
    assert done.returncode == 0, done.stderr
    build = tmp_path / "build" / "bin"
    assert (build / "all_reduce_perf").exists() and not (build / "sendrecv_perf").exists()
    assert (build / "vars").read_text().split()[:2] == ["MPI=0", "MPI_HOME="]
    bad = script("build", env=env | {"PEARL_NCCL_TESTS_MPI": "yes"})
    assert bad.returncode == 1 and "use 1 (srun, one task per GPU) or 0" in bad.stderr


def test_script_build_names_the_missing_nccl_link_of_a_pip_nccl(tmp_path: Path) -> None:
    env = fake_toolchain(tmp_path)
    lib = tmp_path / "nccl" / "lib"
    (lib / "libnccl.so").rename(lib / "libnccl.so.2")
    done = script("build", env=env)
    assert done.returncode == 1
    assert "lib/libnccl.so.2 but no lib/libnccl.so (a pip NCCL): ln -s" in done.stderr


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("NCCL_HOME", "has no include/nccl.h"),
        ("MPI_HOME", "has no include/mpi.h"),
        ("CUDA_HOME", "has no bin/nvcc"),
    ],
)
def test_script_names_the_missing_variable(tmp_path: Path, drop: str, message: str) -> None:
    env = fake_toolchain(tmp_path) | {drop: str(tmp_path / "nowhere")}
    done = script("build", env=env)
    assert done.returncode == 1 and f"{drop}={tmp_path / 'nowhere'} {message}" in done.stderr


def test_script_run_needs_an_allocation(tmp_path: Path) -> None:
    done = script("run", env={"PATH": os.environ["PATH"]})
    assert done.returncode == 1
    assert "srun not found" in done.stderr or "SLURM_JOB_ID is not set" in done.stderr
    assert "usage" in script(env={}).stderr


@pytest.mark.slurm
def test_script_run_on_the_local_cluster(slurm_cluster: str, tmp_path: Path) -> None:
    """`run` srun's each test over the allocation (pmi2, one task per GPU); a stand-in
    binary prints canned nccl-tests output from rank 0 only, as an MPI build does."""
    build = tmp_path / "build" / "bin"
    build.mkdir(parents=True)
    for test in ("all_reduce_perf", "sendrecv_perf"):  # 4 ranks: one test over the 4 tasks
        text = nccl_output(test.removesuffix("_perf"), 4, SIZES_8, [20.0, 40, 45, 46, 46])
        (tmp_path / f"{test}.canned").write_text(text)
        stub = build / test
        stub.write_text(
            '#!/bin/sh\n[ "$SLURM_PROCID" = 0 ] || exit 0\n'
            f'echo "tasks=$SLURM_NTASKS nodes=$SLURM_NNODES" >&2\ncat {tmp_path}/{test}.canned\n'
        )
        stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        "SLURM_CONF": slurm_cluster,
        "PEARL_NCCL_TESTS_DIR": str(tmp_path / "build"),
        "PEARL_NCCL_TESTS_OUT": str(out),
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PEARL_"))}
    salloc = ["salloc", "-N", "2", "--gpus-per-node=2", "--ntasks-per-node=2", "-t", "2"]
    done = subprocess.run(
        [*salloc, "bash", str(SCRIPT), "run"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "sendrecv_perf.err").read_text().strip() == "tasks=4 nodes=2"
    assert (out / "ntasks").read_text().strip() == "4"  # what the parser checks ranks against
    results = cal.read_nccl_dir(out)
    assert [r.test for r in results] == ["all_reduce", "sendrecv"]


def test_nccl_dir_ranks_must_be_the_tasks_srun_started(tmp_path: Path) -> None:
    (tmp_path / "all_reduce_perf.txt").write_text(ALL_REDUCE_8)
    (tmp_path / "ntasks").write_text("8\n")
    assert cal.read_nccl_dir(tmp_path)[0].num_ranks == 8
    (tmp_path / "ntasks").write_text("16\n")
    with pytest.raises(CalibrationError, match="ran on 8 ranks, srun started 16 tasks"):
        cal.read_nccl_dir(tmp_path)
    (tmp_path / "ntasks").write_text("many\n")
    with pytest.raises(ConfigError, match="ntasks: 'many' is not a task count"):
        cal.read_nccl_dir(tmp_path)


# --------------------------------------------------------------------------- gloo
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install torch)"
)
def test_gloo_measurement_two_local_ranks_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "local-bandwidth.yaml"
    profile_out = tmp_path / "profile.yaml"
    args = ["--gloo", "--ranks", "2", "--max-size-mib", "4", "--out", str(out)]
    profile = ["--profile", "qwen3-8b-h800-tp2", "--profile-out", str(profile_out)]
    code = main(["calibrate", *args, *profile])
    assert code == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["source"] == "gloo" and doc["num_ranks"] == 2
    assert doc["sizes_bytes"] == [1 << 20, 4 << 20]
    for field in ("p2p_bytes_per_s", "allreduce_busbw_bytes_per_s", "broadcast_bytes_per_s"):
        assert 1e6 < doc[field] < 1e12, field  # loopback: MB/s to a few hundred GB/s
    for test, rows in ((t, s["rows"]) for t, s in doc["tests"].items()):
        for row in rows:  # n = 2: every busbw factor is 1
            assert row["busbw_bytes_per_s"] == row["algbw_bytes_per_s"], test
            assert row["algbw_bytes_per_s"] == pytest.approx(
                row["size_bytes"] / (row["time_us"] * 1e-6), rel=1e-3
            )
    assert load_profile(profile_out).transfer_bytes_per_s == pytest.approx(
        doc["p2p_bytes_per_s"], rel=1e-3
    )
