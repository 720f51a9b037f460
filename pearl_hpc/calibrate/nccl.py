"""nccl-tests output: the parser and the bus-bandwidth formula (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pearl_hpc.errors import CalibrationError

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


_SEPARATE_TESTS = (
    ": every task ran a 1-rank test of its own (srun's --mpi plugin does not match the MPI "
    "nccl-tests was built with; `srun --mpi=list` shows the plugins, PEARL_SRUN_MPI sets it)"
)


def _check_ranks(num_ranks: int | None, expected: int | None, where: str) -> None:
    """A bandwidth needs two ranks or more, and all the tasks srun started in one test."""
    if num_ranks is not None and num_ranks < 2:
        raise CalibrationError(
            f"{where}: the test ran on {num_ranks} rank: a bandwidth needs 2 or more (srun "
            "--ntasks >= 2, one task per GPU)"
        )
    if expected is not None and num_ranks is not None and num_ranks != expected:
        raise CalibrationError(
            f"{where}: the test ran on {num_ranks} ranks, srun started {expected} tasks"
            + _SEPARATE_TESTS
        )


def _check_data(
    rows: list[NcclRow], out_of_bounds: tuple[int, str] | None, avg: float | None, where: str
) -> float:
    """The parsed rows and footer are a finished, correct run; its average bus bandwidth."""
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
    return avg


def parse_nccl_tests(
    text: str,
    *,
    test: str | None = None,
    where: str = "nccl-tests output",
    expected_ranks: int | None = None,
) -> NcclResult:
    """Parse the stdout of one nccl-tests binary (any version since the 2.x series).

    The column header (``size count type [redop] [root] time algbw busbw #wrong ...``)
    says where each field is, so versions without redop/root, with ``cputime``, with
    per-iteration or timestamp columns parse alike. Lines that are not ``#`` comments and
    do not start with a size (NCCL INFO/WARN lines) are skipped; an ``srun --label``
    prefix is removed. ``test`` names the test where the output does not ("# Collective
    test starting:" arrived in 2.14); the output's own name wins.

    Raises :class:`CalibrationError` on output with no data rows, without the footer (the
    run did not finish), with ``#wrong`` > 0 in any row or out-of-bounds values > 0, and
    on a run that was not one test over several ranks: a rank id listed twice or a second
    ``# nThread`` header (each task ran a 1-rank test of its own: what an ``srun --mpi``
    plugin that does not match the MPI gives), fewer than 2 ranks, or a rank count other
    than ``expected_ranks`` (the tasks srun started).
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
                raise CalibrationError(
                    f"{here}: a second test starts; give one test per file (or, if "
                    f"{_SEPARATE_TESTS.removeprefix(': ')})"
                )
            if threads_x_gpus is not None:
                raise CalibrationError(f"{here}: a second '# nThread' header{_SEPARATE_TESTS}")
            threads_x_gpus = int(match.group(1)) * int(match.group(2))
        elif match := _RANK_RE.match(line):
            rank = int(match.group(1))
            if rank in ranks:
                raise CalibrationError(f"{here}: rank {rank} is listed twice{_SEPARATE_TESTS}")
            ranks[rank] = (match.group(2), match.group(3).strip())
        elif match := _AVG_RE.match(line):
            avg = _number(match.group(1), "Avg bus bandwidth", here)
        elif match := _OOB_RE.match(line):
            out_of_bounds = (int(match.group(1)), match.group(2))

    avg = _check_data(rows, out_of_bounds, avg, where)
    name = named or test
    if not name:
        raise CalibrationError(f"{where}: the output does not name its test; pass test=...")
    num_ranks = len(ranks) if ranks else threads_x_gpus
    _check_ranks(num_ranks, expected_ranks, where)
    return NcclResult(
        test=normalise_test_name(name),
        num_ranks=num_ranks,
        num_nodes=len({host for host, _ in ranks.values()}) or None,
        gpu_names=tuple(sorted({gpu for _, gpu in ranks.values() if gpu})),
        rows=tuple(rows),
        avg_busbw_gb_per_s=avg,
        num_out_of_bounds=0 if out_of_bounds is None else out_of_bounds[0],
    )
