"""The master's biggest per-step writes, at PEARL's shape: the TRAIN batch and the
trajectory log.

For a synthetic batch of ``--trajectories`` trajectories of ``--tokens`` tokens (half
generated, with their log-probabilities) over ``--turns`` turns:

- TRAIN: the bytes of the message and the seconds the master spends encoding it for
  ``--ranks`` trainer ranks and one rank decoding it: msgpack of the typed records (what
  the plane sends) against mpi4py's default, a pickle of plain dicts per rank;
- the trajectory log: the bytes and the master's seconds to log every trajectory after
  each of its turns, as the log appends it (what a turn added) against a whole record of
  the trajectory after every turn (the log's earlier format, which it still reads).

Run: ``pearl-hpc bench --messages`` (or ``python -m pearl_hpc.bench.messages``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pearl_hpc.bench import record
from pearl_hpc.comm.messages import Command, Train, decode_command, encode
from pearl_hpc.master.journal import TrajectoryLog
from pearl_hpc.rollout.types import Segment, Trajectory, TurnStats

VOCAB = 151_936  # Qwen3's vocabulary: token ids above 65,535 take 5 bytes in msgpack


def trajectory(i: int, tokens: int, turns: int) -> Trajectory:
    """A finished trajectory of ``tokens`` tokens, half of them generated (seeded)."""
    rng = random.Random(i)
    per = max(1, tokens // (2 * turns))
    segments = []
    for _ in range(turns):
        segments.append(Segment(tuple(rng.randrange(VOCAB) for _ in range(per)), False))
        ids = tuple(rng.randrange(VOCAB) for _ in range(per))
        segments.append(Segment(ids, True, tuple(-rng.random() for _ in range(per)), 3))
    stats = [TurnStats(t, per, per, 2 * per * (t + 1), 1.0, ("s1",)) for t in range(turns)]
    group = f"s0-g{i // 16}"
    return Trajectory(f"{group}-k{i % 16}", group, segments, 1.0, True, {3}, stats)


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(trajectories: int, tokens: int, turns: int, ranks: int) -> list[dict[str, Any]]:
    batch = [trajectory(i, tokens, turns) for i in range(trajectories)]

    def pickle_encode() -> bytes:  # mpi4py's send: the batch as dicts, pickled per rank
        dicts = [t.to_dict() for t in batch]
        return [pickle.dumps((r, dicts)) for r in range(ranks)][-1]

    def pickle_decode(blob: bytes) -> list[Trajectory]:
        _, dicts = pickle.loads(blob)
        return [Trajectory.from_dict(d) for d in dicts]

    def plane_encode() -> bytes:  # the plane: the batch encoded once, framed per rank
        body = Train(0, msgspec.msgpack.encode(batch))
        return [encode(Command(r, body)) for r in range(ranks)][-1]

    def plane_decode(blob: bytes) -> list[Trajectory]:
        cmd = decode_command(blob)
        assert isinstance(cmd.body, Train)
        return msgspec.msgpack.decode(cmd.body.trajectories, type=list[Trajectory])

    rows: list[dict[str, Any]] = []
    first: tuple[float, float] | None = None  # pickle's seconds: the baseline
    for name, enc, dec in (
        ("pickle of dicts (mpi4py's default)", pickle_encode, pickle_decode),
        ("msgpack of typed records (the plane)", plane_encode, plane_decode),
    ):
        blob, encode_s = _timed(enc)
        back, decode_s = _timed(lambda: dec(blob))  # noqa: B023 (called at once)
        assert back == batch, name
        first = first or (encode_s, decode_s)
        rows.append({
            "encoding": name,
            "mib_per_rank": round(len(blob) / 2**20, 1),
            "master_encode_s": round(encode_s, 3),
            "rank_decode_s": round(decode_s, 3),
            "encode_vs_pickle": round(encode_s / first[0], 3),
            "decode_vs_pickle": round(decode_s / first[1], 3),
        })  # fmt: skip
    return rows


def log_rows(trajectories: int, tokens: int, turns: int) -> list[dict[str, Any]]:
    """The step's trajectory log written turn by turn, both ways (into a temporary run
    directory); each reads back to the batch."""
    batch = [trajectory(i, tokens, turns) for i in range(trajectories)]
    rows: list[dict[str, Any]] = []
    first: tuple[int, float] | None = None  # the whole records' bytes and seconds
    with tempfile.TemporaryDirectory(prefix="pearl-bench-log-") as tmp:
        whole_path = Path(tmp) / "whole.jsonl"

        def whole(traj: Trajectory) -> None:  # the earlier format: all of it, every turn
            with whole_path.open("a") as f:
                f.write(json.dumps(traj.to_dict()) + "\n")

        log = TrajectoryLog(Path(tmp))
        for name, record, path in (
            ("whole trajectory per turn", whole, whole_path),
            ("what the turn added (the log)", lambda t: log.record(0, t), log.path(0)),
        ):
            seconds = 0.0
            for turn in range(turns + 1):  # turn 0: the prompt alone is not logged
                grown = [_after_turns(t, turn) for t in batch]
                t0 = time.perf_counter()
                for traj in grown if turn else ():
                    record(traj)
                seconds += time.perf_counter() - t0
            log.close()
            size = path.stat().st_size
            first = first or (size, seconds)
            rows.append({
                "log": name,
                "mib": round(size / 2**20, 1),
                "master_s": round(seconds, 3),
                "bytes_vs_whole": round(size / first[0], 3),
                "seconds_vs_whole": round(seconds / first[1], 3),
            })  # fmt: skip
        assert TrajectoryLog(Path(tmp)).load(0) == {t.trajectory_id: t for t in batch}
    return rows


def _after_turns(traj: Trajectory, turns: int) -> Trajectory:
    """``traj`` as it stood after ``turns`` turns (its prompt, then two segments a turn)."""
    return Trajectory(
        traj.trajectory_id, traj.group_id, traj.segments[: 1 + 2 * turns],
        traj.reward if turns == len(traj.turns) else None, turns == len(traj.turns),
        traj.weight_versions, traj.turns[:turns], traj.info,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --messages", description=__doc__)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=16, help="trainer ranks")
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser)
    args = parser.parse_args(argv)
    rows = run(args.trajectories, args.tokens, args.turns, args.ranks)
    logged = log_rows(args.trajectories, args.tokens, args.turns)
    ratios = {
        f"{r['encoding']}: {k}": r[k]
        for r in rows
        for k in ("encode_vs_pickle", "decode_vs_pickle")
        if isinstance(r.get(k), int | float)
    }
    ratios.update({f"log {r['log']}: seconds_vs_whole": r["seconds_vs_whole"] for r in logged})
    result = {"train": rows, "trajectory_log": logged}
    record.append(args.record, "messages", result, ratios, vars(args))
    if args.json:
        print(json.dumps({"train": rows, "trajectory_log": logged}, indent=1))
        return 0
    print(f"TRAIN of {args.trajectories} trajectories x {args.tokens} tokens "
          f"({args.turns} turns) to {args.ranks} trainer ranks")  # fmt: skip
    cols = ("encoding", "mib_per_rank", "master_encode_s", "rank_decode_s",
            "encode_vs_pickle", "decode_vs_pickle")  # fmt: skip
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    print(f"\nthe step's trajectory log, each trajectory after each of its {args.turns} turns")
    log_cols = ("log", "mib", "master_s", "bytes_vs_whole", "seconds_vs_whole")
    print(" | ".join(log_cols))
    for row in logged:
        print(" | ".join(str(row[c]) for c in log_cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
