"""`tenzro attest verify`: one line per passed check and exit 0, or the reason and exit 1."""

from __future__ import annotations

import argparse
import json
import re
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
from attestation.errors import POLICY_REASONS, REASONS
from attestation.evidence import Evidence

ROOT = Path(__file__).resolve().parents[2]
MILAN = "hardware verified (sev-snp, Milan VCEK, TCB bl 3 tee 0 snp 8 ucode 209)"
"""What the forged Milan evidence of `amd_forge` presents (MILAN_TCB: bl 3, tee 0, snp 8, ucode 209)."""
UNPINNED_SNP = ["  vmpls: any (not pinned)", "  host_data: any (not pinned)", "  id_key_digests: any (not pinned)",
                "  author_key_digests: any (not pinned)", "  family_ids: any (not pinned)",
                "  image_ids: any (not pinned)"]
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
        f"verified: none evidence, UNTRUSTED (no TEE); key {NODE_KEY.hex()}, boot {BOOT_ID}, digest {NONE.digest()}",
    ]


def test_allowed_none_evidence_needs_no_trust_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(write(tmp_path, NONE)), "--allow-none"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"verified: none evidence, UNTRUSTED (no TEE); key {NODE_KEY.hex()}, boot {BOOT_ID}, digest {NONE.digest()}"
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
    names = [line.split(":")[0] for line in lines]
    assert names[:3] == ["ok report", "ok certificate chain", "ok report signature"]
    assert names[-5:] == ["ok measurement", "ok key binding", "ok nonce", "ok gpu", "verified"]
    # --expect-measurement pinned the workload; the line names the TCB and what was not checked, never "trusted".
    assert lines[-1].startswith(f"verified: sev-snp evidence, {MILAN}, workload pinned (MEASUREMENT); not checked: "
                                "revocation (")
    assert f"; key {NODE_KEY.hex()}, boot {BOOT_ID}, digest " in lines[-1]


def test_without_a_pinned_measurement_the_last_line_says_the_workload_is_not_pinned(
    snp_file: Path, trust_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(snp_file), "--trust-root", str(trust_dir), "--nonce", NONCE.hex()]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"verified: sev-snp evidence, {MILAN}, workload not pinned; not checked: revocation (")
    assert "trusted" not in last


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
    at = lines.index("ok gpu: no GPU evidence (no NVIDIA driver on the node)")
    assert lines[at + 1].startswith(
        f"trust policy: OK: {MILAN}, workload pinned (MEASUREMENT); not pinned: min_tcb, vmpls, host_data, "
        "id_key_digests, author_key_digests, family_ids, image_ids; not checked: revocation (")
    assert lines[at + 2:-1] == [
        f"  measurements: MEASUREMENT {MEASUREMENT.hex()} (pinned)", "  migration_agent: forbidden (pinned)",
        f"  code_digests: {CODE_DIGEST.hex()} (pinned)", f"  model_digests: default {MODEL_DIGEST.hex()} (pinned)",
        "  min_tcb: any (not pinned)", *UNPINNED_SNP]
    assert lines[-1].startswith(f"verified: sev-snp evidence, {MILAN}, workload pinned (MEASUREMENT); not checked: "
                                "revocation (")


@pytest.mark.parametrize(("changes", "reason"), [
    ({"measurements": ["ee" * 48]}, f"workload-not-accepted: the launch measurement (MEASUREMENT) "
                                    f"{MEASUREMENT.hex()} is not one measurements accepts"),
    ({"code_digests": ["c1" * 32]},
     f"code-not-accepted: the node runs code {CODE_DIGEST.hex()}, which code_digests does not accept"),
    ({"model_digests": {"default": ["d2" * 32]}}, f"model-not-accepted: the node serves default with weights "
                                                  f"{MODEL_DIGEST.hex()}, which model_digests does not accept"),
    ({"min_tcb": {"snp": 9}}, "tcb-below-minimum: TCB component snp is 8, min_tcb requires at least 9"),
    ({"vmpls": [1]}, "guest-policy-not-accepted: the report was made at VMPL 0; vmpls accepts 1"),
    ({"smt": "forbidden"}, "guest-policy-not-accepted: the guest policy 0x30000 allows SMT (bit 16); smt: forbidden"),
    ({"host_data": ["ee" * 32]}, f"guest-policy-not-accepted: HOST_DATA {'00' * 32} is not one host_data accepts"),
    ({"gpu": "required"}, "gpu-missing: gpu: required, and the evidence has no GPU part"),
], ids=["measurement", "code", "model", "tcb", "vmpl", "smt", "host-data", "gpu"])
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
    assert capsys.readouterr().out.splitlines()[-10:-1] == [
        "  min_tcb: any (not pinned)", *UNPINNED_SNP, "  code_digests: any (not pinned)",
        "  model_digests: any (not pinned)"]
    pinned = trust_policy(tmp_path, roots=str(trust_dir), model_digests="any")
    assert main(["verify", str(snp_file), "--trust-policy", str(pinned)]) == 1
    assert capsys.readouterr().err == ("trust policy: REFUSED\n  code-not-accepted: the node runs code it did not "
                                       "name, which code_digests does not accept\n")


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
    assert capsys.readouterr().out.splitlines()[-5:] == [
        "trust policy: OK, UNTRUSTED (none evidence, accepted by allow_none)", "  measurements: any (not pinned)",
        "  code_digests: any (not pinned)", "  model_digests: any (not pinned)",
        f"verified: none evidence, UNTRUSTED (no TEE); key {NODE_KEY.hex()}, boot {BOOT_ID}, digest {NONE.digest()}"]


