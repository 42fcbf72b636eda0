"""The benchmarks' table layout."""

from __future__ import annotations

from bench.report import columns


def test_columns_align_left_then_right_without_trailing_space() -> None:
    rows = [("form", "", "ms"), ("text", "a", "1.5"), ("chat", "longer", "12.25"), ("x", "y", "")]
    assert columns(rows, left=2).splitlines() == ["form" + " " * 13 + "ms",
                                                  "text  a" + " " * 9 + "1.5",
                                                  "chat  longer  12.25",
                                                  "x     y"]
    assert columns(rows).splitlines() == ["form" + " " * 13 + "ms",
                                          "text" + " " * 7 + "a" + " " * 4 + "1.5",
                                          "chat  longer  12.25",
                                          "   x       y"]
