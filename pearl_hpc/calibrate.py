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

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.errors import CalibrationError, ConfigError

MiB = 1 << 20
SOURCES = ("nccl-tests", "gloo")  # the values of a bandwidth file's `source`
GB = 1e9  # nccl-tests' "GB/s" is 1e9 bytes/s
# Peak figures are read at sizes where latency no longer matters: the max busbw over
# rows of at least this size (or over the largest size, if the run stopped below it).
PEAK_MIN_SIZE_BYTES = 64 * MiB

# The collectives whose bus bandwidth is algbw * k * (n-1)/n (nccl-tests' PERFORMANCE.md);
# every other test moves each byte over one link: busbw = algbw.
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "alltoall": 1}
_ONE_LINK = ("sendrecv", "broadcast", "reduce", "gather", "scatter", "hypercube")

# The cluster-YAML field each test feeds.
FIELD_OF_TEST = {
    "sendrecv": "p2p_bytes_per_s",
    "all_reduce": "allreduce_busbw_bytes_per_s",
    "broadcast": "broadcast_bytes_per_s",
}


def busbw_factor(test: str, num_ranks: int) -> float:
    """busbw / algbw for ``test`` on ``num_ranks`` ranks, as nccl-tests computes it."""
    if num_ranks < 1:
        raise CalibrationError(f"num_ranks must be >= 1, got {num_ranks}")
    if test in _RING_FACTOR:
        return _RING_FACTOR[test] * (num_ranks - 1) / num_ranks
    if test in _ONE_LINK:
        return 1.0
    known = ", ".join(sorted([*_RING_FACTOR, *_ONE_LINK]))
    raise CalibrationError(f"no bus-bandwidth rule for test {test!r}; known: {known}")


def normalise_test_name(name: str) -> str:
    """``/x/build/all_reduce_perf_mpi`` -> ``all_reduce``."""
    stem = Path(name).name
    for suffix in (".txt", ".out", ".log", "_mpi", "_perf"):
        stem = stem.removesuffix(suffix)
    return stem


# --------------------------------------------------------------------------- parser
@dataclass(frozen=True)
class NcclMeasure:
    """One half (out-of-place or in-place) of an nccl-tests data row."""

    time_us: float  # mean time of one operation
    algbw_gb_per_s: float  # bytes / time, 1e9 bytes/s
    busbw_gb_per_s: float  # algbw * the test's bus factor
    num_wrong: int | None  # wrong elements; None for N/A (-c 0) or the legacy error column


@dataclass(frozen=True)
class NcclRow:
    """One data row: a message size and its out-of-place and in-place measurements."""

    size_bytes: int
    count: int  # elements
    dtype: str
    redop: str | None  # None where this version prints no redop column
    root: int | None  # None where this version prints no root column
    out_of_place: NcclMeasure
    in_place: NcclMeasure | None  # None where the header has one block only

    def best(self) -> NcclMeasure:
        """The faster half (out-of-place on a tie)."""
        if self.in_place is not None and self.in_place.busbw_gb_per_s > (
            self.out_of_place.busbw_gb_per_s
        ):
            return self.in_place
        return self.out_of_place


@dataclass(frozen=True)
class NcclResult:
    """One nccl-tests run (one ``*_perf`` binary), parsed."""

    test: str  # all_reduce, sendrecv, ... (without _perf)
    num_ranks: int | None  # from the "# Rank" lines, else nThread * nGpus, else None
    num_nodes: int | None  # distinct hosts in the "# Rank" lines
    gpu_names: tuple[str, ...]  # distinct device names in the "# Rank" lines
    rows: tuple[NcclRow, ...]
    avg_busbw_gb_per_s: float  # the footer "# Avg bus bandwidth"
    num_out_of_bounds: int  # the footer "# Out of bounds values"


