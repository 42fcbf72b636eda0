"""The `tenzro metering ...` and `tenzro provider pricing ...` commands: offline ledger checks and prices.

Kept apart from the serving CLI so that auditors can run verification without the engine: this
module imports only the standard library, `metering` and `attestation` (and `node.identity`'s boot nonce).

`metering verify` checks each segment's signatures and chain, and then whom the key belongs to: either keys
the auditor trusts (`--node-key`), or the attestation evidence each segment names (`--evidence`, by default
the `<boot_id>.evidence.json` files the node writes beside its segments): the evidence must verify (against
`--trust-root`; `none` evidence only with `--allow-none`, and then it is reported unattested), be the boot's
own (its nonce derived from the boot id), and bind the very key that signs the segment; with `--trust-policy` (the
caller's policy, as `tenzro attest verify` takes it) what the evidence proves must then be what the policy accepts,
its roots and collateral serving when `--trust-root` and `--collateral` are not given (the collateral, Intel TCB
info and QE identity and vendor CRLs, is what TCB status and revocation are judged by). `metering bill` and
`metering sla` take the same options and run the same verification first: a number read from a ledger proves only
what its verification proves, so a ledger `verify` refuses gets neither a bill nor an SLA report.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from attestation.chain import TrustRoots, load_trust_roots
from attestation.cli import NO_TRUST_ROOTS, judge, policy_lines
from attestation.collateral import NO_COLLATERAL, Collateral, load_collateral
from attestation.errors import MalformedEvidence, VerificationError
from attestation.evidence import evidence_digest
from attestation.trust_policy import TrustPolicy, TrustPolicyError, presented_by
from attestation.verdict import description
from attestation.verify import verify_evidence
from metering.bill import Bill, UsageTotals, bill
from metering.pricing import (
    DEFAULT_PRICING,
    PRICE_FIELDS,
    PriceSchedule,
    PricingError,
    load_pricing,
    save_pricing,
)
from metering.segment import SegmentFormatError, read_header, segment_files
from metering.signer import SignatureInvalid
from metering.sla import Percentiles, SlaReport, sla
from metering.tree_head import TreeHeadError
from metering.verify import VerifyReport, verify_ledger, verify_segment
from node.identity import EVIDENCE_SUFFIX, boot_nonce

Command = Callable[[argparse.Namespace], int]

# Command-line flag -> PriceSchedule field. The cached flags keep the names the operator docs use.
PRICE_FLAGS: dict[str, str] = {
    "--input-price-wei": "input_price_wei",
    "--output-price-wei": "output_price_wei",
    "--price-per-cached-read-token-wei": "cached_read_price_wei",
    "--price-per-cached-write-token-wei": "cached_write_price_wei",
    "--price-per-cached-write-1h-token-wei": "cached_write_1h_price_wei",
    "--price-per-cached-write-24h-token-wei": "cached_write_24h_price_wei",
    "--price-per-image-wei": "image_price_wei",
}
assert sorted(PRICE_FLAGS.values()) == sorted(PRICE_FIELDS)


def tenzro_home() -> Path:
    """$TENZRO_HOME, or ~/.tenzro (the same rule as `node.config`, which this module may not import)."""
    return Path(os.environ.get("TENZRO_HOME", "~/.tenzro")).expanduser()


def default_pricing_path() -> Path:
    return tenzro_home() / "pricing.yaml"


def add_metering_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `metering {verify,bill,sla}` and `provider pricing {set,show}` to a CLI's subcommands.

    Every leaf parser sets `func`, a callable taking the parsed Namespace and returning the exit code.
    A CLI that already has its own `provider` parser calls `add_pricing_commands` on it instead.
    """
    metering = subparsers.add_parser("metering", help="verify signed usage ledgers and bill callers")
    metering_commands = metering.add_subparsers(dest="metering_command", required=True)

    verify = metering_commands.add_parser("verify", help="verify a ledger offline, and whose key signed it")
    _add_ledger_arguments(verify)
    verify.set_defaults(func=run_verify)

    bill_parser = metering_commands.add_parser(
        "bill", help="verify a ledger as `metering verify` does, then total a caller's usage and cost"
    )
    _add_ledger_arguments(bill_parser)
    bill_parser.add_argument("--caller", required=True, metavar="ID", help="caller id to bill")
    _add_window_arguments(bill_parser)
    bill_parser.set_defaults(func=run_bill)

    sla_parser = metering_commands.add_parser(
        "sla", help="verify a ledger as `metering verify` does, then check a caller's time to first token "
        "against a promise"
    )
    _add_ledger_arguments(sla_parser)
    sla_parser.add_argument("--caller", required=True, metavar="ID", help="caller id to report on")
    sla_parser.add_argument(
        "--ttft-ms", required=True, type=int, metavar="N", help="promised time to first token, ms from enqueue"
    )
    sla_parser.add_argument("--model", metavar="M", help="only this model's records")
    _add_window_arguments(sla_parser)
    sla_parser.set_defaults(func=run_sla)

    provider = subparsers.add_parser("provider", help="provider settings")
    add_pricing_commands(provider.add_subparsers(dest="provider_command", required=True))


