"""Elastic-capacity traces: how many preemptible rollout GPUs exist over time.

An :class:`AvailabilityTrace` is a right-continuous step function: ``counts[i]`` is in
force from ``times_s[i]`` until ``times_s[i + 1]``; the trace's span ends at its last
time point. :func:`load_trace` reads the Bamboo (NSDI'23) spot-availability CSVs shipped
in ``pearl_hpc/data/traces/`` (see the README there).

PEARL replays three 2-hour segments of these traces; :data:`SEGMENTS` names the windows
chosen by :func:`select_window` (built on :func:`find_windows`, 60 s start grid, over both
files). Means include the 4 reserved rollout GPUs:

=======  ==========  ========  ======  ======  =======  ======  ========
segment  file        start_s   target  mean    changes  per h   pool
=======  ==========  ========  ======  ======  =======  ======  ========
1        us-east-1d  37380     13.6    13.600  17       8.5     7-16
2        us-east-1c  18960     9.0     9.017   15       7.5     4-16
3        us-east-1d  35520     11.8    11.628  14       7.0     7-16
=======  ==========  ========  ======  ======  =======  ======  ========

Caveats: segment 2 has no preemptible GPU for its first 2569 s (the 1c trace's lead-in),
then a burst of 15 changes. Segment 3 is the fewest-changes window within 0.3 of 11.8 in
either file, yet only slightly calmer than 1 and 2 (14 changes, total |step| 46 vs 54 and
73), and it overlaps segment 1 by 5340 s: these traces hold no calmer 2-hour window at
that mean.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pearl_hpc.errors import PearlError

DEFAULT_RESERVED = 4
"""Reserved (non-preemptible) rollout GPUs in the PEARL setup."""


class TraceError(PearlError):
    """An availability trace file or a window of it is malformed; the message says the fix."""


@dataclass(frozen=True)
class AvailabilityTrace:
    """Right-continuous step function of available instances over time (seconds)."""

    name: str
    times_s: tuple[float, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.times_s:
            raise TraceError(f"trace {self.name!r} is empty: give at least one time point")
        if len(self.times_s) != len(self.counts):
            raise TraceError(
                f"trace {self.name!r}: {len(self.times_s)} times but {len(self.counts)} counts;"
                " give one count per time point"
            )
        for a, b in zip(self.times_s, self.times_s[1:], strict=False):
            if not b > a:
                raise TraceError(
                    f"trace {self.name!r}: times must be strictly increasing ({a} then {b})"
                )
        for c in self.counts:
            if c < 0:
                raise TraceError(f"trace {self.name!r}: negative count {c}")

    # -- shape -------------------------------------------------------------------------

    @property
    def start_s(self) -> float:
        return self.times_s[0]

    @property
    def end_s(self) -> float:
        return self.times_s[-1]

    @property
    def duration_s(self) -> float:
        """Length of the span, from the first to the last time point."""
        return self.times_s[-1] - self.times_s[0]

    # -- queries -----------------------------------------------------------------------

    def count_at(self, t_s: float) -> int:
        """Count in force at ``t_s`` (right-continuous: a change at ``t`` applies at ``t``).

        After the last time point the last count holds; before the first one is an error.
        """
        if t_s < self.times_s[0]:
            raise TraceError(
                f"trace {self.name!r}: time {t_s} s is before its start {self.times_s[0]} s"
            )
        lo, hi = 0, len(self.times_s) - 1
        while lo < hi:  # last index with times_s[i] <= t_s
            mid = (lo + hi + 1) // 2
            if self.times_s[mid] <= t_s:
                lo = mid
            else:
                hi = mid - 1
        return self.counts[lo]

    def mean(self, reserved: int = 0) -> float:
        """Time-weighted mean of ``count + reserved`` over the span.

        A single-point trace (zero span) returns its only count plus ``reserved``.
        """
        span = self.duration_s
        if span <= 0:
            return float(self.counts[0] + reserved)
        area = 0.0
        for i in range(len(self.times_s) - 1):
            area += self.counts[i] * (self.times_s[i + 1] - self.times_s[i])
        return area / span + reserved

    def changes(self) -> list[tuple[float, int, int]]:
        """Every change as ``(time_s, old, new)``; time points that keep the count are skipped."""
        out: list[tuple[float, int, int]] = []
        for i in range(1, len(self.times_s)):
            if self.counts[i] != self.counts[i - 1]:
                out.append((self.times_s[i], self.counts[i - 1], self.counts[i]))
        return out

    @property
    def num_changes(self) -> int:
        return len(self.changes())

    @property
    def changes_per_hour(self) -> float:
        span = self.duration_s
        return self.num_changes * 3600.0 / span if span > 0 else 0.0

    def scaled(self, factor: float) -> AvailabilityTrace:
        """Every count times ``factor``, rounded down: a pool of spot instances standing
        for a larger cluster's (one instance = ``factor`` GPUs)."""
        if not (math.isfinite(factor) and factor > 0):
            raise TraceError(f"trace {self.name!r}: scale {factor} must be a positive number")
        if factor == 1:
            return self
        return AvailabilityTrace(
            name=f"{self.name}x{factor:g}",
            times_s=self.times_s,
            counts=tuple(int(c * factor) for c in self.counts),
        )

    def window(self, start_s: float, duration_s: float) -> AvailabilityTrace:
        """The part ``[start_s, start_s + duration_s)`` re-based to start at 0.

        The first point is at 0 with the count in force at ``start_s``; changes strictly
        inside the window keep their offsets; a final point at ``duration_s`` carries the
        count in force just before the window's end, so the span (and :meth:`mean`) ends
        at ``duration_s`` and a change exactly at the end is not part of the window.
        """
        if not (math.isfinite(start_s) and math.isfinite(duration_s)) or duration_s <= 0:
            raise TraceError(
                f"trace {self.name!r}: window start {start_s} s, duration {duration_s} s;"
                " give a finite start and a positive duration"
            )
        end_s = start_s + duration_s
        if start_s < self.times_s[0] or end_s > self.times_s[-1]:
            raise TraceError(
                f"trace {self.name!r}: window [{start_s}, {end_s}] s is not inside the trace"
                f" [{self.times_s[0]}, {self.times_s[-1]}] s; choose a start between"
                f" {self.times_s[0]} and {self.times_s[-1] - duration_s} s"
            )
        times = [0.0]
        counts = [self.count_at(start_s)]
        for t, c in zip(self.times_s, self.counts, strict=True):
            if start_s < t < end_s:
                times.append(t - start_s)
                counts.append(c)
        times.append(float(duration_s))
        counts.append(counts[-1])
        return AvailabilityTrace(
            name=f"{self.name}[{start_s:g}+{duration_s:g}]",
            times_s=tuple(times),
            counts=tuple(counts),
        )


