"""`tenzro metering verify|bill|sla` and `tenzro provider pricing set|show`, driven through argparse."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from attestation.binding import BoundIdentity
from attestation.evidence import Evidence
from metering.bill import bill
from metering.ledger import Ledger
from metering.merkle import MerkleTree
from metering.pricing import PriceSchedule, load_pricing
from metering.record import Latency, RecordStatus, TokenCounts
from metering.signer import NodeSigner
from metering.tree_head import TreeHead
from node.cli_metering import add_metering_commands, format_time_ms, parse_time_ms, window_text
from node.identity import EVIDENCE_SUFFIX, boot_nonce

PRICES = PriceSchedule(
    input_price_wei=3, output_price_wei=11, cached_read_price_wei=1, cached_write_price_wei=5
)
SEED = bytes(range(32))
BOOT_ID = "boot-1"
NONE_EVIDENCE = Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None,
                         public_key=bytes.fromhex(NodeSigner.from_seed(SEED).public_key_hex), boot_id=BOOT_ID,
                         nonce=boot_nonce(BOOT_ID))
"""What a node without a TEE writes beside its segment: its own claim to the key, which no hardware vouches for."""
EVIDENCE_DIGEST = NONE_EVIDENCE.digest()
# Each command that reads a ledger, with the arguments it needs besides the ledger and the trust options, and
# the lines it prints after `metering verify`'s when the ledger does not verify.
COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "verify": ([], []),
    "bill": (["--caller", "caller-a"], ["no bill: the ledger was not verified"]),
    "sla": (["--caller", "caller-a", "--ttft-ms", "200"], ["no SLA report: the ledger was not verified"]),
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tenzro")
    add_metering_commands(parser.add_subparsers(dest="group", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


@pytest.fixture
def signer() -> NodeSigner:
    return NodeSigner.from_seed(SEED)


@pytest.fixture
def ledger(tmp_path: Path, signer: NodeSigner) -> Ledger:
    clock = iter(range(1_700_000_000_000, 1_700_000_100_000, 1000))
    ledger = Ledger(
        tmp_path / "ledger", signer, BOOT_ID, evidence_digest=EVIDENCE_DIGEST, clock_ms=lambda: next(clock)
    )
    (tmp_path / "ledger" / f"{BOOT_ID}{EVIDENCE_SUFFIX}").write_text(json.dumps(NONE_EVIDENCE.document()))
    rows: list[tuple[str, str, RecordStatus, TokenCounts, Latency]] = [
        # 30*3 + 60 + 50 + 220 = 420
        ("caller-a", "tiny", "completed", TokenCounts(100, 60, 10, 20), Latency(15, 180, 900)),
        ("caller-b", "tiny", "completed", TokenCounts(5, 0, 0, 5), Latency(0, 30, 60)),
        ("caller-a", "tiny", "cancelled", TokenCounts(40, 0, 40, 0), Latency(5, 0, 70)),  # 200, no first token
        ("caller-a", "big", "completed", TokenCounts(1000, 1000, 0, 1), Latency(120, 260, 300)),  # 1000 + 11
    ]
    for index, (caller, model, status, counts, latency) in enumerate(rows):
        ledger.append(
            record_id=f"chatcmpl-{index}",
            caller_id=caller,
            model=model,
            status=status,
            counts=counts,
            prices=PRICES,
            latency=latency,
        )
    ledger.close()
    return ledger


def test_every_command_sets_func() -> None:
    parser = argparse.ArgumentParser(prog="tenzro")
    add_metering_commands(parser.add_subparsers(dest="group", required=True))
    for argv in (
        ["metering", "verify", "x", "--node-key", "00"],
        ["metering", "bill", "x", "--caller", "c"],
        ["metering", "sla", "x", "--caller", "c", "--ttft-ms", "1"],
        ["provider", "pricing", "set"],
        ["provider", "pricing", "show"],
    ):
        assert callable(parser.parse_args(argv).func)


def test_bill_and_sla_take_verifys_trust_options() -> None:
    parser = argparse.ArgumentParser(prog="tenzro")
    add_metering_commands(parser.add_subparsers(dest="group", required=True))
    trust = ["--node-key", "k1", "--node-key", "k2", "--tree-head", "h.json", "--evidence", "e", "--trust-root", "r",
             "--allow-none"]
    parsed = {name: vars(parser.parse_args(["metering", name, "x", *trust, *extra]))
              for name, (extra, _) in COMMANDS.items()}
    for options in parsed.values():
        assert {key: options[key] for key in ("ledger", "node_key", "tree_head", "evidence", "trust_root",
                                              "allow_none")} == {
            "ledger": "x", "node_key": ["k1", "k2"], "tree_head": "h.json", "evidence": ["e"], "trust_root": "r",
            "allow_none": True,
        }


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_needs_to_be_told_whose_key_to_trust(
    ledger: Ledger, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    code, out = run(["metering", command, str(ledger.path), *extra], capsys)
    assert code == 2
    assert out.splitlines() == [
        "cannot verify: say whose key to trust: --node-key HEX, or the attestation evidence each segment names "
        "(--trust-root DIR, --evidence FILE, --allow-none)",
        *refusal,
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_record_whose_output_and_cost_were_changed_together(
    ledger: Ledger, signer: NodeSigner, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ledger.path.read_bytes().split(b"\n")
    # seq 0, caller-a: 20 output tokens at 11 wei cost 420 wei in all; one more token costs 431.
    changed = lines[1].replace(b'"cost_wei":"420"', b'"cost_wei":"431"').replace(b'"output_tokens":20,',
                                                                                b'"output_tokens":21,')
    assert changed.count(b'"cost_wei":"431"') == 1 and changed.count(b'"output_tokens":21,') == 1
    lines[1] = changed
    ledger.path.write_bytes(b"\n".join(lines))
    assert bill(ledger.path, "caller-a").total.output_tokens == 22  # counts and cost agree: only the signature tells
    extra, refusal = COMMANDS[command]
    code, out = run(["metering", command, str(ledger.path), "--node-key", signer.public_key_hex, *extra], capsys)
    assert code == 1
    assert out.splitlines() == [
        f"FAILED {ledger.path}: line 2, seq 0, record chatcmpl-0: bad-signature: signature does not verify "
        f"under public key {signer.key_id}; the data or the signature was changed, or another key signed it",
        f"0 records before it verified under key {signer.key_id}",
        *refusal,
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_checks_the_evidence_its_segments_name(
    ledger: Ledger, signer: NodeSigner, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    verified = f"OK {ledger.path}: 4 records verified under key {signer.key_id} (evidence {EVIDENCE_DIGEST}); "
    code, out = run(["metering", command, str(ledger.path), "--allow-none", *extra], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith(verified)
    assert out.splitlines()[1] == (
        f"UNATTESTED {ledger.path}: key named by none evidence {EVIDENCE_DIGEST}, which no TEE vouches for "
        "(accepted with --allow-none)"
    )

    (roots := tmp_path / "roots").mkdir()
    code, out = run(["metering", command, str(ledger.path), "--trust-root", str(roots), *extra], capsys)
    assert code == 1
    assert out.splitlines()[1:] == [
        f"FAILED {ledger.path}: its evidence does not verify: none-evidence: the node runs without a TEE (evidence "
        "type none); nothing binds its key to hardware. Allow it explicitly (allow_none / --allow-none) to accept "
        "it as untrusted",
        *refusal,
    ]

    (ledger.path.parent / f"{BOOT_ID}{EVIDENCE_SUFFIX}").unlink()
    code, out = run(["metering", command, str(ledger.path), "--allow-none", *extra], capsys)
    assert code == 1
    assert out.splitlines()[1:] == [
        f"FAILED {ledger.path}: no evidence document with digest {EVIDENCE_DIGEST} (give it with --evidence)",
        *refusal,
    ]


def test_verify_ok(ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["metering", "verify", str(ledger.path), "--node-key", signer.public_key_hex], capsys)
    assert code == 0
    assert out.startswith(
        f"OK {ledger.path}: 4 records verified under key {signer.key_id} (evidence {EVIDENCE_DIGEST}); Merkle root "
    )


def test_verify_names_the_first_bad_record(
    ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ledger.path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"output_tokens":5,', b'"output_tokens":4,')  # seq 1
    ledger.path.write_bytes(b"\n".join(lines))
    code, out = run(["metering", "verify", str(ledger.path), "--node-key", signer.public_key_hex], capsys)
    assert code == 1
    assert out.splitlines() == [
        f"FAILED {ledger.path}: line 3, seq 1, record chatcmpl-1: bad-signature: signature does not verify "
        f"under public key {signer.key_id}; the data or the signature was changed, or another key signed it",
        f"1 records before it verified under key {signer.key_id}",
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_checks_a_tree_head_file(
    ledger: Ledger, signer: NodeSigner, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    head_path = tmp_path / "head.json"
    record_lines = ledger.path.read_bytes().split(b"\n")[1:-1]
    head = TreeHead.sign(signer, 4, MerkleTree.from_leaves(record_lines).root(), 1, EVIDENCE_DIGEST)
    head_path.write_text(json.dumps(head.to_json()))
    extra, refusal = COMMANDS[command]
    args = ["metering", command, str(ledger.path), "--node-key", signer.public_key_hex, "--tree-head", str(head_path),
            *extra]
    code, out = run(args, capsys)
    assert code == 0
    assert ", tree head of 4 records; Merkle root " + head.root_hash_hex in out

    ledger.path.write_bytes(
        b"\n".join(ledger.path.read_bytes().split(b"\n")[:-2]) + b"\n"
    )  # last record deleted
    code, out = run(args, capsys)
    assert code == 1
    assert out.splitlines() == [
        f"FAILED {ledger.path}: seq 3: missing-records: the tree head covers 4 records, the segment has 3: "
        "records were deleted from the end",
        f"3 records before it verified under key {signer.key_id}, tree head of 4 records",
        *refusal,
    ]


def test_verify_with_unusable_key(ledger: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["metering", "verify", str(ledger.path), "--node-key", "xyz"], capsys)
    assert code == 1
    assert out == "cannot verify: public key must be 64 hex characters, got 'xyz'\n"


def test_bill_prints_rows_and_totals(
    ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["metering", "bill", str(ledger.path.parent), "--caller", "caller-a", "--node-key", signer.public_key_hex]
    code, out = run(argv, capsys)
    assert code == 0
    assert out.splitlines() == [
        *verified_lines(ledger, signer),
        "caller caller-a, all records, 1 segment(s)",
        "model  status     records  input  cached_read  cached_write  output  cost_wei",
        "big    completed        1   1000         1000             0       1      1011",
        "tiny   cancelled        1     40            0            40       0       200",
        "tiny   completed        1    100           60            10      20       420",
        "TOTAL                   3   1140         1060            50      21      1631",
    ]


def test_bill_window_in_iso_and_ms(ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]) -> None:
    # The header took 1700000000000; records are stamped 1700000001000 + 1000 * seq.
    argv = ["metering", "bill", str(ledger.path), "--caller", "caller-a", "--node-key", signer.public_key_hex]
    code, out = run([*argv, "--since", "2023-11-14T22:13:22Z", "--until", "1700000004000"], capsys)
    assert code == 0
    assert out.splitlines()[1] == (
        "caller caller-a, records from 2023-11-14T22:13:22Z (inclusive) to 2023-11-14T22:13:24Z (exclusive), "
        "1 segment(s)"
    )
    assert out.splitlines()[-1].split() == ["TOTAL", "1", "40", "0", "40", "0", "200"]


def test_bill_with_bad_time(ledger: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["metering", "bill", str(ledger.path), "--caller", "a", "--since", "yesterday"], capsys)
    assert code == 1
    assert (
        out == "cannot bill: 'yesterday' is neither Unix milliseconds nor ISO 8601 (2025-01-31T12:00:00Z)\n"
    )


def verified_lines(ledger: Ledger, signer: NodeSigner) -> list[str]:
    """The verification line `metering bill` and `metering sla` print for the fixture's segment."""
    root = MerkleTree.from_leaves(ledger.path.read_bytes().split(b"\n")[1:-1]).root().hex()
    return [f"OK {ledger.path}: 4 records verified under key {signer.key_id} (evidence {EVIDENCE_DIGEST}); "
            f"Merkle root {root}"]