def _add_ledger_arguments(parser: argparse.ArgumentParser) -> None:
    """The ledger and the options saying whose key to trust: one definition for every command that reads a
    ledger, so that `bill` and `sla` accept exactly the ledgers `verify` accepts (see `run_verify`)."""
    parser.add_argument("ledger", metavar="LEDGER", help="segment file (ledger-<boot_id>.jsonl) or ledger directory")
    parser.add_argument("--node-key", action="append", default=[], metavar="HEX",
                        help="trusted node public key, 64 hex; repeat for each node start")
    parser.add_argument("--tree-head", metavar="FILE", help="signed tree head JSON a single segment must match")
    parser.add_argument("--evidence", action="append", default=[], metavar="FILE|DIR",
                        help="attestation evidence documents (default with --trust-root or --allow-none: the "
                             "*.evidence.json beside the segments); each segment's key must be the one its "
                             "evidence binds")
    parser.add_argument("--trust-root", metavar="DIR", help="trust roots for the evidence: ark.pem, ask.pem, "
                        "intel_root.pem (see `tenzro attest verify`)")
    parser.add_argument("--collateral", metavar="DIR",
                        help="vendor collateral for the evidence (tenzro attest fetch-collateral --out DIR); the "
                             "trust policy's collateral serves without it")
    parser.add_argument("--allow-none", action="store_true",
                        help="accept evidence of type none (a node without a TEE), reported as unattested")
    parser.add_argument("--trust-policy", metavar="FILE",
                        help="trust policy (YAML, as `tenzro client verify` takes): each segment's evidence must "
                             "prove a measurement, code and models it accepts; its roots serve without --trust-root; "
                             "none evidence still needs --allow-none")


def _add_window_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", metavar="TIME", help="inclusive start: ISO 8601 or Unix ms")
    parser.add_argument("--until", metavar="TIME", help="exclusive end: ISO 8601 or Unix ms")


