"""Summaries of measured rows, the cluster bandwidth YAML and the profile copy with
the measured transfer bandwidth (pure text builders; writing files at the edge)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from pearl_hpc.calibrate.nccl import (
    FIELD_OF_TEST,
    GB,
    PEAK_MIN_SIZE_BYTES,
    SOURCES,
    NcclResult,
    busbw_factor,
    parse_nccl_tests,
)
from pearl_hpc.config.files import parse_yaml, read_user_text
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.errors import CalibrationError, ConfigError


# --------------------------------------------------------------------------- summaries
@dataclass(frozen=True)
class BandwidthRow:
    """One message size of one test, in bytes/s, whichever tool measured it."""

    size_bytes: int
    time_us: float  # one operation
    algbw_bytes_per_s: float  # size / time
    busbw_bytes_per_s: float  # algbw * busbw_factor(test, n)


@dataclass(frozen=True)
class TestSummary:
    """One test's rows and its figures at large sizes."""

    test: str
    num_ranks: int | None
    rows: tuple[BandwidthRow, ...]
    peak_busbw_bytes_per_s: float  # max busbw over rows >= min(PEAK_MIN_SIZE_BYTES, largest)
    peak_size_bytes: int  # the size where that max was measured
    avg_busbw_bytes_per_s: float  # nccl-tests' footer, or the mean over rows (gloo)

    def to_dict(self) -> dict[str, Any]:
        """For the cluster YAML: figures rounded to 5 significant digits."""
        return {
            "num_ranks": self.num_ranks,
            "peak_busbw_bytes_per_s": _round(self.peak_busbw_bytes_per_s),
            "peak_size_bytes": self.peak_size_bytes,
            "avg_busbw_bytes_per_s": _round(self.avg_busbw_bytes_per_s),
            "rows": [
                {k: _round(v) if isinstance(v, float) else v for k, v in asdict(r).items()}
                for r in self.rows
            ],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.5g}")


def summarise(
    test: str, num_ranks: int | None, rows: Sequence[BandwidthRow], avg: float | None = None
) -> TestSummary:
    """Peak busbw at large sizes: the max over rows of at least PEAK_MIN_SIZE_BYTES, or
    over the largest size if none is that large; ties go to the larger size."""
    if not rows:
        raise CalibrationError(f"{test}: no rows to summarise")
    threshold = min(PEAK_MIN_SIZE_BYTES, max(r.size_bytes for r in rows))
    peak = max(
        (r for r in rows if r.size_bytes >= threshold),
        key=lambda r: (r.busbw_bytes_per_s, r.size_bytes),
    )
    mean = sum(r.busbw_bytes_per_s for r in rows) / len(rows)
    return TestSummary(
        test=test,
        num_ranks=num_ranks,
        rows=tuple(sorted(rows, key=lambda r: r.size_bytes)),
        peak_busbw_bytes_per_s=peak.busbw_bytes_per_s,
        peak_size_bytes=peak.size_bytes,
        avg_busbw_bytes_per_s=mean if avg is None else avg,
    )


def summarise_nccl(result: NcclResult) -> TestSummary:
    """An nccl-tests result in bytes/s, each row the faster of out-of-place and in-place."""
    rows = []
    for row in result.rows:
        best = row.best()
        rows.append(
            BandwidthRow(
                size_bytes=row.size_bytes,
                time_us=best.time_us,
                algbw_bytes_per_s=best.algbw_gb_per_s * GB,
                busbw_bytes_per_s=best.busbw_gb_per_s * GB,
            )
        )
    return summarise(result.test, result.num_ranks, rows, result.avg_busbw_gb_per_s * GB)