def test_sla_numbers_are_the_records_times(
    ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]
) -> None:
    # caller-a's first tokens: 180 and 260 ms (the cancelled record got none); totals: 900, 70 and 300 ms.
    argv = ["metering", "sla", str(ledger.path.parent), "--caller", "caller-a", "--ttft-ms", "200", "--node-key",
            signer.public_key_hex]
    code, out = run(argv, capsys)
    assert code == 0
    assert out.splitlines() == [
        *verified_lines(ledger, signer),
        "caller caller-a, every model, all records, 1 segment(s)",
        "requests 3, with a first token 2",
        "ttft_ms <= 200: 1/3 = 33.33%",
        "ms        p50  p90  p99",
        "ttft_ms   180  260  260",
        "total_ms  300  900  900",
    ]


def test_sla_of_one_model_in_a_window(
    ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]
) -> None:
    # Records are stamped 1700000001000 + 1000 * seq: the window holds seq 0 to 2.
    argv = ["metering", "sla", str(ledger.path), "--caller", "caller-a", "--ttft-ms", "180", "--model", "tiny",
            "--since", "1700000001000", "--until", "2023-11-14T22:13:24Z", "--node-key", signer.public_key_hex]
    code, out = run(argv, capsys)
    assert code == 0
    assert out.splitlines()[1:] == [
        "caller caller-a, model tiny, records from 2023-11-14T22:13:21Z (inclusive) to 2023-11-14T22:13:24Z "
        "(exclusive), 1 segment(s)",
        "requests 2, with a first token 1",
        "ttft_ms <= 180: 1/2 = 50.00%",
        "ms        p50  p90  p99",
        "ttft_ms   180  180  180",
        "total_ms   70  900  900",
    ]


