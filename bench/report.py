"""What a benchmark prints and writes: progress on stderr, an aligned table on stdout, its JSON report.

Standard library only, so that a command's parser can name these records without loading the client."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.client import BenchError


@dataclass(frozen=True, slots=True)
class Target:
    """The server a benchmark measured: the first fields of its report's settings."""

    url: str
    model: str
    local: bool
    threads: int | None
    """Torch threads of the local node; None when measuring --url."""
    device: str | None
    """Device passed to the local node; None lets it choose (cuda when present) or means --url."""


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def failed(error: BenchError) -> int:
    """Say why the benchmark could not run; returns its exit status."""
    print(f"tenzro: error: {error}", file=sys.stderr)
    return 2


def columns(rows: Sequence[Sequence[str]], left: int = 0) -> str:
    """Rows of cells as text columns: the first `left` columns aligned left, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) if i < left else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip()
                     for row in rows)


def write_report(out: Path, settings: Any, rows: Sequence[Any], samples: Sequence[Any], **found: Any) -> None:
    """A benchmark's JSON, next to the table it printed: its settings, its rows, what else it `found`, then
    every sample (settings, rows and samples are dataclasses)."""
    write_json(out, {"settings": asdict(settings), "rows": [asdict(row) for row in rows], **found,
                     "samples": [asdict(sample) for sample in samples]})


def write_json(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    progress(f"bench: wrote {out}")