_LABEL_RE = re.compile(r"^\s*\d+:\s")  # srun --label prefix
_TEST_RE = re.compile(r"^#\s*Collective test (?:starting|concluded):\s*(\S+)")
_THREADS_RE = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
_RANK_RE = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+"
    r"\s+\[[^\]]*\]\s*(.*)$"
)
_AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(\w*)")
_TIME_COLUMNS = ("time", "cputime")
_WRONG_COLUMNS = ("#wrong", "error")


@dataclass
class _Layout:
    """Where the fields of a data row are, read from the column header."""

    lead: list[str]  # size, count, type[, redop][, root]
    blocks: list[int]  # index of each time column (out-of-place, then in-place)
    wrong: list[str | None]  # the name of each block's error column, if any
    width: int  # tokens a full row has (trailing timestamp tokens are ignored)

    @classmethod
    def from_header(cls, columns: list[str]) -> _Layout:
        blocks = [i for i, c in enumerate(columns) if c in _TIME_COLUMNS][:2]
        wrong = [
            columns[b + 3] if b + 3 < len(columns) and columns[b + 3] in _WRONG_COLUMNS else None
            for b in blocks
        ]
        last = blocks[-1] + (4 if wrong[-1] else 3)
        return cls(lead=columns[: blocks[0]], blocks=blocks, wrong=wrong, width=last)


def _is_header(columns: list[str]) -> bool:
    return "size" in columns and "count" in columns and any(c in columns for c in _TIME_COLUMNS)


