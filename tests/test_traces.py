"""Availability traces: parsing the Bamboo CSVs, windows, PEARL's segments, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearl_hpc.config.traces import (
    SEGMENTS,
    TRACE_1C,
    TRACE_1D,
    TRACE_FILES,
    AvailabilityTrace,
    Segment,
    TraceError,
    find_windows,
    load_packaged_trace,
    load_segment,
    load_trace,
    parse_trace,
    select_window,
    trace_path,
)
from pearl_hpc.errors import PearlError

DATA = Path(__file__).resolve().parent.parent / "pearl_hpc" / "data" / "traces"
TARGETS = {1: 13.6, 2: 9.0, 3: 11.8}


def _raw_rows(path: Path) -> list[tuple[int, int]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            t, c = line.split(",")
            rows.append((int(t), int(c)))
    return rows


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text(text)
    return p


# -- the real files ------------------------------------------------------------------


@pytest.mark.parametrize("name", TRACE_FILES)
def test_packaged_files_exist_next_to_readme(name: str) -> None:
    assert (DATA / name).is_file()
    assert trace_path(name).read_bytes() == (DATA / name).read_bytes()
    assert (DATA / "README.md").is_file()


@pytest.mark.parametrize(
    ("name", "rows", "points", "changes", "last_t", "last_count"),
    [(TRACE_1C, 113, 57, 56, 88194, 7), (TRACE_1D, 67, 34, 33, 45668, 8)],
)
def test_parse_real_files(
    name: str, rows: int, points: int, changes: int, last_t: int, last_count: int
) -> None:
    assert len(_raw_rows(DATA / name)) == rows
    tr = load_trace(DATA / name)
    assert tr.name == Path(name).stem
    assert len(tr.times_s) == points
    assert tr.times_s[0] == 0.0 and tr.counts[0] == 0
    assert tr.num_changes == changes
    assert tr.duration_s == last_t
    assert tr.counts[-1] == last_count
    assert all(0 <= c <= 12 for c in tr.counts)  # capped at 12 instances
    assert all(b > a for a, b in zip(tr.times_s, tr.times_s[1:], strict=False))


def test_real_file_known_values() -> None:
    tr = load_trace(DATA / TRACE_1C)
    assert tr.count_at(0) == 0
    assert tr.count_at(21528.9) == 0
    assert tr.count_at(21529) == 4
    assert tr.count_at(21556) == 12
    assert tr.count_at(21637) == 5
    assert tr.changes()[:3] == [(21529.0, 0, 4), (21556.0, 4, 12), (21637.0, 12, 5)]
    assert tr.mean(4) == pytest.approx(tr.mean() + 4)


@pytest.mark.parametrize("name", TRACE_FILES)
def test_pair_format(name: str) -> None:
    """Rows come in (old, new) pairs at each change: the old value repeats the count in
    force, and the parsed step function keeps only the new value."""
    rows = _raw_rows(DATA / name)
    tr = load_trace(DATA / name)
    assert rows[0] == (0, 0)
    pairs = rows[1:]
    assert len(pairs) % 2 == 0
    previous = rows[0][1]
    for (t_old, old), (t_new, new) in zip(pairs[::2], pairs[1::2], strict=True):
        assert t_old == t_new
        assert old == previous
        assert old != new
        assert tr.count_at(t_new) == new
        assert tr.count_at(t_new - 1e-6) == old
        previous = new
    assert [(t, o, n) for t, o, n in tr.changes()] == [
        (float(t), o, n) for (t, o), (_, n) in zip(pairs[::2], pairs[1::2], strict=True)
    ]


def test_pair_format_dedup_keeps_last_row_at_a_time() -> None:
    tr = parse_trace("0,0\n10,0\n10,3\n10,5\n20,5\n20,2\n")
    assert tr.times_s == (0.0, 10.0, 20.0)
    assert tr.counts == (0, 5, 2)
    assert tr.changes() == [(10.0, 0, 5), (20.0, 5, 2)]


def test_parser_tolerates_blanks_and_spaces(tmp_path: Path) -> None:
    tr = load_trace(_write(tmp_path, "\n 0 , 1 \n\n  5,3\r\n5 ,4\n\n12,4\n   \n"))
    assert tr.times_s == (0.0, 5.0, 12.0)
    assert tr.counts == (1, 4, 4)
    assert tr.num_changes == 1


# -- step-function semantics ------------------------------------------------------------


@pytest.fixture
def small() -> AvailabilityTrace:
    return AvailabilityTrace("small", (0.0, 10.0, 30.0, 60.0), (2, 5, 1, 1))


def test_count_at_is_right_continuous(small: AvailabilityTrace) -> None:
    assert small.count_at(0) == 2
    assert small.count_at(9.999) == 2
    assert small.count_at(10) == 5  # the change applies at its own time
    assert small.count_at(29.999) == 5
    assert small.count_at(30) == 1
    assert small.count_at(60) == 1
    assert small.count_at(1e9) == 1  # the last count holds
    with pytest.raises(TraceError):
        small.count_at(-0.5)


def test_mean_changes_duration(small: AvailabilityTrace) -> None:
    assert small.duration_s == 60
    assert small.mean() == pytest.approx((2 * 10 + 5 * 20 + 1 * 30) / 60)
    assert small.mean(reserved=4) == pytest.approx(small.mean() + 4)
    assert small.changes() == [(10.0, 2, 5), (30.0, 5, 1)]  # 60 keeps the count
    assert small.num_changes == 2
    assert small.changes_per_hour == pytest.approx(2 * 3600 / 60)
    single = AvailabilityTrace("one", (0.0,), (3,))
    assert single.mean(4) == 7 and single.duration_s == 0 and single.changes_per_hour == 0


def test_window_rebases(small: AvailabilityTrace) -> None:
    w = small.window(5, 40)
    assert w.times_s == (0.0, 5.0, 25.0, 40.0)
    assert w.counts == (2, 5, 1, 1)
    assert w.duration_s == 40
    assert w.mean() == pytest.approx((2 * 5 + 5 * 20 + 1 * 15) / 40)
    assert w.changes() == [(5.0, 2, 5), (25.0, 5, 1)]
    for t in (0, 4.9, 5, 24.9, 25, 39.9):
        assert w.count_at(t) == small.count_at(t + 5)


def test_scaled_counts_round_down(small: AvailabilityTrace) -> None:
    big = small.scaled(42.5)
    assert big.times_s == small.times_s and big.name == "smallx42.5"
    assert big.counts == (85, 212, 42, 42)
    assert small.scaled(1) is small
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TraceError, match="positive"):
            small.scaled(bad)


def test_window_boundaries(small: AvailabilityTrace) -> None:
    # starting on a change: the first point carries the new value, no change at 0
    w = small.window(10, 20)
    assert w.times_s == (0.0, 20.0)
    assert w.counts == (5, 5)
    assert w.num_changes == 0
    assert w.mean() == 5
    # a change exactly at the window's end is outside [start, end)
    w2 = small.window(0, 30)
    assert w2.counts[-1] == 5
    assert w2.changes() == [(10.0, 2, 5)]
    assert w2.mean() == pytest.approx((2 * 10 + 5 * 20) / 30)
    # the whole trace
    whole = small.window(0, 60)
    assert whole.mean() == pytest.approx(small.mean())
    assert whole.changes() == small.changes()


@pytest.mark.parametrize(("start", "duration"), [(-1, 10), (55, 10), (0, 61), (70, 5)])
def test_window_outside_trace_raises(
    small: AvailabilityTrace, start: float, duration: float
) -> None:
    with pytest.raises(TraceError, match="not inside the trace"):
        small.window(start, duration)


@pytest.mark.parametrize("duration", [0, -5, float("nan")])
def test_window_bad_duration_raises(small: AvailabilityTrace, duration: float) -> None:
    with pytest.raises(TraceError):
        small.window(0, duration)


def test_real_window_outside_raises() -> None:
    tr = load_packaged_trace(TRACE_1D)
    with pytest.raises(TraceError, match="not inside"):
        tr.window(45668 - 7199, 7200)
    tr.window(45668 - 7200, 7200)  # ends on the last point: fine


def test_invalid_trace_objects() -> None:
    with pytest.raises(TraceError):
        AvailabilityTrace("x", (), ())
    with pytest.raises(TraceError):
        AvailabilityTrace("x", (0.0, 1.0), (1,))
    with pytest.raises(TraceError):
        AvailabilityTrace("x", (0.0, 0.0), (1, 2))
    with pytest.raises(TraceError):
        AvailabilityTrace("x", (0.0,), (-1,))


# -- malformed files ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("0,0\n10,1,2\n", 2, "2 comma-separated columns"),
        ("0,0\n5\n", 2, "2 comma-separated columns"),
        ("seconds,instances\n0,0\n", 1, "non-numeric"),
        ("0,0\n\n10,abc\n", 3, "non-numeric"),
        ("0,0\n10,-1\n", 2, "negative instance count"),
        ("-3,0\n", 1, "negative time"),
        ("0,0\n10,2\n10,3\n7,3\n", 4, "time goes backwards"),
        ("0,0\n10,2.5\n", 2, "whole number"),
        ("0,0\n10,inf\n", 2, "non-finite"),
        ("", 1, "empty trace"),
        ("\n  \n\n", 3, "empty trace"),
    ],
)
def test_malformed_files_raise_with_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(TraceError, match=words) as info:
        load_trace(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}:{line}:")
    assert isinstance(info.value, PearlError)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


# -- PEARL's segments ------------------------------------------------------------------


def test_segments_table() -> None:
    assert set(SEGMENTS) == {1, 2, 3}
    for n, seg in SEGMENTS.items():
        assert isinstance(seg, Segment)
        assert seg.trace_file in TRACE_FILES
        assert seg.duration_s == 7200
        assert seg.target_mean == TARGETS[n]
        assert seg.description


@pytest.mark.parametrize(
    ("n", "mean", "changes"), [(1, 13.600, 17), (2, 9.017, 15), (3, 11.628, 14)]
)
def test_segment_mean_and_changes(n: int, mean: float, changes: int) -> None:
    w = load_segment(n)
    assert w.name == f"segment{n}"
    assert w.times_s[0] == 0 and w.duration_s == 7200
    assert abs(w.mean(reserved=4) - TARGETS[n]) <= 0.3
    assert w.mean(reserved=4) == pytest.approx(mean, abs=5e-4)
    assert w.num_changes == changes
    assert w.changes_per_hour == pytest.approx(changes / 2)
    assert len(set(w.counts)) > 1  # neither all zeros nor constant
    assert max(w.counts) <= 12


def test_segment_change_character() -> None:
    c = {n: load_segment(n).num_changes for n in SEGMENTS}
    assert c[3] < c[1] and c[3] < c[2]  # segment 3: fewer changes
    assert min(load_segment(2).counts) == 0  # segment 2: scarce, lead-in without spot GPUs
    assert load_segment(2).mean(4) < load_segment(3).mean(4) < load_segment(1).mean(4)


def test_segment_matches_its_window() -> None:
    for seg_n, seg in SEGMENTS.items():
        w = load_packaged_trace(seg.trace_file).window(seg.start_s, seg.duration_s)
        assert load_segment(seg_n).counts == w.counts
        assert load_segment(seg_n).times_s == w.times_s


def test_segments_reproduce_the_search() -> None:
    traces = {name: load_packaged_trace(name) for name in TRACE_FILES}
    for n, many in ((1, True), (2, True), (3, False)):
        key, cand = select_window(traces, TARGETS[n], many_changes=many)
        assert (key, cand.start_s) == (SEGMENTS[n].trace_file, SEGMENTS[n].start_s)


def test_unknown_segment_raises() -> None:
    with pytest.raises(TraceError, match="unknown segment"):
        load_segment(4)


# -- the search ----------------------------------------------------------------------------


def test_find_windows_sorting_and_filtering() -> None:
    tr = load_packaged_trace(TRACE_1C)
    cands = find_windows(tr, 9.0)
    assert cands, "some window must match"
    keys = [(c.error, -c.changes_per_hour) for c in cands]
    assert keys == sorted(keys)
    assert all(c.num_changes > 0 for c in cands)  # the all-zero lead-in is dropped
    assert all(c.start_s % 60 == 0 and c.start_s + 7200 <= tr.end_s for c in cands)
    best = cands[0]
    assert best.error == pytest.approx(abs(best.mean - 9.0))
    assert tr.window(best.start_s, 7200).mean(4) == pytest.approx(best.mean)


def test_find_windows_prefers_change_rate_on_ties() -> None:
    # windows of 40 s on an 80 s grid, all with mean 2 (+4 reserved = 6):
    # start 0: 1 then 3 (one change); start 80: 2, 1, 3 (two changes); start 160: flat 2
    tr = AvailabilityTrace(
        "u", (0.0, 20.0, 40.0, 100.0, 110.0, 160.0, 200.0), (1, 3, 2, 1, 3, 2, 2)
    )
    many = find_windows(tr, 6.0, duration_s=40, step_s=80)
    assert [c.start_s for c in many] == [80.0, 0.0]  # the flat window is dropped
    assert [c.num_changes for c in many] == [2, 1]
    assert all(c.error == pytest.approx(0) for c in many)
    fewer = find_windows(tr, 6.0, duration_s=40, step_s=80, prefer_many_changes=False)
    assert [c.start_s for c in fewer] == [0.0, 80.0]


def test_select_window_no_match_raises() -> None:
    tr = load_packaged_trace(TRACE_1D)
    with pytest.raises(TraceError, match="no 7200 s window"):
        select_window({"d": tr}, 40.0)