# -- parsing ---------------------------------------------------------------------------

_FORMAT_HINT = "each line must be `seconds_since_start,instances_available`"


def parse_trace(text: str, source: str = "<trace>", name: str | None = None) -> AvailabilityTrace:
    """Parse CSV text (no header) ``seconds_since_start,instances_available``.

    Rows come in pairs at each change (old value, then new value at the same time); in
    general, the count in force at a time is the one on the last row with that time.
    Blank lines and surrounding spaces are ignored, as are lines starting with ``#``.
    Errors name ``source:line`` and the fix.
    """
    times: list[float] = []
    counts: list[int] = []
    last_line = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        last_line = lineno
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            raise TraceError(
                f"{where}: expected 2 comma-separated columns, got {len(fields)} ({line!r});"
                f" {_FORMAT_HINT}"
            )
        t_txt, c_txt = fields
        try:
            t = float(t_txt)
            c_f = float(c_txt)
        except ValueError:
            raise TraceError(
                f"{where}: non-numeric value in {line!r}; {_FORMAT_HINT}"
                " (numbers only, no header line)"
            ) from None
        if not (math.isfinite(t) and math.isfinite(c_f)):
            raise TraceError(f"{where}: non-finite value in {line!r}; {_FORMAT_HINT}")
        if t < 0:
            raise TraceError(
                f"{where}: negative time {t_txt}; times are seconds since the trace start (>= 0)"
            )
        if c_f < 0:
            raise TraceError(f"{where}: negative instance count {c_txt}; counts must be >= 0")
        if c_f != int(c_f):
            raise TraceError(
                f"{where}: instance count {c_txt} is not a whole number; counts are integers"
            )
        c = int(c_f)
        if times and t < times[-1]:
            raise TraceError(
                f"{where}: time goes backwards ({t_txt} after {times[-1]:g});"
                " sort the rows by time (rows at the same time keep their order)"
            )
        if times and t == times[-1]:
            counts[-1] = c  # the last row at a time is the count in force from then on
        else:
            times.append(t)
            counts.append(c)
    if not times:
        raise TraceError(
            f"{source}:{max(last_line, 1)}: empty trace (no data rows); {_FORMAT_HINT}"
        )
    return AvailabilityTrace(
        name=name if name is not None else source, times_s=tuple(times), counts=tuple(counts)
    )