def _number(token: str, what: str, where: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise CalibrationError(f"{where}: {what} {token!r} is not a number") from None


def _measure(tokens: list[str], start: int, wrong: str | None, where: str) -> NcclMeasure:
    num_wrong: int | None = None
    if wrong == "#wrong" and tokens[start + 3] != "N/A":
        num_wrong = int(_number(tokens[start + 3], "#wrong", where))
    return NcclMeasure(
        time_us=_number(tokens[start], "time", where),
        algbw_gb_per_s=_number(tokens[start + 1], "algbw", where),
        busbw_gb_per_s=_number(tokens[start + 2], "busbw", where),
        num_wrong=num_wrong,
    )


def _row(tokens: list[str], layout: _Layout, where: str) -> NcclRow:
    if len(tokens) < layout.width:
        raise CalibrationError(
            f"{where}: a data row has {len(tokens)} fields, the column header needs "
            f"{layout.width}: is the output truncated or from a mixed version?"
        )
    lead = dict(zip(layout.lead, tokens, strict=False))
    measures = [
        _measure(tokens, b, w, where) for b, w in zip(layout.blocks, layout.wrong, strict=True)
    ]
    return NcclRow(
        size_bytes=int(_number(lead["size"], "size", where)),
        count=int(_number(lead["count"], "count", where)),
        dtype=lead.get("type", ""),
        redop=lead.get("redop"),
        root=int(lead["root"]) if "root" in lead else None,
        out_of_place=measures[0],
        in_place=measures[1] if len(measures) > 1 else None,
    )


def parse_nccl_tests(
    text: str, *, test: str | None = None, where: str = "nccl-tests output"
) -> NcclResult:
    """Parse the stdout of one nccl-tests binary (any version since the 2.x series).

    The column header (``size count type [redop] [root] time algbw busbw #wrong ...``)
    says where each field is, so versions without redop/root, with ``cputime``, with
    per-iteration or timestamp columns parse alike. Lines that are not ``#`` comments and
    do not start with a size (NCCL INFO/WARN lines) are skipped; an ``srun --label``
    prefix is removed. ``test`` names the test where the output does not ("# Collective
    test starting:" arrived in 2.14); the output's own name wins.

    Raises :class:`CalibrationError` on output with no data rows, without the footer (the
    run did not finish), with ``#wrong`` > 0 in any row or out-of-bounds values > 0.
    """
    layout: _Layout | None = None
    rows: list[NcclRow] = []
    ranks: dict[int, tuple[str, str]] = {}
    threads_x_gpus: int | None = None
    named: str | None = None
    avg: float | None = None
    out_of_bounds: tuple[int, str] | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _LABEL_RE.sub("", raw, count=1).strip()
        here = f"{where}, line {lineno}"
        if not line:
            continue
        if not line.startswith("#"):
            tokens = line.split()
            if not tokens[0].isdigit():
                continue  # NCCL INFO / WARN and other chatter
            if layout is None:
                raise CalibrationError(f"{here}: a data row before the column header")
            rows.append(_row(tokens, layout, here))
            continue
        columns = line.lstrip("#").split()
        if _is_header(columns):
            layout = _Layout.from_header(columns)
        elif match := _TEST_RE.match(line):
            named = match.group(1)
        elif match := _THREADS_RE.match(line):
            if rows:
                raise CalibrationError(f"{here}: a second test starts; give one test per file")
            threads_x_gpus = int(match.group(1)) * int(match.group(2))
        elif match := _RANK_RE.match(line):
            ranks[int(match.group(1))] = (match.group(2), match.group(3).strip())
        elif match := _AVG_RE.match(line):
            avg = _number(match.group(1), "Avg bus bandwidth", here)
        elif match := _OOB_RE.match(line):
            out_of_bounds = (int(match.group(1)), match.group(2))

    if not rows:
        raise CalibrationError(
            f"{where}: no data rows (lines starting with a size in bytes); is this the "
            "stdout of an nccl-tests *_perf binary, and did it start?"
        )
    wrong = [r.size_bytes for r in rows for m in (r.out_of_place, r.in_place) if m and m.num_wrong]
    if wrong:
        sizes = ", ".join(str(s) for s in sorted(set(wrong)))
        raise CalibrationError(
            f"{where}: nccl-tests found wrong values (#wrong > 0) at sizes {sizes} B: the "
            "collective corrupted data; fix the GPUs/fabric/NCCL setup before calibrating"
        )
    if out_of_bounds is not None and (out_of_bounds[0] > 0 or out_of_bounds[1] == "FAILED"):
        raise CalibrationError(
            f"{where}: '# Out of bounds values : {out_of_bounds[0]} {out_of_bounds[1]}': "
            "the collective returned wrong data; fix the setup before calibrating"
        )
    if avg is None:
        raise CalibrationError(
            f"{where}: the output ends before the '# Avg bus bandwidth' footer: the test "
            "did not finish (see its stderr)"
        )
    name = named or test
    if not name:
        raise CalibrationError(f"{where}: the output does not name its test; pass test=...")
    num_ranks = len(ranks) if ranks else threads_x_gpus
    return NcclResult(
        test=normalise_test_name(name),
        num_ranks=num_ranks,
        num_nodes=len({host for host, _ in ranks.values()}) or None,
        gpu_names=tuple(sorted({gpu for _, gpu in ranks.values() if gpu})),
        rows=tuple(rows),
        avg_busbw_gb_per_s=avg,
        num_out_of_bounds=0 if out_of_bounds is None else out_of_bounds[0],
    )


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
        measured_at=_iso(measured_at),
        num_ranks=max(ranks) if ranks else None,
        num_nodes=max(nodes) if nodes else None,
        gpu=", ".join(gpus) or None,
        tests=tuple(summarise_nccl(r) for r in results),
    )


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
    results = [parse_nccl_tests(p.read_text(), test=p.stem, where=str(p)) for p in files]
    seen: dict[str, Path] = {}
    for path, result in zip(files, results, strict=True):
        if result.test in seen:
            raise ConfigError(f"{path} and {seen[result.test]} both hold {result.test}")
        seen[result.test] = path
    return results


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