def bandwidth_row(test: str, size_bytes: int, time_s: float, num_ranks: int) -> BandwidthRow:
    """algbw = size / time and busbw = algbw * busbw_factor, as nccl-tests reports them."""
    if time_s <= 0:
        raise CalibrationError(f"{test} at {size_bytes} B: non-positive time {time_s} s")
    algbw = size_bytes / time_s
    return BandwidthRow(
        size_bytes=size_bytes,
        time_us=time_s * 1e6,
        algbw_bytes_per_s=algbw,
        busbw_bytes_per_s=algbw * busbw_factor(test, num_ranks),
    )


# --------------------------------------------------------------------------- cluster YAML
@dataclass(frozen=True)
class ClusterBandwidth:
    """What ``configs/clusters/NAME.yaml`` holds."""

    source: str  # nccl-tests | gloo
    measured_at: str  # ISO 8601, UTC
    num_ranks: int | None
    num_nodes: int | None
    gpu: str | None  # device name(s) from nccl-tests; None for gloo
    tests: tuple[TestSummary, ...]

    def peak(self, test: str) -> float | None:
        for summary in self.tests:
            if summary.test == test:
                return summary.peak_busbw_bytes_per_s
        return None

    @property
    def p2p_bytes_per_s(self) -> float | None:
        return self.peak("sendrecv")

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"source": self.source, "measured_at": self.measured_at}
        doc |= {"num_ranks": self.num_ranks, "num_nodes": self.num_nodes, "gpu": self.gpu}
        for test, field in FIELD_OF_TEST.items():
            doc[field] = _round(self.peak(test))
        doc["peak_min_size_bytes"] = PEAK_MIN_SIZE_BYTES
        doc["sizes_bytes"] = sorted({r.size_bytes for s in self.tests for r in s.rows})
        doc["tests"] = {s.test: s.to_dict() for s in self.tests}
        return doc


def cluster_from_nccl(results: Sequence[NcclResult], *, measured_at: datetime) -> ClusterBandwidth:
    if not results:
        raise CalibrationError("no nccl-tests results")
    ranks = [r.num_ranks for r in results if r.num_ranks]
    nodes = [r.num_nodes for r in results if r.num_nodes]
    gpus = sorted({g for r in results for g in r.gpu_names})
    return ClusterBandwidth(
        source="nccl-tests",
        measured_at=iso_time(measured_at),
        num_ranks=max(ranks) if ranks else None,
        num_nodes=max(nodes) if nodes else None,
        gpu=", ".join(gpus) or None,
        tests=tuple(summarise_nccl(r) for r in results),
    )


NTASKS_FILE = "ntasks"  # slurm/nccl-tests.sh run: the tasks srun started for each test


def _ntasks(path: Path) -> int | None:
    """The task count ``slurm/nccl-tests.sh run`` recorded (None: not recorded)."""
    if not path.exists():
        return None
    text = read_user_text(path).strip()
    if not text.isdigit():
        raise ConfigError(f"{path}: {text!r} is not a task count; delete the file or fix it")
    return int(text)


