"""The `tenzro metering ...` and `tenzro provider pricing ...` commands: offline ledger checks and prices.

Kept apart from the serving CLI so that auditors can run verification without the engine: this
module imports only the standard library and `metering`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from metering.bill import Bill, UsageTotals, bill
from metering.pricing import (
    DEFAULT_PRICING,
    PRICE_FIELDS,
    PriceSchedule,
    PricingError,
    load_pricing,
    save_pricing,
)
from metering.segment import SegmentFormatError
from metering.signer import SignatureInvalid
from metering.tree_head import TreeHeadError
from metering.verify import verify_segment

Command = Callable[[argparse.Namespace], int]

# Command-line flag -> PriceSchedule field. The cached flags keep the names the operator docs use.
PRICE_FLAGS: dict[str, str] = {
    "--input-price-wei": "input_price_wei",
    "--output-price-wei": "output_price_wei",
    "--price-per-cached-read-token-wei": "cached_read_price_wei",
    "--price-per-cached-write-token-wei": "cached_write_price_wei",
}
assert sorted(PRICE_FLAGS.values()) == sorted(PRICE_FIELDS)


def tenzro_home() -> Path:
    """$TENZRO_HOME, or ~/.tenzro (the same rule as `node.config`, which this module may not import)."""
    return Path(os.environ.get("TENZRO_HOME", "~/.tenzro")).expanduser()


def default_pricing_path() -> Path:
    return tenzro_home() / "pricing.yaml"


def add_metering_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `metering {verify,bill}` and `provider pricing {set,show}` to a CLI's subcommands.

    Every leaf parser sets `func`, a callable taking the parsed Namespace and returning the exit code.
    A CLI that already has its own `provider` parser calls `add_pricing_commands` on it instead.
    """
    metering = subparsers.add_parser("metering", help="verify signed usage ledgers and bill callers")
    metering_commands = metering.add_subparsers(dest="metering_command", required=True)

    verify = metering_commands.add_parser("verify", help="verify a ledger segment offline")
    verify.add_argument("ledger", metavar="LEDGER", help="segment file (ledger-<boot_id>.jsonl)")
    verify.add_argument("--node-key", required=True, metavar="HEX", help="trusted node public key, 64 hex")
    verify.add_argument("--tree-head", metavar="FILE", help="signed tree head JSON the segment must match")
    verify.set_defaults(func=run_verify)

    bill_parser = metering_commands.add_parser("bill", help="total a caller's usage and cost")
    bill_parser.add_argument("ledger", metavar="LEDGER", help="segment file or ledger directory")
    bill_parser.add_argument("--caller", required=True, metavar="ID", help="caller id to bill")
    bill_parser.add_argument("--since", metavar="TIME", help="inclusive start: ISO 8601 or Unix ms")
    bill_parser.add_argument("--until", metavar="TIME", help="exclusive end: ISO 8601 or Unix ms")
    bill_parser.set_defaults(func=run_bill)

    provider = subparsers.add_parser("provider", help="provider settings")
    add_pricing_commands(provider.add_subparsers(dest="provider_command", required=True))


