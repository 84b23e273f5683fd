"""`pagedllm bench allreduce`: a real run of two ranks with tiny iteration counts, whose report and JSON are checked
for their structure (never their timings), and its refusal of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm.benchmarks import allreduce
from pagedllm.entrypoints.cli import build_parser

needs_build = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler, so no native extension")


def test_sizes_parse_and_bad_ones_are_named() -> None:
    assert allreduce.parse_sizes("576, 4096") == [576, 4096]
    with pytest.raises(ValueError, match="'-3'"):
        allreduce.parse_sizes("576,-3")


def test_bad_input_exits_with_status_2() -> None:
    for argv in (["--iters", "0"], ["--sizes", "x"], ["--world-size", "0"]):
        with pytest.raises(SystemExit) as exc:
            allreduce.main(argv)
        assert exc.value.code == 2


def test_the_cli_knows_it() -> None:
    ns = build_parser().parse_args(["bench", "allreduce", "--iters", "3"])
    assert ns.bench_kind == "allreduce" and ns.bench_args == ["--iters", "3"]


@needs_build
@pytest.mark.timeout(120)
def test_a_tiny_run_reports_every_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "allreduce.json"
    argv = ["--sizes", "8,600", "--iters", "6", "--warmup", "2", "--rounds", "2", "--max-floats", "256"]
    assert allreduce.main([*argv, "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "CPU: " in text and "gloo/shm" in text
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["iters"] == 6 and record["max_floats"] == 256
    assert record["command"].startswith("pagedllm bench allreduce --sizes 8,600")
    assert [row["floats"] for row in record["rows"]] == [8, 600]
    for row in record["rows"]:
        assert row["agree"] is True and row["calls"] == 6
        assert row["shm_us"] > 0 and row["gloo_us"] > 0 and row["gloo_over_shm"] > 0
        assert len(row["per_rank"]) == 2 and all(r["floats"] == row["floats"] for r in row["per_rank"])
        assert f"{row['floats']:>10} " in text
