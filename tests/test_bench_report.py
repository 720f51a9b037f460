"""Benchmarks that guard their figures: each writes one JSON line (commit, machine,
result, ratios), and docs/benchmarks.md's generated tables are those lines' (a unit test
of bench/record.py and bench/report.py, and the cheapest simulator case run for real)."""

from __future__ import annotations

import json
from pathlib import Path

from pearl_hpc.bench import record, report, sim_speed

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_tables_and_the_readmes_figures_are_the_recorded_lines() -> None:
    """docs/benchmarks.md holds, between its markers, what docs/bench.jsonl gives, and
    README.md cites its figures from the same lines: a figure changed by hand, or a
    line recorded without regenerating, fails here."""
    doc, readme = REPO / "docs" / "benchmarks.md", REPO / "README.md"
    assert report.main(str(REPO / "docs" / "bench.jsonl"), check=True, docs=(doc, readme)) == 0
    text = doc.read_text()
    for name in report.TABLES:
        assert f"<!-- bench:{name} -->" in text and f"<!-- /bench:{name} -->" in text, name
    cited = readme.read_text()
    for name in report.FIGURES:
        assert f"<!-- fig:{name} -->" in cited, name


def test_a_block_is_rewritten_from_the_newest_line_and_check_fails_before(
    tmp_path: Path,
) -> None:
    lines = tmp_path / "bench.jsonl"
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- bench:sim -->\nold\n<!-- /bench:sim -->\n\nprose stays\n")
    row = {"case": "pearl, 9 GPUs", "wall_s": 1.0, "us_per_event": 2.5, "events": 4000,
           "trajectories": 7}  # fmt: skip
    record.append(str(lines), "sim", [{**row, "wall_s": 9.0}], {"r": 1.0})
    record.append(str(lines), "sim", [row], {"r": 2.0})  # the newer one is reported
    assert report.main(str(lines), check=True, docs=(doc,)) == 1  # stale: "old"
    assert report.main(str(lines), docs=(doc,)) == 0
    text = doc.read_text()
    assert "| pearl, 9 GPUs | 1.00 | 2.5 | 4,000 | 7 |" in text and "9.00" not in text
    assert "Ratios: r 2" in text and "old" not in text and text.endswith("prose stays\n")
    assert report.main(str(lines), check=True, docs=(doc,)) == 0


def test_a_cited_figure_and_a_part_of_a_bench_come_from_its_newest_line(
    tmp_path: Path,
) -> None:
    lines = tmp_path / "bench.jsonl"
    readme = tmp_path / "README.md"
    readme.write_text("packing <!-- fig:train-packing -->1.0x<!-- /fig --> the tokens/s\n")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- bench:train.packing -->\nold\n<!-- /bench:train.packing -->\n")
    rows = [{"case": "neither", "peak_mib": 100.0, "step_s": 1.0},
            {"layout": "padded", "tokens_computed": 80, "padding_share": 0.5,
             "tokens_per_s": 100.0},
            {"layout": "packed", "tokens_computed": 40, "padding_share": 0.0,
             "tokens_per_s": 420.0}]  # fmt: skip
    record.append(str(lines), "train", rows, {"packed / padded tokens/s": 4.2})
    assert report.main(str(lines), docs=(doc, readme)) == 0
    cited = "packing <!-- fig:train-packing -->4.2x<!-- /fig --> the tokens/s\n"
    assert readme.read_text() == cited
    text = doc.read_text()
    assert "| packed | 40 | 0.0% | 420 (4.20x) |" in text and "neither" not in text
    assert "Ratios" not in text  # a part's block: the bench's ratios are not repeated
    assert report.main(str(lines), check=True, docs=(doc, readme)) == 0


def test_the_simulator_bench_at_its_smallest_records_its_line(tmp_path: Path, capsys) -> None:
    lines = tmp_path / "bench.jsonl"
    assert sim_speed.main(["--smallest", "--json", "--record", str(lines)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["case"] == "pearl, segment 2, 3600 s" and row["events"] > 10_000
    assert row["us_per_event"] > 0
    (line,) = [json.loads(x) for x in lines.read_text().splitlines()]
    assert line["bench"] == "sim" and line["result"] == [row] and line["args"]["smallest"]


def test_the_checkpoint_bench_at_a_small_size_records_both_saves(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """``bench --checkpoint`` on the tiny model and a 2-layer Qwen3: each save measured,
    the step's wait per checkpoint_every steps and its ratio recorded."""
    from pearl_hpc.bench import checkpoint

    monkeypatch.setenv("PEARL_HPC_CACHE", str(tmp_path / "cache"))
    lines = tmp_path / "bench.jsonl"
    small = ["--hidden", "64", "--layers", "2", "--vocab", "4096", "--repeats", "1"]
    assert checkpoint.main([*small, "--json", "--record", str(lines)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["model"] for r in rows] == ["tiny", "qwen3 2x64"]
    assert all(r["before_s"] > 0 and r["blocked_s"] > 0 and r["state_bytes"] > 0 for r in rows)
    (line,) = [json.loads(x) for x in lines.read_text().splitlines()]
    assert line["bench"] == "checkpoint" and line["result"] == rows
    assert line["ratios"] == {
        f"{r['model']}: before / after per step": r["per_step_ratio"] for r in rows
    }


def test_a_record_names_paths_in_the_checkout_relative_to_it(tmp_path: Path) -> None:
    config = record.SOURCE / "pearl_hpc" / "configs" / "runs" / "local.yaml"
    line = record.append("", "local", {}, args={"config": str(config), "other": "/x/y"})
    assert line["args"] == {"config": "pearl_hpc/configs/runs/local.yaml", "other": "/x/y"}
