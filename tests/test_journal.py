"""The master journal: atomic file, clear errors, controller restart from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearl_hpc.core.controller import CapacityGranted, Controller, WorkerReady
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.rundir import JournalError, read_journal, write_journal
from tests.factories import ManualClock, RecordingExecutor, make_profile


def _controller() -> Controller:
    return Controller(
        make_profile(), RecordingExecutor(), clock=ManualClock(), check_invariants=True
    )


def test_master_restarts_from_journal(tmp_path: Path) -> None:
    ctl = _controller()
    ctl.register_training(["t:0", "t:1", "t:2", "t:3"], overlap_gpu_sets=[["t:0", "t:1"]])
    ctl.grant_reserved([["r:0", "r:1"], ["r:2", "r:3"]])
    for slot in ctl.table.in_service():
        ctl.handle(WorkerReady(slot.slot_id))
    ctl.handle(CapacityGranted(ElasticSource("42", 1), (("e:0", "e:1"),)))
    path = tmp_path / "run" / "journal.json"
    write_journal(path, ctl.snapshot(), time_s=12.5)

    restarted = _controller()
    restarted.restore(read_journal(path))
    assert restarted.snapshot() == ctl.snapshot()
    assert [p.name for p in path.parent.iterdir()] == ["journal.json"]  # no temp file left


def test_journal_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="no journal here"):
        read_journal(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(JournalError, match="corrupt journal"):
        read_journal(bad)
    bad.write_text(json.dumps({"format": "other/9", "state": {}}))
    with pytest.raises(JournalError, match="is not 'pearl-hpc-journal/1'"):
        read_journal(bad)


def test_counters_continue_from_a_journal_and_refuse_a_corrupt_one() -> None:
    from pearl_hpc.master.records import Counters

    counters = Counters()
    counters.load_state_dict({"grows": 2, "activation_s": [1.5], "a_key_of_later": 1})
    assert counters.grows == 2 and counters.activation_s == [1.5]
    assert not hasattr(counters, "a_key_of_later")  # only the fields, typed
    with pytest.raises(JournalError, match=r"counters: Expected `int`, got `str` - at `\$.grows`"):
        counters.load_state_dict({"grows": "two"})