def add_pricing_commands(provider_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `pricing {set,show}` under an existing `provider` parser's subcommands."""
    pricing = provider_subparsers.add_parser("pricing", help="per-token prices in wei")
    pricing_commands = pricing.add_subparsers(dest="pricing_command", required=True)

    set_parser = pricing_commands.add_parser(
        "set", help="change prices; fields not given keep their current (or default) value"
    )
    for flag, field in PRICE_FLAGS.items():
        set_parser.add_argument(
            flag, dest=field, type=int, metavar="N", help=f"{field}, integer wei per token"
        )
    set_parser.add_argument(
        "--pricing", metavar="FILE", help="price file (default $TENZRO_HOME/pricing.yaml)"
    )
    set_parser.set_defaults(func=run_pricing_set)

    show = pricing_commands.add_parser("show", help="print the prices in force")
    show.add_argument("--pricing", metavar="FILE", help="price file (default $TENZRO_HOME/pricing.yaml)")
    show.set_defaults(func=run_pricing_show)


def run_verify(args: argparse.Namespace) -> int:
    try:
        report = verify_segment(args.ledger, args.node_key, args.tree_head)
    except (OSError, SignatureInvalid, TreeHeadError) as exc:
        print(f"cannot verify: {exc}")
        return 1
    head = "" if report.tree_head_size is None else f", tree head of {report.tree_head_size} records"
    if report.ok:
        print(
            f"OK {report.path}: {report.good_records} records verified under key {report.node_key_id}"
            f"{head}; Merkle root {report.root_hash_hex}"
        )
        return 0
    print(f"FAILED {report.path}: {report.problem}")
    print(f"{report.good_records} records before it verified under key {report.node_key_id}{head}")
    return 1


def parse_time_ms(text: str) -> int:
    """Unix milliseconds, given as digits or as an ISO 8601 time (UTC when it has no offset)."""
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(
            f"{text!r} is neither Unix milliseconds nor ISO 8601 (2025-01-31T12:00:00Z)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def run_bill(args: argparse.Namespace) -> int:
    try:
        since_ms = None if args.since is None else parse_time_ms(args.since)
        until_ms = None if args.until is None else parse_time_ms(args.until)
        result = bill(args.ledger, args.caller, since_ms, until_ms)
    except (OSError, SegmentFormatError, ValueError) as exc:
        print(f"cannot bill: {exc}")
        return 1
    print(format_bill(result))
    return 0


_BILL_COLUMNS = ("model", "status", "records", "input", "cached_read", "cached_write", "output", "cost_wei")


def _bill_row(model: str, status: str, totals: UsageTotals) -> tuple[str, ...]:
    return (
        model,
        status,
        str(totals.records),
        str(totals.input_tokens),
        str(totals.cached_read_tokens),
        str(totals.cached_write_tokens),
        str(totals.output_tokens),
        str(totals.cost_wei),
    )


def format_bill(result: Bill) -> str:
    """A fixed-width table: one row per (model, status), then the totals row."""
    window = (
        f"from {'start' if result.since_ms is None else result.since_ms} ms "
        f"to {'now' if result.until_ms is None else result.until_ms} ms"
    )
    rows: list[tuple[str, ...]] = [_BILL_COLUMNS]
    rows += [_bill_row(line.model, line.status, line.totals) for line in result.lines]
    rows.append(_bill_row("TOTAL", "", result.total))
    widths = [max(len(row[column]) for row in rows) for column in range(len(_BILL_COLUMNS))]
    out = [f"caller {result.caller_id}, {window}, {result.segments} segment(s)"]
    for row in rows:
        cells = [
            cell.ljust(width) if column < 2 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def format_pricing(schedule: PriceSchedule) -> str:
    return "\n".join(f"{flag.lstrip('-')}: {getattr(schedule, field)}" for flag, field in PRICE_FLAGS.items())


def run_pricing_set(args: argparse.Namespace) -> int:
    path = Path(args.pricing) if args.pricing else default_pricing_path()
    try:
        current = load_pricing(path) if path.exists() else DEFAULT_PRICING
        changes = {field: getattr(args, field) for field in PRICE_FIELDS if getattr(args, field) is not None}
        schedule = PriceSchedule(**{**current.to_mapping(), **changes})
        save_pricing(path, schedule)
    except (OSError, PricingError) as exc:
        print(f"cannot set pricing: {exc}")
        return 1
    print(f"prices written to {path}")
    print(format_pricing(schedule))
    return 0


def run_pricing_show(args: argparse.Namespace) -> int:
    path = Path(args.pricing) if args.pricing else default_pricing_path()
    try:
        schedule = load_pricing(path)
    except PricingError as exc:
        print(f"cannot show pricing: {exc}")
        return 1
    print(f"prices in {path}")
    print(format_pricing(schedule))
    return 0