def load_trace(path: str | os.PathLike[str]) -> AvailabilityTrace:
    """Read a trace CSV (see :func:`parse_trace`); the trace is named after the file stem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace file ({exc.strerror}); check the path") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a UTF-8 text file; give a CSV trace") from None
    return parse_trace(text, source=str(p), name=p.stem)


# -- window search -----------------------------------------------------------------------


@dataclass(frozen=True)
class WindowCandidate:
    """One window found by :func:`find_windows`."""

    start_s: float
    duration_s: float
    mean: float  # reserved included
    num_changes: int
    changes_per_hour: float
    error: float  # |mean - target|


def find_windows(
    trace: AvailabilityTrace,
    target_mean: float,
    reserved: int = DEFAULT_RESERVED,
    duration_s: float = 7200,
    step_s: float = 60,
    *,
    prefer_many_changes: bool = True,
) -> list[WindowCandidate]:
    """Every window of ``duration_s`` starting on a ``step_s`` grid inside the trace.

    Windows without any change (e.g. the all-zero lead-in before recording starts) are
    dropped. Candidates are sorted by ``|mean(reserved) - target_mean|``, then by change
    rate (most changes first, or fewest with ``prefer_many_changes=False``), then start.
    """
    if step_s <= 0 or duration_s <= 0:
        raise TraceError("find_windows: step_s and duration_s must be positive")
    out: list[WindowCandidate] = []
    n_steps = math.floor((trace.duration_s - duration_s) / step_s + 1e-9)
    for k in range(n_steps + 1):
        start = trace.start_s + k * step_s
        w = trace.window(start, duration_s)
        if w.num_changes == 0:
            continue
        m = w.mean(reserved)
        out.append(
            WindowCandidate(
                start_s=start,
                duration_s=duration_s,
                mean=m,
                num_changes=w.num_changes,
                changes_per_hour=w.changes_per_hour,
                error=abs(m - target_mean),
            )
        )
    sign = -1.0 if prefer_many_changes else 1.0
    out.sort(key=lambda c: (c.error, sign * c.changes_per_hour, c.start_s))
    return out


def select_window(
    traces: Mapping[str, AvailabilityTrace],
    target_mean: float,
    *,
    many_changes: bool = True,
    tolerance: float = 0.3,
    reserved: int = DEFAULT_RESERVED,
    duration_s: float = 7200,
    step_s: float = 60,
) -> tuple[str, WindowCandidate]:
    """The rule that chose :data:`SEGMENTS`, over several traces (key: trace file name).

    ``many_changes=True``: the window whose mean is closest to the target (ties: more
    changes, then earlier key and start), i.e. the first :func:`find_windows` candidate
    over all traces. ``many_changes=False``: among the windows within ``tolerance`` of the
    target, the one with the fewest changes (ties: closest mean, then key and start).
    Raises :class:`TraceError` when no window is within ``tolerance``.
    """
    pool: list[tuple[str, WindowCandidate]] = []
    for key, trace in traces.items():
        for cand in find_windows(trace, target_mean, reserved, duration_s, step_s):
            if cand.error <= tolerance:
                pool.append((key, cand))
    if not pool:
        raise TraceError(
            f"no {duration_s:g} s window has a mean within {tolerance} of {target_mean};"
            " widen the tolerance or use another trace"
        )
    order = list(traces)
    if many_changes:
        return min(
            pool,
            key=lambda kc: (kc[1].error, -kc[1].num_changes, order.index(kc[0]), kc[1].start_s),
        )
    return min(
        pool, key=lambda kc: (kc[1].num_changes, kc[1].error, order.index(kc[0]), kc[1].start_s)
    )


# -- PEARL's segments ----------------------------------------------------------------------

TRACE_1C = "aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200.csv"
TRACE_1D = "aws-spot-instances-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530.csv"
TRACE_FILES = (TRACE_1C, TRACE_1D)


@dataclass(frozen=True)
class Segment:
    """A named window of a packaged trace file."""

    trace_file: str
    start_s: float
    duration_s: float = 7200.0
    description: str = ""
    target_mean: float | None = None  # PEARL's mean pool, reserved GPUs included


SEGMENTS: dict[int, Segment] = {
    # select_window(all traces, 13.6, many_changes=True)
    1: Segment(
        trace_file=TRACE_1D,
        start_s=37380.0,
        description="many changes, plenty: mean 13.600 (4 reserved included), 17 changes"
        " (8.5/h), pool 7-16",
        target_mean=13.6,
    ),
    # select_window(all traces, 9.0, many_changes=True)
    2: Segment(
        trace_file=TRACE_1C,
        start_s=18960.0,
        description="many changes, scarce: mean 9.017, 15 changes (7.5/h), pool 4-16;"
        " no preemptible GPU for the first 2569 s, then a burst of changes",
        target_mean=9.0,
    ),
    # select_window(all traces, 11.8, many_changes=False)
    3: Segment(
        trace_file=TRACE_1D,
        start_s=35520.0,
        description="moderate, fewer changes: mean 11.628, 14 changes (7.0/h), pool 7-16;"
        " overlaps segment 1 (it starts 1860 s earlier)",
        target_mean=11.8,
    ),
}


def trace_path(trace_file: str) -> Path:
    """Path of a packaged trace file in ``pearl_hpc/data/traces/``."""
    res = resources.files("pearl_hpc").joinpath("data", "traces", trace_file)
    path = Path(str(res))
    if not path.is_file():  # fall back to the source tree next to this module
        path = Path(__file__).resolve().parent.parent / "data" / "traces" / trace_file
    if not path.is_file():
        raise TraceError(
            f"trace file {trace_file!r} is not in pearl_hpc/data/traces;"
            f" known files: {', '.join(TRACE_FILES)}"
        )
    return path


def load_packaged_trace(trace_file: str) -> AvailabilityTrace:
    """Load one of :data:`TRACE_FILES` from the package data."""
    return load_trace(trace_path(trace_file))


def load_segment(n: int) -> AvailabilityTrace:
    """PEARL segment ``n`` (1, 2 or 3) as a trace re-based to start at 0."""
    if n not in SEGMENTS:
        raise TraceError(f"unknown segment {n!r}; choose one of {sorted(SEGMENTS)}")
    seg = SEGMENTS[n]
    w = load_packaged_trace(seg.trace_file).window(seg.start_s, seg.duration_s)
    return AvailabilityTrace(name=f"segment{n}", times_s=w.times_s, counts=w.counts)
