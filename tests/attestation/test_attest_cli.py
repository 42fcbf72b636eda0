"""`tenzro attest verify`: one line per passed check and exit 0, or the reason and exit 1."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from amd_forge import (
    BOOT_ID,
    BOUND,
    CODE_DIGEST,
    MEASUREMENT,
    MODEL_DIGEST,
    NODE_KEY,
    NONCE,
    REPORT_DATA_V2,
    AmdPki,
    snp_evidence,
    snp_report,
    vcek_and_ask,
)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.cli import add_verify_parser, main, run_verify
from attestation.evidence import Evidence

ROOT = Path(__file__).resolve().parents[2]
NONE = Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=NODE_KEY,
                boot_id=BOOT_ID, nonce=NONCE)


def write(tmp_path: Path, evidence: Evidence) -> Path:
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps(evidence.document()))
    return path


@pytest.fixture
def snp_file(tmp_path: Path, amd: AmdPki, vcek: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> Path:
    return write(tmp_path, snp_evidence(snp_report(vcek[0]), vcek_and_ask(amd, vcek[1])))


def test_allowed_none_evidence_prints_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, NONE)
    code = main(["verify", str(path), "--trust-root", str(tmp_path), "--nonce", NONCE.hex(), "--allow-none"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == [
        "ok evidence: none: no TEE report; accepted because none evidence was allowed, UNTRUSTED",
        f"ok nonce: {NONCE.hex()} matches",
        "ok gpu: no GPU evidence (no NVIDIA driver on the node)",
        f"verified: none evidence, UNTRUSTED, key {NODE_KEY.hex()}, boot {BOOT_ID}, digest {NONE.digest()}",
    ]


def test_allowed_none_evidence_needs_no_trust_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(write(tmp_path, NONE)), "--allow-none"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"verified: none evidence, UNTRUSTED, key {NODE_KEY.hex()}, boot {BOOT_ID}, digest {NONE.digest()}"
    )


def test_hardware_evidence_without_a_trust_root_names_the_root_it_needs(
    snp_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(snp_file), "--nonce", NONCE.hex()]) == 1
    output = capsys.readouterr()
    assert output.err == (
        "FAILED missing-trust-root: sev-snp evidence needs <no --trust-root given>/ark.pem, which is absent\n"
    )
    assert output.out.splitlines()[0].startswith("ok report: ")


def test_none_evidence_without_allow_none_exits_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(write(tmp_path, NONE)), "--trust-root", str(tmp_path)]) == 1
    output = capsys.readouterr()
    assert output.out == ""
    assert output.err.startswith("FAILED none-evidence: the node runs without a TEE")


def test_sev_snp_evidence_verifies_through_the_handler(
    snp_file: Path, trust_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="tenzro")
    attest = parser.add_subparsers(dest="group").add_parser("attest").add_subparsers(dest="command")
    add_verify_parser(attest)
    args = parser.parse_args(["attest", "verify", str(snp_file), "--trust-root", str(trust_dir),
                              "--expect-measurement", MEASUREMENT.hex(), "--nonce", NONCE.hex()])
    assert args.func is run_verify
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "ok report", "ok certificate chain", "ok report signature", "ok tcb", "ok chip id", "ok policy",
        "ok measurement", "ok key binding", "ok nonce", "ok gpu", "verified",
    ]
    assert lines[-1].startswith("verified: sev-snp evidence, trusted, key ")


def test_a_stale_nonce_fails_with_the_reason_after_the_checks_that_passed(
    snp_file: Path, trust_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["verify", str(snp_file), "--trust-root", str(trust_dir), "--nonce", "ab" * 32])
    output = capsys.readouterr()
    assert code == 1
    assert output.out.splitlines()[-1].startswith("ok key binding: ")
    assert output.err == (
        f"FAILED nonce-mismatch: the evidence answers nonce {NONCE.hex()}, this verifier issued {'ab' * 32}: the "
        "document is stale or replayed\n"
    )


def test_an_unreadable_evidence_file_is_a_malformed_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "evidence.json").write_text("{not json")
    assert main(["verify", str(tmp_path / "evidence.json"), "--trust-root", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"FAILED malformed-document: {tmp_path / 'evidence.json'} is not JSON")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--nonce", "ab" * 16, "expected 64 hex characters (32 bytes), got 32"),
        ("--expect-measurement", "zz", "'zz' is not hex"),
    ],
)
def test_malformed_flags_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["verify", "x.json", "--trust-root", str(tmp_path), flag, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_module_runs_as_a_command(snp_file: Path, trust_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "attestation.cli", "verify", str(snp_file), "--trust-root", str(trust_dir),
         "--expect-measurement", bytes(48).hex()],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1
    expected = f"FAILED measurement-mismatch: MEASUREMENT is {MEASUREMENT.hex()}, expected {bytes(48).hex()}\n"
    assert done.stderr == expected
    assert done.stdout.splitlines()[-1].startswith("ok policy: ")


@pytest.fixture
def snp_v2_file(tmp_path: Path, amd: AmdPki, vcek: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> Path:
    """SEV-SNP evidence binding (v2) code CODE_DIGEST and the model `default` with weights MODEL_DIGEST."""
    return write(tmp_path, snp_evidence(snp_report(vcek[0], REPORT_DATA_V2), vcek_and_ask(amd, vcek[1]), bound=BOUND))


def trust_policy(tmp_path: Path, **changes: object) -> Path:
    """A policy pinning what `snp_v2_file` proves, its roots `trust_dir` unless `changes` say otherwise."""
    raw = {"tee_types": ["sev-snp"], "allow_none": False, "roots": "trust", "measurements": [MEASUREMENT.hex()],
           "rtmrs": "any", "min_tcb": "any", "code_digests": [CODE_DIGEST.hex()],
           "model_digests": {"default": [MODEL_DIGEST.hex()]}, "gpu": "optional", **changes}
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_trust_policy_accepts_what_the_evidence_proves_and_lends_its_roots(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = trust_policy(tmp_path, roots=str(trust_dir))  # no --trust-root: the policy's roots verify the chain
    assert main(["verify", str(snp_v2_file), "--nonce", NONCE.hex(), "--trust-policy", str(policy)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok report: ") and lines[1].startswith("ok certificate chain: ")
    assert lines[-5:-1] == ["ok gpu: no GPU evidence (no NVIDIA driver on the node)", "trust policy: OK",
                            "  rtmrs: any (not pinned)", "  min_tcb: any (not pinned)"]
    assert lines[-1].startswith("verified: sev-snp evidence, trusted, key ")


@pytest.mark.parametrize(("changes", "reason"), [
    ({"measurements": ["ee" * 48]},
     f"measurements: the node's launch measurement {MEASUREMENT.hex()} is not one the policy accepts"),
    ({"code_digests": ["c1" * 32]},
     f"code_digests: the node runs code {CODE_DIGEST.hex()}, which the policy does not accept"),
    ({"model_digests": {"default": ["d2" * 32]}},
     f"model_digests: the node serves default with weights {MODEL_DIGEST.hex()}, which the policy does not accept"),
    ({"min_tcb": {"snp": 9}}, "min_tcb: snp is 8, the policy requires at least 9"),
], ids=["measurement", "code", "model", "tcb"])
def test_a_trust_policy_refuses_naming_what_it_does_not_accept(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object],
    reason: str
) -> None:
    policy = trust_policy(tmp_path, **changes)
    code = main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--trust-policy", str(policy)])
    output = capsys.readouterr()
    assert code == 1
    assert output.err == f"trust policy: REFUSED\n  {reason}\n"
    assert output.out.splitlines()[-1] == "ok gpu: no GPU evidence (no NVIDIA driver on the node)"  # no verified line


def test_a_v1_document_proves_no_code_so_a_policy_pinning_code_refuses_it(
    snp_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unpinned = trust_policy(tmp_path, roots=str(trust_dir), code_digests="any", model_digests="any")
    assert main(["verify", str(snp_file), "--trust-policy", str(unpinned)]) == 0
    assert capsys.readouterr().out.splitlines()[-6:-1] == [
        "trust policy: OK", "  rtmrs: any (not pinned)", "  min_tcb: any (not pinned)",
        "  code_digests: any (not pinned)", "  model_digests: any (not pinned)"]
    pinned = trust_policy(tmp_path, roots=str(trust_dir), model_digests="any")
    assert main(["verify", str(snp_file), "--trust-policy", str(pinned)]) == 1
    assert capsys.readouterr().err == (
        "trust policy: REFUSED\n  code_digests: the node runs code it did not name, which the policy does not accept\n")


def test_none_evidence_needs_allow_none_even_under_a_policy_that_accepts_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = trust_policy(tmp_path, tee_types=["none"], allow_none=True, roots=None, measurements="any",
                          code_digests="any", model_digests="any")
    path = write(tmp_path, NONE)
    assert main(["verify", str(path), "--trust-policy", str(policy)]) == 1
    output = capsys.readouterr()
    assert output.out == ""
    assert output.err.startswith("FAILED none-evidence: the node runs without a TEE")
    assert main(["verify", str(path), "--trust-policy", str(policy), "--allow-none"]) == 0
    assert capsys.readouterr().out.splitlines()[-7:-1] == [
        "trust policy: OK, UNTRUSTED (none evidence, accepted by allow_none)", "  measurements: any (not pinned)",
        "  rtmrs: any (not pinned)", "  min_tcb: any (not pinned)", "  code_digests: any (not pinned)",
        "  model_digests: any (not pinned)"]


def test_a_malformed_trust_policy_is_a_usage_error(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = trust_policy(tmp_path, measurement="any")
    assert main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--trust-policy", str(policy)]) == 2
    output = capsys.readouterr()
    assert output.out == ""
    assert output.err == ("tenzro: error: unknown trust policy keys measurement: the keys are tee_types, allow_none, "
                          "roots, measurements, rtmrs, min_tcb, code_digests, model_digests, gpu\n")


def test_a_trust_policy_judges_the_tcb_the_report_signed(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # MILAN_TCB: bl 3, tee 0, snp 8, ucode 209, as REPORTED_TCB (the signing VCEK's).
    policy = trust_policy(tmp_path, min_tcb={"bl": 3, "snp": 8, "ucode": 209})
    assert main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--trust-policy", str(policy)]) == 0
    assert "trust policy: OK" in capsys.readouterr().out.splitlines()