def test_a_malformed_trust_policy_is_a_usage_error(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = trust_policy(tmp_path, measurement="any")
    assert main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--trust-policy", str(policy)]) == 2
    output = capsys.readouterr()
    assert output.out == ""
    assert output.err == ("tenzro: error: unknown trust policy keys measurement: the keys are tee_types, allow_none, "
                          "roots, measurements, rtmrs, min_tcb, code_digests, model_digests, gpu, collateral, "
                          "tdx_tcb_status, revocation, vmpls, migration_agent, smt, host_data, id_key_digests, "
                          "author_key_digests, family_ids, image_ids\n")


def test_a_trust_policy_judges_the_tcb_the_report_signed(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # MILAN_TCB: bl 3, tee 0, snp 8, ucode 209, as REPORTED_TCB (the signing VCEK's).
    policy = trust_policy(tmp_path, min_tcb={"bl": 3, "snp": 8, "ucode": 209})
    assert main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--trust-policy", str(policy)]) == 0
    head = (f"trust policy: OK: {MILAN}, workload pinned (MEASUREMENT); not pinned: vmpls, host_data, id_key_digests, "
            "author_key_digests, family_ids, image_ids; not checked: revocation (")
    assert head in capsys.readouterr().out


def test_the_collateral_flag_and_the_policys_collateral_reach_the_verifier(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tmp_path / "absent"
    assert main(["verify", str(snp_v2_file), "--trust-root", str(trust_dir), "--collateral", str(absent)]) == 1
    assert capsys.readouterr().err == f"FAILED missing-collateral: collateral directory {absent} does not exist\n"
    policy = trust_policy(tmp_path, roots=str(trust_dir), collateral="from-policy")
    assert main(["verify", str(snp_v2_file), "--trust-policy", str(policy)]) == 1
    assert capsys.readouterr().err == (
        f"FAILED missing-collateral: collateral directory {tmp_path / 'from-policy'} does not exist\n")
    (tmp_path / "empty").mkdir()  # the flag wins over the policy's directory
    assert main(["verify", str(snp_v2_file), "--trust-policy", str(policy), "--collateral", str(tmp_path / "empty")]) \
        == 0


def test_expect_measurement_pins_the_workload_a_policy_left_unpinned(
    snp_v2_file: Path, trust_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = trust_policy(tmp_path, roots=str(trust_dir), measurements="any")
    assert main(["verify", str(snp_v2_file), "--trust-policy", str(policy)]) == 0
    assert f"trust policy: OK: {MILAN}, workload not pinned; not pinned: measurements, min_tcb," in \
        capsys.readouterr().out
    assert main(["verify", str(snp_v2_file), "--trust-policy", str(policy), "--expect-measurement",
                 MEASUREMENT.hex()]) == 0
    out = capsys.readouterr().out
    assert f"trust policy: OK: {MILAN}, workload pinned (MEASUREMENT); not pinned: min_tcb," in out
    assert f"  measurements: MEASUREMENT {MEASUREMENT.hex()} (pinned)" in out.splitlines()


def test_the_readme_lists_every_reason_code_with_its_meaning() -> None:
    """A code added to attestation.errors without a README row fails here, and so does a row for no code."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("#### Reason codes", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (.+?) \|$", section, flags=re.MULTILINE)
    listed = [code for code, _ in rows]
    assert sorted(listed) == sorted([*REASONS, *POLICY_REASONS])
    assert len(listed) == len(set(listed))
    assert all(len(meaning.split()) >= 4 for _, meaning in rows)  # a meaning, not a placeholder
