"""Task datasets (run.tasks: JSONL, Parquet, a datasets directory; splits; the schedule a
resumed run continues) and the Qwen3 / Hermes tool-call parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.tasks import TaskSet, load_task_set, read_tasks
from pearl_hpc.rollout.toolcalls import parse_tool_calls, strip_tool_calls


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"expression": f"{i} + {i}", "target": 2 * i} for i in range(10)]


def test_jsonl_parquet_and_datasets_directories_read_the_same_rows(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = read_tasks(write_jsonl(tmp_path / "t.jsonl", ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    parquet = read_tasks(tmp_path / "t.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(tmp_path / "t")
    directory = read_tasks(tmp_path / "t")
    assert jsonl == parquet == directory
    assert jsonl[3] == {"expression": "3 + 3", "target": 6, "id": "t-3"}


def test_ids_come_from_the_rows_and_must_be_unique(tmp_path: Path) -> None:
    rows = read_tasks(write_jsonl(tmp_path / "a.jsonl", [{"task_id": "HE/1"}, {"id": 7}]))
    assert [r["id"] for r in rows] == ["HE/1", "7"]
    with pytest.raises(ConfigError, match="task id 'x' appears twice"):
        read_tasks(write_jsonl(tmp_path / "b.jsonl", [{"id": "x"}, {"id": "x"}]))


@pytest.mark.parametrize(
    ("content", "name", "match"),
    [
        ("{not json\n", "bad.jsonl", r"bad.jsonl:1: not JSON"),
        ("[1, 2]\n", "list.jsonl", r"list.jsonl:1: a task is a JSON object"),
        ("", "empty.jsonl", "holds no tasks"),
        ("a,b\n", "t.csv", "use a .jsonl or .parquet file"),
        ("garbage", "t.parquet", "not a Parquet file"),
    ],
)
def test_bad_task_files_are_one_line(tmp_path: Path, content: str, name: str, match: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=match):
        read_tasks(tmp_path / name)
    with pytest.raises(ConfigError, match="does not exist"):
        read_tasks(tmp_path / "missing.jsonl")


def test_eval_split_is_held_out_and_the_schedule_is_a_function_of_the_step(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    tasks = load_task_set(str(path), eval_fraction=0.2, seed=3)
    assert (len(tasks.train), len(tasks.eval)) == (8, 2)
    assert {t["id"] for t in tasks.train}.isdisjoint({t["id"] for t in tasks.eval})
    # 3 groups a step: one pass is 8 tasks; every pass visits each training task once
    order = [tasks.for_group(s, g, 3)["id"] for s in range(8) for g in range(3)]
    for p in range(3):
        assert sorted(order[8 * p : 8 * p + 8]) == sorted(t["id"] for t in tasks.train)
    assert order[:8] != order[8:16]  # a new order each pass
    # a resumed run (a fresh TaskSet) continues exactly where step 5 left off
    again = load_task_set(str(path), eval_fraction=0.2, seed=3)
    assert [again.for_group(5, g, 3)["id"] for g in range(3)] == order[15:18]
    fixed = load_task_set(str(path), shuffle=False)
    assert [fixed.for_group(0, g, 4)["id"] for g in range(4)] == ["t-0", "t-1", "t-2", "t-3"]
    held = load_task_set(str(path), eval_path=str(write_jsonl(tmp_path / "e.jsonl", ROWS[:2])))
    assert len(held.train) == 10 and [t["id"] for t in held.eval] == ["e-0", "e-1"]
    with pytest.raises(ConfigError, match="training split has no tasks"):
        TaskSet(())


def test_tool_calls_in_qwen3_format() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "x", "arguments": 3}</tool_call><tool_call>{"name"'
    )
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("python", {"code": "print(2)"}),
        ("calc", {"expression": "1+1"}),
    ]
    assert len(parsed.errors) == 4
    assert "not JSON" in parsed.errors[0] and '"name" string' in parsed.errors[1]
    assert 'x: "arguments" must be a JSON object' in parsed.errors[2]
    assert "not closed" in parsed.errors[3]
    assert not parse_tool_calls("no calls here").found
    assert strip_tool_calls(text.split("<tool_call>{oops")[0], keep_arguments=True).split() == [
        "Let",
        "me",
        "compute.",
        "print(2)",
        "1+1",
    ]