def read_nccl_dir(directory: str | Path) -> list[NcclResult]:
    """Parse every ``*_perf*.txt`` / ``*_perf*.out`` in ``directory`` (as
    ``slurm/nccl-tests.sh run`` writes them); the file name names the test."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"--nccl-dir {directory}: no such directory")
    files = sorted(
        p for p in directory.iterdir() if "_perf" in p.name and p.suffix in (".txt", ".out")
    )
    if not files:
        raise ConfigError(
            f"--nccl-dir {directory}: no <test>_perf.txt files; run slurm/nccl-tests.sh run "
            "inside an allocation first"
        )
    expected = _ntasks(directory / NTASKS_FILE)
    results = [
        parse_nccl_tests(read_user_text(p), test=p.stem, where=str(p), expected_ranks=expected)
        for p in files
    ]
    seen: dict[str, Path] = {}
    for path, result in zip(files, results, strict=True):
        if result.test in seen:
            raise ConfigError(f"{path} and {seen[result.test]} both hold {result.test}")
        seen[result.test] = path
    return results


def iso_time(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


def cluster_yaml_text(cluster: ClusterBandwidth, *, command: str) -> str:
    """The cluster bandwidth file: a comment saying how it was made, then the fields."""
    header = (
        "# Cluster bandwidth, measured by `pearl-hpc calibrate` (docs/simulator.md: Cluster\n"
        "# bandwidth). Regenerate rather than edit.\n"
        f"# command: {command}\n"
        "# Fields in bytes/s: p2p = sendrecv busbw (= algbw), allreduce = all_reduce busbw\n"
        "# (algbw * 2(n-1)/n), broadcast = broadcast busbw (= algbw); each the max over\n"
        "# sizes >= peak_min_size_bytes (or the largest size measured). null = not measured.\n"
    )
    body: str = yaml.safe_dump(
        cluster.to_dict(), sort_keys=False, default_flow_style=None, width=100
    )
    return header + body


_SCALAR_LINE = r"^(?P<head>{key}[ \t]*:[ \t]*)(?P<value>[^#\n]*?)(?P<gap>[ \t]*)(?P<note>#.*)?$"


def profile_with_transfer(text: str, bytes_per_s: float, *, note: str, where: str) -> str:
    """``text`` (a workload profile) with its top-level ``transfer_bytes_per_s`` set to
    ``bytes_per_s`` and that line's comment replaced by ``note``; every other line kept.

    Checks that the result still loads as a profile and differs from the input in that
    key only."""
    key = "transfer_bytes_per_s"
    if not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
        raise CalibrationError(f"{where}: {key} must be a positive number, got {bytes_per_s}")
    before = profile_mapping(text, where)
    pattern = re.compile(_SCALAR_LINE.format(key=re.escape(key)), re.MULTILINE)
    found = pattern.findall(text)
    if len(found) != 1:
        raise CalibrationError(
            f"{where}: expected one top-level '{key}:' line, found {len(found)}; "
            "write the value by hand"
        )
    value = f"{bytes_per_s:.4e}"  # a dot and an exponent sign: YAML reads it as a float

    def replace(match: re.Match[str]) -> str:
        head, old, gap = match.group("head"), match.group("value"), match.group("gap")
        width = len(old) + len(gap) if match.group("note") else len(value) + 2
        return f"{head}{value}{' ' * max(2, width - len(value))}# {note}"

    result = pattern.sub(replace, text)
    after = profile_mapping(result, where)
    if {k: v for k, v in after.items() if k != key} != {
        k: v for k, v in before.items() if k != key
    } or after.get(key) != float(value):
        raise CalibrationError(f"{where}: rewriting {key} changed other keys; edit it by hand")
    WorkloadProfile.from_dict(after, where=where)
    return result


def profile_mapping(text: str, where: str) -> dict[str, Any]:
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: malformed YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of profile keys")
    WorkloadProfile.from_dict(data, where=where)  # refuse to copy an invalid profile
    return data


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (temporary file + rename), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def default_profile_out(profile: Path, cluster_out: Path) -> Path:
    """``configs/profiles/qwen3-8b-h800-tp2.yaml`` + ``configs/clusters/mine-bandwidth.yaml``
    -> ``configs/profiles/qwen3-8b-h800-tp2-mine.yaml`` (loadable by name)."""
    return profile.with_name(f"{profile.stem}-{cluster_out.stem.removesuffix('-bandwidth')}.yaml")


def check_out_path(out: Path) -> None:
    """Refuse to overwrite a file that is not a bandwidth file written here (a cluster
    config shares ``configs/clusters/``)."""
    if not out.exists():
        return
    try:
        data = parse_yaml(out.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None
    if not (isinstance(data, dict) and data.get("source") in SOURCES and "p2p_bytes_per_s" in data):
        raise ConfigError(
            f"--out {out}: exists and is not a bandwidth file (a cluster config?); choose "
            f"another path, e.g. {out.with_name(out.stem + '-bandwidth.yaml')}"
        )
