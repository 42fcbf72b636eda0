"""Benchmark of `Ledger.append` latency: sign, write and fsync of one usage record.

    python -m metering.bench --records 2000 --dir /var/lib/tenzro --json bench-results/append.json

The target is a median under 2 ms per append. Measure on the disk the ledger will live on: a
tmpfs directory makes fsync free and the number meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from metering.ledger import Ledger
from metering.pricing import DEFAULT_PRICING
from metering.record import Latency, TokenCounts
from metering.signer import NodeSigner
from metering.sla import nearest_rank

TARGET_MEDIAN_MS = 2.0
BENCH_EVIDENCE_DIGEST = "be" * 32
"""Stands for the attestation evidence digest: it has the size of a real one, so the lines do too."""


def bench_append(records: int, directory: str | Path | None = None) -> dict[str, Any]:
    """Append `records` records to a fresh segment in `directory` (a temporary one by default)."""
    if records < 1:
        raise ValueError(f"records must be at least 1, got {records}")
    with tempfile.TemporaryDirectory(dir=directory, prefix="ledger-bench-") as temp:
        ledger = Ledger(temp, NodeSigner.generate(), uuid.uuid4().hex, evidence_digest=BENCH_EVIDENCE_DIGEST)
        counts = TokenCounts(
            input_tokens=1200, cached_read_tokens=1000, cached_write_tokens=150, output_tokens=300
        )
        request_latency = Latency(queue_wait_ms=12, ttft_ms=85, total_ms=2400)
        latencies_ms: list[float] = []
        with ledger:
            for index in range(records):
                start = time.perf_counter_ns()
                ledger.append(
                    record_id=f"chatcmpl-{index:08d}",
                    caller_id="caller-bench",
                    model="default",
                    status="completed",
                    counts=counts,
                    prices=DEFAULT_PRICING,
                    latency=request_latency,
                )
                latencies_ms.append((time.perf_counter_ns() - start) / 1e6)
            segment_bytes = ledger.path.stat().st_size
    latencies_ms.sort()
    median = statistics.median(latencies_ms)
    return {
        "records": records,
        "directory": str(Path(temp).parent),
        "median_ms": round(median, 4),
        "p99_ms": round(nearest_rank(latencies_ms, 99), 4),
        "max_ms": round(latencies_ms[-1], 4),
        "mean_ms": round(statistics.fmean(latencies_ms), 4),
        "appends_per_s": round(1000 / statistics.fmean(latencies_ms), 1),
        "segment_bytes": segment_bytes,
        "target_median_ms": TARGET_MEDIAN_MS,
        "meets_target": median < TARGET_MEDIAN_MS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2000, help="appends to time (default 2000)")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: system temp)")
    parser.add_argument("--json", default="bench-results/metering-append.json", help="where to write results")
    args = parser.parse_args(argv)
    result = bench_append(args.records, args.dir)
    print(f"{'metric':<16}{'value':>14}")
    for name in ("records", "median_ms", "p99_ms", "max_ms", "mean_ms", "appends_per_s", "meets_target"):
        print(f"{name:<16}{result[name]!s:>14}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"written to {out}")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