def cluster_yaml_text(cluster: ClusterBandwidth, *, command: str) -> str:
    """The cluster bandwidth file: a comment saying how it was made, then the fields."""
    header = (
        "# Cluster bandwidth, measured by `pearl-hpc calibrate` (README: Calibrate the\n"
        "# cluster). Regenerate rather than edit.\n"
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
    before = _profile_mapping(text, where)
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
    after = _profile_mapping(result, where)
    if {k: v for k, v in after.items() if k != key} != {
        k: v for k, v in before.items() if k != key
    } or after.get(key) != float(value):
        raise CalibrationError(f"{where}: rewriting {key} changed other keys; edit it by hand")
    WorkloadProfile.from_dict(after, where=where)
    return result


def _profile_mapping(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
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
        data = yaml.safe_load(out.read_text())
    except (OSError, yaml.YAMLError):
        data = None
    if not (isinstance(data, dict) and data.get("source") in SOURCES and "p2p_bytes_per_s" in data):
        raise ConfigError(
            f"--out {out}: exists and is not a bandwidth file (a cluster config?); choose "
            f"another path, e.g. {out.with_name(out.stem + '-bandwidth.yaml')}"
        )


# --------------------------------------------------------------------------- gloo
GLOO_TESTS = ("sendrecv", "broadcast", "all_reduce")
# Iterations per size: enough to move ~this many bytes, within [3, 20].
_GLOO_BYTES_PER_SIZE = 64 * MiB
_GLOO_ITERS = (3, 20)


def gloo_sizes(max_size_bytes: int, *, min_size_bytes: int = MiB, factor: int = 4) -> list[int]:
    """min, min*factor, ... up to max (inclusive if it falls on the grid)."""
    if not 0 < min_size_bytes <= max_size_bytes:
        raise ConfigError(
            f"sizes: need 0 < min ({min_size_bytes} B) <= max ({max_size_bytes} B); "
            "raise --max-size-mib"
        )
    sizes = [min_size_bytes]
    while sizes[-1] * factor <= max_size_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def gloo_iterations(size_bytes: int) -> int:
    low, high = _GLOO_ITERS
    return max(low, min(high, math.ceil(_GLOO_BYTES_PER_SIZE / size_bytes)))


def run_gloo_rank(
    rank: int,
    world_size: int,
    init_method: str,
    sizes_bytes: Sequence[int],
    tests: Sequence[str] = GLOO_TESTS,
    timeout_s: float = 120.0,
) -> list[TestSummary]:
    """Join a gloo group and time ``tests`` at ``sizes_bytes``; every rank returns the
    same summaries (each time is the max over ranks, so the slowest rank sets it).

    sendrecv: each rank sends to rank+1 and receives from rank-1 at once (nccl-tests'
    pattern); broadcast from rank 0; all_reduce (sum, float32). One warm-up, a barrier,
    then :func:`gloo_iterations` operations timed together."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    if world_size < 2:
        raise CalibrationError(f"gloo calibration needs >= 2 ranks, got {world_size}")
    unknown = [t for t in tests if t not in GLOO_TESTS]
    if unknown:
        raise ConfigError(f"gloo tests {unknown}: not one of {', '.join(GLOO_TESTS)}")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
    )
    try:
        summaries = []
        for test in tests:
            rows = []
            for size in sizes_bytes:
                send = torch.ones(size // 4, dtype=torch.float32)
                recv = torch.empty_like(send)
                iters = gloo_iterations(size)
                _gloo_op(dist, test, send, recv, rank, world_size)  # warm-up
                dist.barrier()
                started = time.perf_counter()
                for _ in range(iters):
                    _gloo_op(dist, test, send, recv, rank, world_size)
                elapsed = torch.tensor(
                    [(time.perf_counter() - started) / iters], dtype=torch.float64
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                rows.append(bandwidth_row(test, send.numel() * 4, float(elapsed), world_size))
            summaries.append(summarise(test, world_size, rows))
        return summaries
    finally:
        dist.destroy_process_group()


def _gloo_op(dist: Any, test: str, send: Any, recv: Any, rank: int, world_size: int) -> None:
    if test == "sendrecv":
        reqs = [
            dist.isend(send, (rank + 1) % world_size),
            dist.irecv(recv, (rank - 1) % world_size),
        ]
        for req in reqs:
            req.wait()
    elif test == "broadcast":
        dist.broadcast(send, src=0)
    else:
        dist.all_reduce(send)


def cluster_from_gloo(
    summaries: Sequence[TestSummary],
    *,
    num_ranks: int,
    num_nodes: int | None,
    measured_at: datetime,
) -> ClusterBandwidth:
    return ClusterBandwidth(
        source="gloo",
        measured_at=_iso(measured_at),
        num_ranks=num_ranks,
        num_nodes=num_nodes,
        gpu=None,
        tests=tuple(summaries),
    )


def measure_gloo_local(
    num_ranks: int,
    sizes_bytes: Sequence[int],
    tests: Sequence[str] = GLOO_TESTS,
    *,
    timeout_s: float = 120.0,
) -> list[TestSummary]:
    """Start ``num_ranks`` local processes (``python -m pearl_hpc.calibrate``) that meet
    through a file store and measure over loopback; returns rank 0's summaries."""
    if num_ranks < 2:
        raise ConfigError(f"--ranks must be >= 2 for a gloo measurement, got {num_ranks}")
    with tempfile.TemporaryDirectory(prefix="pearl-gloo-") as tmp:
        result = Path(tmp) / "rank0.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
            env["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback, whatever the hostname is
        procs = []
        for rank in range(num_ranks):
            argv = [
                *(sys.executable, "-m", "pearl_hpc.calibrate"),
                *("--rank", str(rank), "--world-size", str(num_ranks)),
                *("--init-method", f"file://{tmp}/store"),
                *("--sizes", ",".join(map(str, sizes_bytes)), "--tests", ",".join(tests)),
                *("--timeout-s", str(timeout_s)),
                *(("--result", str(result)) if rank == 0 else ()),
            ]
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
            procs.append(
                (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            )
        _wait_all(procs, timeout_s + 30)
        return _read_rank_result(result)


def _wait_all(procs: list[tuple[subprocess.Popen[bytes], Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    try:
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} timed out after {timeout_s:.0f} s")
                break
            if code != 0:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-3:])
                failed.append(f"rank {rank} exited with {code}: {tail}")
                break
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        raise CalibrationError(f"gloo measurement failed: {failed[0]}")


def _read_rank_result(path: Path) -> list[TestSummary]:
    doc = json.loads(path.read_text())
    return [
        TestSummary(**{**s, "rows": tuple(BandwidthRow(**r) for r in s["rows"])})
        for s in doc["summaries"]
    ]


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``gpu[03-04,9],cpu1`` -> ``gpu03``."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end])


def srun_rendezvous(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(rank, world size, init method) for a process started by ``srun``: SLURM_PROCID,
    SLURM_NTASKS and tcp://MASTER_ADDR:MASTER_PORT, where MASTER_ADDR defaults to the
    first host of the step and MASTER_PORT to 20000 + SLURM_JOB_ID % 10000."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS") if k not in env]
    if missing:
        raise ConfigError(
            f"--srun: {' and '.join(missing)} not set; start this command with srun "
            "(srun -n N pearl-hpc calibrate --gloo --srun ...)"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    addr = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
    if not addr:
        raise ConfigError("--srun: set MASTER_ADDR (no SLURM_STEP_NODELIST to take it from)")
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
    return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), f"tcp://{addr}:{port}"


def _rank_main(argv: Sequence[str] | None = None) -> int:
    """One local gloo rank (started by :func:`measure_gloo_local`)."""
    parser = argparse.ArgumentParser(prog="python -m pearl_hpc.calibrate")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--sizes", required=True, help="comma list of bytes")
    parser.add_argument("--tests", default=",".join(GLOO_TESTS))
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--result", help="rank 0 writes its summaries here (JSON)")
    args = parser.parse_args(argv)
    summaries = run_gloo_rank(
        args.rank,
        args.world_size,
        args.init_method,
        [int(s) for s in args.sizes.split(",")],
        args.tests.split(","),
        args.timeout_s,
    )
    if args.result:
        doc = {"summaries": [{**asdict(s)} for s in summaries]}
        write_text(args.result, json.dumps(doc))
    return 0


# --------------------------------------------------------------------------- command
def run_calibration(
    *,
    out: Path,
    nccl_dir: Path | None = None,
    gloo_ranks: int = 2,
    srun: bool = False,
    max_size_bytes: int = 64 * MiB,
    timeout_s: float = 120.0,
    profile: Path | None = None,
    profile_out: Path | None = None,
    now: datetime,
    env: Mapping[str, str],
) -> int:
    """``pearl-hpc calibrate``: measure (nccl-tests files or gloo), write the cluster
    YAML and, with ``profile``, a copy of it with the measured ``transfer_bytes_per_s``.
    The profile is checked before anything is measured."""
    check_out_path(out)
    target = None if profile is None else (profile_out or default_profile_out(profile, out))
    if profile is not None and target is not None and target.resolve() == profile.resolve():
        raise ConfigError(f"--profile-out {target}: is the profile itself; give another path")
    profile_text = None
    if profile is not None:
        try:
            profile_text = profile.read_text()
        except OSError as exc:
            raise ConfigError(f"--profile {profile}: cannot read ({exc.strerror})") from None
        _profile_mapping(profile_text, str(profile))
    if nccl_dir is not None:
        cluster = cluster_from_nccl(read_nccl_dir(nccl_dir), measured_at=now)
        command = f"pearl-hpc calibrate --nccl-dir {nccl_dir}"
    else:
        sizes = gloo_sizes(max_size_bytes)
        command = f"pearl-hpc calibrate --gloo --max-size-mib {max_size_bytes / MiB:g}"
        if srun:
            rank, world, init_method = srun_rendezvous(env)
            summaries = run_gloo_rank(rank, world, init_method, sizes, timeout_s=timeout_s)
            if rank != 0:
                return 0  # rank 0 writes and prints
            nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
            command = f"srun -n {world} {command} --srun"
        else:
            summaries = measure_gloo_local(gloo_ranks, sizes, timeout_s=timeout_s)
            world, nodes = gloo_ranks, 1
            command += f" --ranks {gloo_ranks}"
        cluster = cluster_from_gloo(summaries, num_ranks=world, num_nodes=nodes, measured_at=now)
    command += f" --out {out}"
    written = [write_text(out, cluster_yaml_text(cluster, command=command))]
    if target is not None and profile is not None and profile_text is not None:
        p2p = cluster.p2p_bytes_per_s
        if p2p is None:
            raise CalibrationError(
                f"--profile needs a sendrecv measurement for transfer_bytes_per_s; {out} has "
                f"only {', '.join(s.test for s in cluster.tests)}: add sendrecv_perf"
            )
        note = (
            f"BW: {cluster.source} sendrecv, {cluster.num_ranks} ranks, "
            f"{cluster.measured_at[:10]} ({out.name})"
        )
        header = f"# Copy of {profile.name}; transfer_bytes_per_s measured by: {command}\n"
        text = profile_with_transfer(profile_text, p2p, note=note, where=str(profile))
        written.append(write_text(target, header + text))
    print_cluster(cluster, written)
    return 0


# --------------------------------------------------------------------------- output
def format_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


def print_cluster(cluster: ClusterBandwidth, written: Iterable[Path]) -> None:
    """A rich table of every row, then the figures the YAML holds."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    nodes = cluster.num_nodes
    where = f" on {nodes} node{'s' if nodes != 1 else ''}" if nodes else ""
    table = Table(title=f"{cluster.source}: {cluster.num_ranks} ranks{where}")
    for col in ("test", "size", "time us", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for summary in cluster.tests:
        for row in summary.rows:
            peak = "*" if row.size_bytes == summary.peak_size_bytes else ""
            table.add_row(
                summary.test,
                format_size(row.size_bytes),
                f"{row.time_us:.1f}",
                f"{row.algbw_bytes_per_s / GB:.3f}",
                f"{row.busbw_bytes_per_s / GB:.3f}{peak}",
            )
    console.print(table)
    for test, field in FIELD_OF_TEST.items():
        value = cluster.peak(test)
        shown = "not measured" if value is None else f"{value:.4e} ({value / GB:.3f} GB/s)"
        console.print(f"{field}: {shown}")
    for path in written:
        console.print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(_rank_main())