def test_sla_without_requests(ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["metering", "sla", str(ledger.path), "--caller", "nobody", "--ttft-ms", "1", "--until", "1700000004001"]
    code, out = run([*argv, "--node-key", signer.public_key_hex], capsys)
    assert code == 0
    assert out.splitlines()[1:] == [
        "caller nobody, every model, records before 2023-11-14T22:13:24.001Z, 1 segment(s)",
        "requests 0, with a first token 0",
        "ttft_ms <= 1: 0/0 (no requests)",
        "ms        p50  p90  p99",
        "ttft_ms     -    -    -",
        "total_ms    -    -    -",
    ]


def test_sla_over_every_start_of_a_ledger_directory(
    ledger: Ledger, signer: NodeSigner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = NodeSigner.from_seed(bytes(range(32, 64)))  # the next start's key
    with Ledger(ledger.path.parent, other, "boot-2", evidence_digest="e2" * 32) as second:
        second.append(record_id="chatcmpl-9", caller_id="caller-a", model="tiny", status="completed",
                      counts=TokenCounts(3, 0, 0, 2), prices=PRICES, latency=Latency(0, 90, 95))
    argv = ["metering", "sla", str(ledger.path.parent), "--caller", "caller-a", "--ttft-ms", "200", "--node-key",
            signer.public_key_hex]
    code, out = run([*argv, "--node-key", other.public_key_hex], capsys)  # each start's key trusted
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == verified_lines(ledger, signer)[0]
    assert lines[1].startswith(
        f"OK {second.path}: 1 records verified under key {other.key_id} (evidence {'e2' * 32}); Merkle root "
    )
    assert lines[2:] == [
        "caller caller-a, every model, all records, 2 segment(s)",
        "requests 4, with a first token 3",
        "ttft_ms <= 200: 2/4 = 50.00%",  # 90 and 180 of 90, 180, 260
        "ms        p50  p90  p99",
        "ttft_ms   180  260  260",
        "total_ms   95  900  900",  # of 70, 95, 300, 900
    ]
    code, out = run(argv, capsys)  # only the first start's key trusted
    assert code == 1
    assert out.splitlines()[1:] == [
        f"FAILED {second.path}: line 1: foreign-key: segment is signed by key {other.key_id}, which is not a "
        f"trusted key ({signer.key_id})",
        f"0 records before it verified under key {other.key_id}",
        "no SLA report: the ledger was not verified",
    ]


def test_sla_refuses_a_ledger_that_does_not_verify(
    ledger: Ledger, signer: NodeSigner, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ledger.path.read_bytes().split(b"\n")
    assert b'"ttft_ms":260}' in lines[4]  # seq 3: its first token came too late for a 200 ms promise
    lines[4] = lines[4].replace(b'"ttft_ms":260}', b'"ttft_ms":199}')
    ledger.path.write_bytes(b"\n".join(lines))
    argv = ["metering", "sla", str(ledger.path), "--caller", "caller-a", "--ttft-ms", "200"]
    code, out = run([*argv, "--node-key", signer.public_key_hex], capsys)
    assert code == 1
    assert out.splitlines()[0].startswith(f"FAILED {ledger.path}: line 5, seq 3, record chatcmpl-3: bad-signature")
    assert out.splitlines()[-1] == "no SLA report: the ledger was not verified"


@pytest.mark.parametrize(("extra", "messages"), [
    (["--ttft-ms", "-1", "--allow-none"], ["cannot report: the promised time to first token must be a non-negative "
                                           "integer (ms), got -1"]),
    (["--ttft-ms", "1", "--node-key", "xyz"], ["cannot verify: public key must be 64 hex characters, got 'xyz'",
                                               "no SLA report: the ledger was not verified"]),
    (["--ttft-ms", "1", "--until", "soon"], ["cannot report: 'soon' is neither Unix milliseconds nor ISO 8601 "
                                             "(2025-01-31T12:00:00Z)"]),
])
def test_sla_errors(ledger: Ledger, capsys: pytest.CaptureFixture[str], extra: list[str], messages: list[str]) -> None:
    code, out = run(["metering", "sla", str(ledger.path), "--caller", "caller-a", *extra], capsys)
    assert code == 1
    assert out.splitlines()[-len(messages):] == messages


def test_parse_time_ms() -> None:
    assert parse_time_ms("1700000000000") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T22:13:20") == 1_700_000_000_000  # no offset: UTC
    assert parse_time_ms("2023-11-15T00:13:20.5+02:00") == 1_700_000_000_500


def test_times_print_as_utc_iso_8601_that_parse_back() -> None:
    for unix_ms, text in ((1_700_000_000_000, "2023-11-14T22:13:20Z"), (1_700_000_000_500, "2023-11-14T22:13:20.500Z"),
                          (0, "1970-01-01T00:00:00Z"), (-1, "1969-12-31T23:59:59.999Z")):
        assert format_time_ms(unix_ms) == text
        assert parse_time_ms(text) == unix_ms
    assert window_text(None, None) == "all records"
    assert window_text(1_700_000_000_000, None) == "records from 2023-11-14T22:13:20Z on"
    assert window_text(None, 1_700_000_000_000) == "records before 2023-11-14T22:13:20Z"


def test_pricing_set_starts_from_defaults_and_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TENZRO_HOME", str(tmp_path / "home"))
    code, out = run(
        ["provider", "pricing", "set", "--input-price-wei", "7", "--price-per-cached-read-token-wei", "1"],
        capsys,
    )
    path = tmp_path / "home" / "pricing.yaml"
    assert code == 0
    assert out.splitlines() == [
        f"prices written to {path}",
        "input-price-wei: 7",
        "output-price-wei: 4000000000",
        "price-per-cached-read-token-wei: 1",
        "price-per-cached-write-token-wei: 1250000000",
        "price-per-cached-write-1h-token-wei: 1250000000 (the cached write price)",
        "price-per-cached-write-24h-token-wei: 1250000000 (the cached write price)",
        "price-per-image-wei: 0",
    ]
    assert load_pricing(path) == PriceSchedule(7, 4_000_000_000, 1, 1_250_000_000)

    code, out = run(["provider", "pricing", "set", "--output-price-wei", "9"], capsys)
    assert load_pricing(path) == PriceSchedule(7, 9, 1, 1_250_000_000)
    code, out = run(["provider", "pricing", "show"], capsys)
    assert code == 0
    assert out.splitlines()[0] == f"prices in {path}"
    assert out.splitlines()[2] == "output-price-wei: 9"
    code, out = run(["provider", "pricing", "set", "--price-per-cached-write-1h-token-wei", "2000000000",
                     "--price-per-cached-write-24h-token-wei", "3000000000", "--price-per-image-wei", "40"], capsys)
    assert load_pricing(path) == PriceSchedule(7, 9, 1, 1_250_000_000, 2_000_000_000, 3_000_000_000, 40)
    code, out = run(["provider", "pricing", "show"], capsys)
    assert out.splitlines()[-3:] == ["price-per-cached-write-1h-token-wei: 2000000000",
                                     "price-per-cached-write-24h-token-wei: 3000000000",
                                     "price-per-image-wei: 40"]


def test_pricing_with_explicit_file_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    code, out = run(["provider", "pricing", "show", "--pricing", str(path)], capsys)
    assert code == 1
    assert out == (
        f"cannot show pricing: price file {path} does not exist; "
        "create it with `tenzro provider pricing set`\n"
    )
    code, out = run(
        ["provider", "pricing", "set", "--pricing", str(path), "--output-price-wei", "-1"], capsys
    )
    assert code == 1
    assert out == "cannot set pricing: output_price_wei must be a non-negative integer (wei), got -1\n"
    assert not path.exists()


def test_verify_shows_the_code_and_models_a_segment_names(tmp_path: Path, signer: NodeSigner,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ledger = Ledger(tmp_path / "ledger", signer, BOOT_ID, evidence_digest=EVIDENCE_DIGEST, clock_ms=lambda: 5,
                    code_digest="c0" * 32, model_digests={"default": "a1" * 32})
    ledger.close()
    code, out = run(["metering", "verify", str(ledger.path), "--node-key", signer.public_key_hex], capsys)
    assert code == 0
    assert out == (f"OK {ledger.path}: 0 records verified under key {signer.key_id} (evidence {EVIDENCE_DIGEST}; "
                   f"code {'c0' * 32}; model default {'a1' * 32}); Merkle root {MerkleTree().root().hex()}\n")


CODE, WEIGHTS = "c0" * 32, "a1" * 32
NONE_EVIDENCE_V2 = Evidence(
    evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=NONE_EVIDENCE.public_key,
    boot_id=BOOT_ID, nonce=boot_nonce(BOOT_ID), bound=BoundIdentity.of(
        tls_spki_sha256=None, code_digest=bytes.fromhex(CODE), model_digests=[("tiny", bytes.fromhex(WEIGHTS))]))
"""What a plain-HTTP node without a TEE writes since binding v2: its key, code and model, claimed by itself."""


@pytest.fixture
def v2_ledger(tmp_path: Path, signer: NodeSigner) -> Ledger:
    """One record, signed under the key NONE_EVIDENCE_V2 names, which sits beside the segment."""
    with Ledger(tmp_path / "v2", signer, BOOT_ID, evidence_digest=NONE_EVIDENCE_V2.digest(), clock_ms=lambda: 5,
                code_digest=CODE, model_digests={"tiny": WEIGHTS}) as ledger:
        ledger.append(record_id="chatcmpl-0", caller_id="caller-a", model="tiny", status="completed",
                      counts=TokenCounts(3, 0, 0, 2), prices=PRICES, latency=Latency(0, 90, 95))
    (tmp_path / "v2" / f"{BOOT_ID}{EVIDENCE_SUFFIX}").write_text(json.dumps(NONE_EVIDENCE_V2.document()))
    return ledger


def none_policy(tmp_path: Path, **changes: object) -> str:
    """A development policy: none evidence allowed, the code and model of NONE_EVIDENCE_V2 pinned."""
    raw = {"tee_types": ["none"], "allow_none": True, "roots": None, "measurements": "any", "rtmrs": "any",
           "min_tcb": "any", "code_digests": [CODE], "model_digests": {"tiny": [WEIGHTS]}, "gpu": "optional",
           **changes}
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_judges_the_evidence_by_a_trust_policy(
    v2_ledger: Ledger, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, _ = COMMANDS[command]
    argv = ["metering", command, str(v2_ledger.path), "--allow-none", "--trust-policy", none_policy(tmp_path), *extra]
    code, out = run(argv, capsys)
    assert code == 0
    assert out.splitlines()[1:6] == [
        f"UNATTESTED {v2_ledger.path}: key named by none evidence {NONE_EVIDENCE_V2.digest()}, which no TEE vouches "
        "for (accepted with --allow-none)",
        "trust policy: OK, UNTRUSTED (none evidence, accepted by allow_none)",
        f"  code_digests: {CODE} (pinned)",
        f"  model_digests: tiny {WEIGHTS} (pinned)",
        "  measurements: any (not pinned)",
    ]
    report = {"verify": [], "bill": ["caller caller-a, all records, 1 segment(s)"],
              "sla": ["caller caller-a, every model, all records, 1 segment(s)"]}[command]
    assert out.splitlines()[6:7] == report


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("changes", "reason"), [
    ({"code_digests": ["c1" * 32]},
     f"code-not-accepted: the node runs code {CODE}, which code_digests does not accept"),
    ({"model_digests": {"tiny": ["a2" * 32]}},
     f"model-not-accepted: the node serves tiny with weights {WEIGHTS}, which model_digests does not accept"),
    ({"measurements": ["ee" * 48]},
     "workload-not-accepted: the launch measurement (measurement) none is not one measurements accepts"),
], ids=["code", "model", "measurement"])
def test_every_command_refuses_what_the_trust_policy_does_not_accept_naming_it(
    v2_ledger: Ledger, tmp_path: Path, command: str, changes: dict[str, object], reason: str,
    capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    argv = ["metering", command, str(v2_ledger.path), "--allow-none", "--trust-policy",
            none_policy(tmp_path, **changes), *extra]
    code, out = run(argv, capsys)
    assert code == 1
    assert out.splitlines()[2:] == ["trust policy: REFUSED", f"  {reason}", *refusal]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_none_evidence_without_allow_none_whatever_the_policy_allows(
    v2_ledger: Ledger, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    code, out = run(["metering", command, str(v2_ledger.path), "--trust-policy", none_policy(tmp_path), *extra],
                    capsys)
    assert code == 1
    assert out.splitlines()[1:] == [
        f"FAILED {v2_ledger.path}: its evidence does not verify: none-evidence: the node runs without a TEE (evidence "
        "type none); nothing binds its key to hardware. Allow it explicitly (allow_none / --allow-none) to accept "
        "it as untrusted",
        *refusal,
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_malformed_trust_policy(
    v2_ledger: Ledger, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    argv = ["metering", command, str(v2_ledger.path), "--allow-none", "--trust-policy",
            none_policy(tmp_path, gpu="maybe"), *extra]
    code, out = run(argv, capsys)
    assert code == 2
    assert out.splitlines() == ["cannot verify: gpu: one of optional, required", *refusal]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_collateral_from_the_flag_or_the_policy(
    v2_ledger: Ledger, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, refusal = COMMANDS[command]
    absent = tmp_path / "absent"
    argv = ["metering", command, str(v2_ledger.path), "--allow-none", "--collateral", str(absent), *extra]
    code, out = run(argv, capsys)
    assert code == 1
    assert out.splitlines() == [f"cannot verify: missing-collateral: collateral directory {absent} does not exist",
                                *refusal]
    policy = none_policy(tmp_path, collateral="from-policy")
    code, out = run(["metering", command, str(v2_ledger.path), "--allow-none", "--trust-policy", policy, *extra],
                    capsys)
    assert code == 1
    assert out.splitlines()[0] == (
        f"cannot verify: missing-collateral: collateral directory {tmp_path / 'from-policy'} does not exist")
    (tmp_path / "empty").mkdir()
    code, out = run(["metering", command, str(v2_ledger.path), "--allow-none", "--trust-policy", policy,
                     "--collateral", str(tmp_path / "empty"), *extra], capsys)
    assert code == 0