def _window_ms(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The --since and --until times, in Unix ms."""
    return (
        None if args.since is None else parse_time_ms(args.since),
        None if args.until is None else parse_time_ms(args.until),
    )


def window_text(since_ms: int | None, until_ms: int | None) -> str:
    """The window a report covers, in UTC times a reader can check against the --since and --until given."""
    since = None if since_ms is None else format_time_ms(since_ms)
    until = None if until_ms is None else format_time_ms(until_ms)
    if since is None:
        return "all records" if until is None else f"records before {until}"
    if until is None:
        return f"records from {since} on"
    return f"records from {since} (inclusive) to {until} (exclusive)"


def add_pricing_commands(provider_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `pricing {set,show}` under an existing `provider` parser's subcommands."""
    pricing = provider_subparsers.add_parser("pricing", help="per-token prices in wei")
    pricing_commands = pricing.add_subparsers(dest="pricing_command", required=True)

    set_parser = pricing_commands.add_parser(
        "set", help="change prices; fields not given keep their current (or default) value"
    )
    for flag, field in PRICE_FLAGS.items():
        set_parser.add_argument(
            flag, dest=field, type=int, metavar="N",
            help=f"{field}, integer wei per {'image' if field == 'image_price_wei' else 'token'}"
        )
    set_parser.add_argument(
        "--pricing", metavar="FILE", help="price file (default $TENZRO_HOME/pricing.yaml)"
    )
    set_parser.set_defaults(func=run_pricing_set)

    show = pricing_commands.add_parser("show", help="print the prices in force")
    show.add_argument("--pricing", metavar="FILE", help="price file (default $TENZRO_HOME/pricing.yaml)")
    show.set_defaults(func=run_pricing_show)


def run_verify(args: argparse.Namespace) -> int:
    """Verify every segment under the options of `_add_ledger_arguments`, a line per segment and per evidence.

    Returns the exit code: 0 when every segment verifies, 1 when one does not, 2 when no trust was named.
    `run_bill` and `run_sla` call it first.
    """
    attested = bool(args.evidence or args.trust_root or args.allow_none or args.trust_policy)
    if not args.node_key and not attested:
        print("cannot verify: say whose key to trust: --node-key HEX, or the attestation evidence each segment "
              "names (--trust-root DIR, --evidence FILE, --allow-none)")
        return 2
    try:
        policy = None if args.trust_policy is None else TrustPolicy.load(Path(args.trust_policy))
    except TrustPolicyError as exc:
        print(f"cannot verify: {exc}")
        return 2
    roots_directory = args.trust_root or (policy.roots if policy is not None else None)
    collateral_directory = args.collateral or (policy.collateral if policy is not None else None)
    try:
        if args.tree_head:
            segments = segment_files(args.ledger)
            if len(segments) != 1:
                print("cannot verify: --tree-head checks one segment; name its file")
                return 2
            key = args.node_key[0] if args.node_key else read_header(segments[0]).public_key
            reports: tuple[VerifyReport, ...] = (verify_segment(segments[0], key, args.tree_head),)
        else:
            reports = verify_ledger(args.ledger, args.node_key)
        documents = _evidence_documents(args.evidence or [Path(args.ledger) if Path(args.ledger).is_dir()
                                                          else Path(args.ledger).parent]) if attested else {}
        roots = load_trust_roots(roots_directory) if roots_directory else NO_TRUST_ROOTS
        collateral = load_collateral(collateral_directory) if collateral_directory else NO_COLLATERAL
    except (OSError, SignatureInvalid, TreeHeadError, SegmentFormatError, VerificationError,
            MalformedEvidence) as exc:
        print(f"cannot verify: {exc}")
        return 1
    if not reports:
        print(f"cannot verify: no ledger segment in {args.ledger}")
        return 1
    ok = True
    for report in reports:
        print(format_verify_report(report))
        ok &= report.ok
        if attested and report.ok:
            line, attested_ok = attest_segment(report, documents, roots, args.allow_none, policy, collateral)
            print(line)
            ok &= attested_ok
    return 0 if ok else 1


def _evidence_documents(paths: list[Path]) -> dict[str, dict[str, object]]:
    """Evidence documents by digest, from files and from directories' *.evidence.json."""
    files = [file for path in map(Path, paths)
             for file in (sorted(path.glob(f"*{EVIDENCE_SUFFIX}")) if path.is_dir() else [path])]
    documents = {}
    for file in files:
        try:
            document = json.loads(file.read_text())
            documents[evidence_digest(document)] = document
        except (ValueError, TypeError, MalformedEvidence) as exc:
            raise MalformedEvidence(f"{file} is not an evidence document: {exc}") from exc
    return documents


def attest_segment(report: VerifyReport, documents: dict[str, dict[str, object]], roots: TrustRoots,
                   allow_none: bool, policy: TrustPolicy | None = None,
                   collateral: Collateral = NO_COLLATERAL) -> tuple[str, bool]:
    """Whether the evidence a verified segment names verifies and binds the key that signed the segment, and then
    whether `policy` accepts what it proves (the verdict's lines follow the segment's)."""
    header = report.header
    assert header is not None  # the segment verified
    document = documents.get(header.evidence_digest)
    if document is None:
        return (f"FAILED {report.path}: no evidence document with digest {header.evidence_digest} "
                "(give it with --evidence)"), False
    try:
        result = verify_evidence(document, roots, expected_nonce=boot_nonce(header.boot_id), allow_none=allow_none,
                                 collateral=collateral)
    except VerificationError as exc:
        return f"FAILED {report.path}: its evidence does not verify: {exc.reason}: {exc.message}", False
    if result.public_key_hex != header.public_key:
        return (f"FAILED {report.path}: signed by key {header.public_key}, but its evidence binds key "
                f"{result.public_key_hex}"), False
    if not result.trusted:  # none evidence: a claim by the node itself, accepted only because it was allowed
        line = (f"UNATTESTED {report.path}: key named by {result.evidence_type} evidence {result.digest}, "
                "which no TEE vouches for (accepted with --allow-none)")
    else:  # without a policy nothing pinned the workload: the line says so, and what was not checked
        line = f"ATTESTED {report.path}: key bound by {result.evidence_type} evidence {result.digest}"
        if policy is None:
            line += f"; {description(presented_by(result), [])}"
    if policy is None:
        return line, True
    verdict = judge(policy, result)
    return "\n".join([line, *policy_lines(verdict)]), verdict.ok


def format_verify_report(report: VerifyReport) -> str:
    """One line when the segment verifies (with the attestation evidence it names, and the code and models when its
    header names them), two when it does not."""
    head = "" if report.tree_head_size is None else f", tree head of {report.tree_head_size} records"
    if report.ok:
        assert report.header is not None  # the segment verified
        served = "" if report.header.code_digest is None else f"; code {report.header.code_digest}"
        served += "".join(f"; model {model_id} {digest}" for model_id, digest in report.header.model_digests or ())
        return (
            f"OK {report.path}: {report.good_records} records verified under key {report.node_key_id} "
            f"(evidence {report.evidence_digest}{served}){head}; Merkle root {report.root_hash_hex}"
        )
    return (
        f"FAILED {report.path}: {report.problem}\n"
        f"{report.good_records} records before it verified under key {report.node_key_id}{head}"
    )


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


UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def format_time_ms(unix_ms: int) -> str:
    """ISO 8601 in UTC, to the millisecond when it has one: the form `parse_time_ms` reads back exactly."""
    moment = UNIX_EPOCH + timedelta(milliseconds=unix_ms)
    return moment.isoformat(timespec="milliseconds" if unix_ms % 1000 else "seconds").replace("+00:00", "Z")


def run_bill(args: argparse.Namespace) -> int:
    """Verify every segment first: a bill read from a ledger that does not verify proves nothing."""
    return _verified_report(args, "bill", "cannot bill", lambda since_ms, until_ms: format_bill(
        bill(args.ledger, args.caller, since_ms, until_ms)))


def _verified_report(args: argparse.Namespace, product: str, failure: str,
                     report: Callable[[int | None, int | None], str]) -> int:
    """Print `report(since_ms, until_ms)` for `args`' window once every segment verified (`_verify_first`)."""
    try:
        since_ms, until_ms = _window_ms(args)
    except ValueError as exc:
        print(f"{failure}: {exc}")
        return 1
    if (verified := _verify_first(args, product)) != 0:
        return verified
    try:
        text = report(since_ms, until_ms)
    except (OSError, SegmentFormatError, ValueError) as exc:
        print(f"{failure}: {exc}")
        return 1
    print(text)
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
    window = window_text(result.since_ms, result.until_ms)
    rows: list[tuple[str, ...]] = [_BILL_COLUMNS]
    rows += [_bill_row(line.model, line.status, line.totals) for line in result.lines]
    rows.append(_bill_row("TOTAL", "", result.total))
    return "\n".join([f"caller {result.caller_id}, {window}, {result.segments} segment(s)", *_table(rows, 2)])


def _table(rows: list[tuple[str, ...]], text_columns: int) -> list[str]:
    """Fixed-width lines: the first `text_columns` columns left-aligned, the numbers after them right-aligned."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if column < text_columns else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _verify_first(args: argparse.Namespace, product: str) -> int:
    """`run_verify`'s exit code, with a last line saying that `product` was withheld when it is not 0."""
    verified = run_verify(args)
    if verified != 0:
        print(f"no {product}: the ledger was not verified")
    return verified


def run_sla(args: argparse.Namespace) -> int:
    """Verify every segment first: numbers read from a ledger that does not verify prove nothing."""
    return _verified_report(args, "SLA report", "cannot report", lambda since_ms, until_ms: format_sla(
        sla(args.ledger, args.caller, args.ttft_ms, since_ms, until_ms, args.model)))


def _percentile_row(name: str, percentiles: Percentiles | None) -> tuple[str, ...]:
    if percentiles is None:
        return (name, "-", "-", "-")
    return (name, str(percentiles.p50), str(percentiles.p90), str(percentiles.p99))


def format_sla(result: SlaReport) -> str:
    """The window, the share of requests whose first token came in time, and a table of percentiles."""
    window = window_text(result.since_ms, result.until_ms)
    model = "every model" if result.model is None else f"model {result.model}"
    share = f"{result.met}/{result.requests}"
    basis_points = result.met_basis_points
    share += " (no requests)" if basis_points is None else f" = {basis_points // 100}.{basis_points % 100:02d}%"
    rows = [
        ("ms", "p50", "p90", "p99"),
        _percentile_row("ttft_ms", result.ttft_ms),
        _percentile_row("total_ms", result.total_ms),
    ]
    return "\n".join([
        f"caller {result.caller_id}, {model}, {window}, {result.segments} segment(s)",
        f"requests {result.requests}, with a first token {result.first_tokens}",
        f"ttft_ms <= {result.ttft_limit_ms}: {share}",
        *_table(rows, 1),
    ])


def format_pricing(schedule: PriceSchedule) -> str:
    """One line per flag; a class write price left unset shows the plain write price it charges."""
    lines = []
    for flag, field in PRICE_FLAGS.items():
        value = getattr(schedule, field)
        shown = f"{schedule.cached_write_price_wei} (the cached write price)" if value is None else str(value)
        lines.append(f"{flag.lstrip('-')}: {shown}")
    return "\n".join(lines)


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
