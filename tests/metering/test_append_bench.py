"""The append benchmark runs and reports its numbers (timing targets are checked by running it)."""

from __future__ import annotations

import json
from pathlib import Path

from metering.bench import bench_append, main


def test_bench_append_reports_latency_percentiles(tmp_path: Path) -> None:
    result = bench_append(25, tmp_path)
    assert result["records"] == 25
    assert 0 < result["median_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["segment_bytes"] > 25 * 500
    assert list(tmp_path.iterdir()) == []  # the temporary segment is removed


def test_main_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "result.json"
    main(["--records", "5", "--dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text())["records"] == 5
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["metric", "value"]
    assert f"written to {out}" in printed
