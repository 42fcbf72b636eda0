"""The trust policy: every key checked, unknown keys refused, and a verdict that fails closed, gives each refusal its
reason code, and names the TCB, what it pinned and what was not checked.

Built from `Presented` values made here (as `presented_by` makes them from a `VerificationResult`): the policy is
judged apart from the verifiers that fill those values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.checks import Check, GpuResult, SnpGuest
from attestation.errors import POLICY_REASONS
from attestation.trust_policy import ANY, Presented, TrustPolicy, TrustPolicyError, presented_by
from attestation.verify import VerificationResult

MEASUREMENT = "ab" * 48
CODE, WEIGHTS = "c0" * 32, "d1" * 32
RTMRS = ("01" * 48, "02" * 48, "03" * 48, "04" * 48)
GUEST = SnpGuest(signing_key="VCEK", product="Milan", vmpl=0, policy=0x30000, host_data=bytes(range(32)),
                 id_key_digest=b"\x11" * 48, author_key_digest=b"\x22" * 48, family_id=b"\x33" * 16,
                 image_id=b"\x44" * 16)
"""Policy 0x30000: bit 17 (reserved, must be one) and bit 16 (SMT allowed); MIGRATE_MA (bit 18) clear."""
SNP = Presented("sev-snp", measurement=MEASUREMENT, tcb={"bl": 3, "tee": 0, "spl4": 0, "snp": 8, "ucode": 115},
                snp=GUEST, code_digest=CODE, model_digests={"default": WEIGHTS},
                not_checked=("revocation: AMD KDS CRLs are not consulted yet",))
TDX = Presented("tdx", measurement=MEASUREMENT, rtmrs=RTMRS, tcb_status="UpToDate", code_digest=CODE,
                model_digests={"default": WEIGHTS})
VERIFIED_GPU = GpuResult(verified=True, devices=1, measurements_checked=True)


def policy(**changes: Any) -> dict[str, Any]:
    raw = {"tee_types": ["sev-snp"], "allow_none": False, "roots": "roots", "measurements": [MEASUREMENT],
           "rtmrs": ANY, "min_tcb": {"snp": 8, "ucode": 115}, "code_digests": [CODE],
           "model_digests": {"default": [WEIGHTS]}, "gpu": "optional"}
    return {**raw, **changes}


def judge(presented: Presented, **changes: Any) -> Any:
    return TrustPolicy.parse(policy(**changes), Path("/p")).judge(presented)


def changed(presented: Presented, **values: Any) -> Presented:
    return dataclasses.replace(presented, **values)


def test_a_node_presenting_what_the_policy_pins_is_accepted_naming_tcb_pins_and_what_was_not_checked(
        tmp_path: Path) -> None:
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump(policy(collateral="collateral")))
    loaded = TrustPolicy.load(path)
    assert loaded.roots == tmp_path / "roots" and loaded.collateral == tmp_path / "collateral"
    verdict = loaded.judge(SNP)
    assert verdict.ok and not verdict.untrusted
    assert verdict.lines() == [
        "OK: hardware verified (sev-snp, Milan VCEK, TCB bl 3 tee 0 snp 8 ucode 115), workload pinned (MEASUREMENT); "
        "not pinned: vmpls, host_data, id_key_digests, author_key_digests, family_ids, image_ids; "
        "not checked: revocation (AMD KDS CRLs are not consulted yet)",
        f"  measurements: MEASUREMENT {MEASUREMENT} (pinned)",
        "  min_tcb: at least snp 8, ucode 115 (pinned)",
        "  migration_agent: forbidden (pinned)",
        f"  code_digests: {CODE} (pinned)",
        f"  model_digests: default {WEIGHTS} (pinned)",
        "  vmpls: any (not pinned)", "  host_data: any (not pinned)", "  id_key_digests: any (not pinned)",
        "  author_key_digests: any (not pinned)", "  family_ids: any (not pinned)", "  image_ids: any (not pinned)",
    ]


def test_the_tdx_head_line_names_the_tcb_status_the_pinned_workload_and_the_unpinned_keys() -> None:
    pinned = judge(TDX, tee_types=["tdx"], min_tcb=ANY, rtmrs=[list(RTMRS)], code_digests=ANY)
    assert pinned.lines()[0] == ("OK: hardware verified (tdx, TCB UpToDate), workload pinned (MRTD, RTMR0-3); "
                                 "not pinned: code_digests")
    assert f"  rtmrs: {' '.join(RTMRS)} (pinned)" in pinned.lines()
    partly = judge(changed(TDX, not_checked=("revocation: no Intel CRLs in the collateral",)), tee_types=["tdx"],
                   min_tcb=ANY)
    assert partly.lines()[0] == ("OK: hardware verified (tdx, TCB UpToDate), workload partly pinned (MRTD; not "
                                 "RTMR0-3); not pinned: rtmrs; not checked: revocation (no Intel CRLs in the "
                                 "collateral)")
    unpinned = judge(TDX, tee_types=["tdx"], min_tcb=ANY, measurements=ANY, tdx_tcb_status=ANY)
    assert unpinned.lines()[0] == ("OK: hardware verified (tdx, TCB UpToDate), workload not pinned; not pinned: "
                                   "measurements, rtmrs, tdx_tcb_status")


def test_a_verdict_that_pinned_no_workload_says_so_and_never_plain_ok() -> None:
    head = judge(SNP, measurements=ANY).lines()[0]
    assert head.startswith("OK: hardware verified (sev-snp, Milan VCEK, TCB bl 3 tee 0 snp 8 ucode 115), workload "
                           "not pinned; not pinned: measurements, vmpls,")
    assert TrustPolicy.parse(policy(measurements=ANY), Path("/p")).expecting(MEASUREMENT).judge(SNP).lines()[0] \
        .startswith("OK: hardware verified (sev-snp, Milan VCEK, TCB bl 3 tee 0 snp 8 ucode 115), workload pinned "
                    "(MEASUREMENT); not pinned: vmpls,")


@pytest.mark.parametrize(("presented", "changes", "refusal"), [
    (TDX, {"min_tcb": ANY}, ("tee-type-not-accepted", "the node presented tdx evidence; tee_types accepts sev-snp")),
    (changed(SNP, measurement="cd" * 48), {},
     ("workload-not-accepted", f"the launch measurement (MEASUREMENT) {'cd' * 48} is not one measurements accepts")),
    (changed(TDX, rtmrs=("05" * 48,) * 4), {"tee_types": ["tdx"], "min_tcb": ANY, "rtmrs": [list(RTMRS)]},
     ("workload-not-accepted", f"the RTMRs {' '.join(('05' * 48,) * 4)} are not a set rtmrs accepts")),
    (changed(SNP, tcb={"snp": 7, "ucode": 115}), {},
     ("tcb-below-minimum", "TCB component snp is 7, min_tcb requires at least 8")),
    (changed(SNP, tcb=None), {},
     ("tcb-below-minimum", "the evidence presents no TCB version this verifier read; min_tcb requires one")),
    (changed(SNP, code_digest="c1" * 32), {},
     ("code-not-accepted", f"the node runs code {'c1' * 32}, which code_digests does not accept")),
    (changed(SNP, model_digests={"default": "d2" * 32}), {},
     ("model-not-accepted", f"the node serves default with weights {'d2' * 32}, which model_digests does not accept")),
    (changed(SNP, model_digests={"other": WEIGHTS}), {},
     ("model-not-accepted", "the node serves other, which model_digests does not name")),
    (changed(SNP, model_digests={}), {},
     ("model-not-accepted", "the node named no model digest; model_digests requires them")),
], ids=["tee", "measurement", "rtmrs", "tcb", "no-tcb", "code", "model", "model-id", "no-model"])
def test_each_mismatch_refuses_with_its_reason(presented: Presented, changes: dict[str, Any],
                                                refusal: tuple[str, str]) -> None:
    verdict = judge(presented, **changes)
    assert verdict.refusals == (refusal,)
    assert verdict.lines() == ["REFUSED", f"  {refusal[0]}: {refusal[1]}"]


def test_tdx_tcb_status_accepts_only_the_listed_statuses_and_refuses_an_unevaluated_one() -> None:
    tdx = {"tee_types": ["tdx"], "min_tcb": ANY}
    out_of_date = changed(TDX, tcb_status="OutOfDate", advisory_ids=("INTEL-SA-00615", "INTEL-SA-00657"))
    assert judge(out_of_date, **tdx).refusals == (("tcb-status-not-accepted", (
        "the platform's TCB OutOfDate (advisories INTEL-SA-00615 INTEL-SA-00657) is not a status tdx_tcb_status "
        "accepts (UpToDate)")),)
    assert judge(changed(TDX, tcb_status=None), **tdx).refusals == (("tcb-status-not-accepted", (
        "the TDX TCB status was not evaluated (no Intel TCB info and QE identity in the collateral: give "
        "collateral); tdx_tcb_status accepts UpToDate")),)
    accepting = judge(out_of_date, **tdx, tdx_tcb_status=["UpToDate", "OutOfDate"])
    assert accepting.ok
    assert accepting.lines()[0].startswith(
        "OK: hardware verified (tdx, TCB OutOfDate (advisories INTEL-SA-00615 INTEL-SA-00657)), workload partly")
    assert "  tdx_tcb_status: OutOfDate, UpToDate (pinned)" in accepting.lines()
    any_status = judge(changed(TDX, tcb_status=None), **tdx, tdx_tcb_status=ANY)
    assert any_status.ok and "tdx_tcb_status" in any_status.unpinned
    assert "TCB status not evaluated" in any_status.lines()[0]
    # Revoked is refused even by `any`, and cannot be listed.
    assert judge(changed(TDX, tcb_status="Revoked"), **tdx, tdx_tcb_status=ANY).refusals == ((
        "tcb-status-not-accepted", "the platform's TCB Revoked: Intel revoked this TCB, and no policy accepts it"),)
    # SEV-SNP evidence has no Intel status: the key does not judge it.
    assert judge(SNP, tee_types=["sev-snp", "tdx"]).ok


@pytest.mark.parametrize(("guest", "changes", "message"), [
    (dataclasses.replace(GUEST, vmpl=2), {"vmpls": [0, 1]}, "the report was made at VMPL 2; vmpls accepts 0, 1"),
    (dataclasses.replace(GUEST, policy=0x70000), {},
     "the guest policy 0x70000 allows a migration agent (MIGRATE_MA, bit 18); migration_agent: forbidden"),
    (GUEST, {"smt": "forbidden"}, "the guest policy 0x30000 allows SMT (bit 16); smt: forbidden"),
    (GUEST, {"host_data": ["ff" * 32]}, f"HOST_DATA {bytes(range(32)).hex()} is not one host_data accepts"),
    (GUEST, {"id_key_digests": ["ff" * 48]}, f"ID_KEY_DIGEST {'11' * 48} is not one id_key_digests accepts"),
    (GUEST, {"author_key_digests": ["ff" * 48]},
     f"AUTHOR_KEY_DIGEST {'22' * 48} is not one author_key_digests accepts"),
    (GUEST, {"family_ids": ["ff" * 16]}, f"FAMILY_ID {'33' * 16} is not one family_ids accepts"),
    (GUEST, {"image_ids": ["ff" * 16]}, f"IMAGE_ID {'44' * 16} is not one image_ids accepts"),
], ids=["vmpl", "migration-agent", "smt", "host-data", "id-key", "author-key", "family", "image"])
def test_each_sev_snp_guest_key_refuses_what_it_does_not_accept(guest: SnpGuest, changes: dict[str, Any],
                                                                 message: str) -> None:
    assert judge(changed(SNP, snp=guest), **changes).refusals == (("guest-policy-not-accepted", message),)


def test_sev_snp_guest_keys_accept_what_they_pin_and_fail_closed_without_guest_facts() -> None:
    pins = {"vmpls": [0], "smt": "allowed", "host_data": [bytes(range(32)).hex()], "id_key_digests": ["11" * 48],
            "author_key_digests": ["22" * 48], "family_ids": ["33" * 16], "image_ids": ["44" * 16]}
    verdict = judge(SNP, **pins)
    assert verdict.ok
    assert verdict.pinned[2:9] == (
        ("vmpls", "VMPL 0"), ("migration_agent", "forbidden"), ("host_data", f"HOST_DATA {bytes(range(32)).hex()}"),
        ("id_key_digests", f"ID_KEY_DIGEST {'11' * 48}"), ("author_key_digests", f"AUTHOR_KEY_DIGEST {'22' * 48}"),
        ("family_ids", f"FAMILY_ID {'33' * 16}"), ("image_ids", f"IMAGE_ID {'44' * 16}"))
    assert verdict.unpinned == ()
    assert judge(changed(SNP, snp=dataclasses.replace(GUEST, policy=0x70000)), migration_agent="allowed").ok
    assert judge(changed(SNP, snp=None), **pins).refusals == (("guest-policy-not-accepted", (
        "the evidence presents no SEV-SNP guest facts this verifier read; vmpls, migration_agent, host_data, "
        "id_key_digests, author_key_digests, family_ids, image_ids require them")),)
    # The default (migration_agent: forbidden) alone already needs them.
    assert judge(changed(SNP, snp=None)).refusals[0][0] == "guest-policy-not-accepted"
    # TDX evidence is not judged by SEV-SNP keys.
    assert judge(TDX, tee_types=["tdx", "sev-snp"], min_tcb=ANY, **pins).ok


@pytest.mark.parametrize(("gpu", "message"), [
    (None, "gpu: required, and the evidence has no GPU part"),
    (GpuResult(verified=False, devices=0, measurements_checked=False),
     "gpu: required, and the GPU part has no report (confidential computing off)"),
    (GpuResult(verified=False, devices=2, measurements_checked=False, not_checked=("gpu: SPDM signatures",)),
     "gpu: required, and the GPU part of 2 report(s) was not verified (gpu: SPDM signatures)"),
], ids=["absent", "cc-off", "unverified"])
def test_gpu_required_refuses_naming_what_is_missing(gpu: GpuResult | None, message: str) -> None:
    assert judge(changed(SNP, gpu=gpu), gpu="required").refusals == (("gpu-missing", message),)


def test_gpu_required_refuses_a_gpu_whose_measurements_were_not_compared_with_rims(tmp_path: Path) -> None:
    """nvtrust passes no GPU without comparing its measurements with NVIDIA's RIMs: chain, signature and nonce
    alone would accept any driver or VBIOS. A policy pinned from such a GPU does not require it either."""
    unmeasured = changed(SNP, gpu=GpuResult(verified=True, devices=1, measurements_checked=False,
                                            not_checked=("gpu measurements: no NVIDIA RIM files",)))
    assert judge(unmeasured, gpu="required").refusals == (("gpu-missing", (
        "gpu: required, and the measurements of its 1 report(s) were not compared with NVIDIA's signed RIMs (no RIM "
        "files in the collateral)")),)
    assert judge(unmeasured, gpu="optional").ok
    assert TrustPolicy.pin(unmeasured, "roots")["gpu"] == "optional"
    assert TrustPolicy.pin(changed(SNP, gpu=VERIFIED_GPU), "roots")["gpu"] == "required"


def test_gpu_required_accepts_a_verified_gpu_part_and_the_head_line_names_it() -> None:
    verdict = judge(changed(SNP, gpu=VERIFIED_GPU), gpu="required")
    assert verdict.ok
    assert verdict.lines()[0].startswith("OK: hardware verified (sev-snp, Milan VCEK, TCB bl 3 tee 0 snp 8 ucode 115, "
                                         "1 GPU(s) verified), workload pinned (MEASUREMENT)")
    assert ("gpu", "required") in verdict.pinned


def test_revocation_required_refuses_evidence_whose_revocation_was_not_checked() -> None:
    assert judge(SNP, revocation="required").refusals == (("revocation-not-checked", (
        "revocation: required, and the verifier did not check it: revocation: AMD KDS CRLs are not consulted yet")),)
    checked = judge(changed(SNP, not_checked=()), revocation="required")
    assert checked.ok and ("revocation", "required") in checked.pinned
    assert judge(SNP, revocation="optional").ok


def test_none_evidence_needs_allow_none_said_twice_and_is_untrusted() -> None:
    none = Presented("none", code_digest=CODE, model_digests={"default": WEIGHTS})
    assert ("tee-type-not-accepted", "the node presented none evidence; tee_types accepts sev-snp") in \
        judge(none).refusals
    for half in ({"allow_none": True}, {"tee_types": ["sev-snp", "none"]}):
        with pytest.raises(TrustPolicyError, match="tee_types lists none exactly when allow_none is true"):
            TrustPolicy.parse(policy(**half), Path("/p"))
    verdict = judge(none, tee_types=["none"], allow_none=True, roots=None, measurements=ANY, min_tcb=ANY)
    assert verdict.ok and verdict.untrusted
    assert verdict.lines() == ["OK, UNTRUSTED (none evidence, accepted by allow_none)",
                               f"  code_digests: {CODE} (pinned)", f"  model_digests: default {WEIGHTS} (pinned)",
                               "  measurements: any (not pinned)"]
    # A measurement pinned by the policy is never met by none evidence.
    assert judge(none, tee_types=["none"], allow_none=True, roots=None, min_tcb=ANY).refusals == ((
        "workload-not-accepted", "the launch measurement (measurement) none is not one measurements accepts"),)


def test_every_refusal_reason_is_a_policy_reason() -> None:
    everything = changed(TDX, tcb_status=None, code_digest=None, model_digests={},
                         not_checked=("revocation: no CRLs",))
    verdict = judge(everything, measurements=["ee" * 48], rtmrs=[list(RTMRS[::-1])], gpu="required",
                    revocation="required")
    assert [reason for reason, _ in verdict.refusals] == [
        "tee-type-not-accepted", "workload-not-accepted", "workload-not-accepted", "tcb-below-minimum",
        "tcb-status-not-accepted", "code-not-accepted", "model-not-accepted", "gpu-missing", "revocation-not-checked"]
    assert {reason for reason, _ in verdict.refusals} <= set(POLICY_REASONS)


@pytest.mark.parametrize(("raw", "message"), [
    ({**policy(), "gpus": "required"}, "unknown trust policy keys gpus"),
    ({key: value for key, value in policy().items() if key != "rtmrs"}, "missing: rtmrs"),
    (policy(tee_types=[]), "tee_types: a non-empty list"),
    (policy(tee_types=["sgx"]), "tee_types: a non-empty list"),
    (policy(measurements=["AB" * 48]), "measurements: any, or a non-empty list of lowercase hex values"),
    (policy(code_digests=[]), "code_digests: any, or a non-empty list"),
    (policy(model_digests={"default": ANY}), "model_digests.default: a list of digests"),
    (policy(min_tcb={"snp": 256}), "min_tcb: any, or a mapping"),
    (policy(rtmrs=[[MEASUREMENT] * 3]), "rtmrs: any, or a non-empty list of"),
    (policy(roots=None), "roots: hardware evidence is verified against roots"),
    (policy(gpu="maybe"), "gpu: one of optional, required"),
    (["tee_types"], "a trust policy is a mapping"),
    (policy(collateral=3), "collateral: the vendor collateral directory"),
    (policy(tdx_tcb_status=["Revoked"]), r"tdx_tcb_status: any, or a non-empty list of Intel TCB statuses: UpToDate, "
                                         r"SWHardeningNeeded, .* \(Revoked is never accepted\)"),
    (policy(tdx_tcb_status="UpToDate"), "tdx_tcb_status: any, or a non-empty list"),
    (policy(revocation="maybe"), "revocation: one of optional, required"),
    (policy(vmpls=[4]), "vmpls: any, or a non-empty list of VMPLs, 0 to 3"),
    (policy(vmpls=[True]), "vmpls: any, or a non-empty list of VMPLs"),
    (policy(migration_agent="yes"), "migration_agent: one of allowed, forbidden"),
    (policy(smt=False), "smt: one of allowed, forbidden"),
    (policy(host_data=["ab" * 48]), r"host_data: any, or a non-empty list of lowercase hex values \(64 characters"),
    (policy(id_key_digests=["ab" * 32]), r"id_key_digests: any, .* \(96 characters"),
    (policy(author_key_digests=[]), "author_key_digests: any, or a non-empty list"),
    (policy(family_ids=["ab" * 32]), r"family_ids: any, .* \(32 characters"),
    (policy(image_ids="all"), "image_ids: any, or a non-empty list"),
])
def test_a_malformed_policy_names_the_key(raw: Any, message: str) -> None:
    with pytest.raises(TrustPolicyError, match=message):
        TrustPolicy.parse(raw, Path("/p"))


def test_the_optional_keys_default_to_the_strict_choice() -> None:
    loaded = TrustPolicy.parse(policy(), Path("/p"))
    assert (loaded.collateral, loaded.tdx_tcb_status, loaded.revocation, loaded.vmpls, loaded.migration_agent,
            loaded.smt, loaded.host_data, loaded.image_ids) == (
        None, frozenset({"UpToDate"}), "optional", ANY, "forbidden", "allowed", ANY, ANY)


def test_presented_by_reads_every_value_a_policy_judges_off_the_verification_result() -> None:
    result = VerificationResult(
        evidence_type="sev-snp", trusted=True, public_key_hex="aa" * 32, boot_id="b", nonce_hex="00" * 32,
        nonce_checked=True, measurement_hex=MEASUREMENT, digest="d", checks=(Check("report", "ok"),),
        binding_version=2, tls_spki_sha256_hex=None, code_digest_hex=CODE, model_digests=(("default", WEIGHTS),),
        tcb=SNP.tcb, rtmrs_hex=None, tcb_status=None, advisory_ids=("INTEL-SA-1",), snp=GUEST, gpu=VERIFIED_GPU,
        not_checked=("revocation: x",))
    assert presented_by(result) == Presented(
        "sev-snp", measurement=MEASUREMENT, tcb=SNP.tcb, advisory_ids=("INTEL-SA-1",), snp=GUEST, code_digest=CODE,
        model_digests={"default": WEIGHTS}, gpu=VERIFIED_GPU, not_checked=("revocation: x",))
    assert presented_by(result).gpu_verified


def test_pin_accepts_exactly_what_was_presented(tmp_path: Path) -> None:
    snp = changed(SNP, not_checked=())
    pinned = TrustPolicy.pin(snp, "roots", "collateral")
    assert {key: pinned[key] for key in ("vmpls", "migration_agent", "smt", "host_data", "revocation",
                                         "collateral")} == {
        "vmpls": [0], "migration_agent": "forbidden", "smt": "allowed", "host_data": [bytes(range(32)).hex()],
        "revocation": "required", "collateral": "collateral"}
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(pinned))
    loaded = TrustPolicy.load(path)
    assert loaded.judge(snp).ok
    assert not loaded.judge(changed(snp, code_digest="c1" * 32)).ok
    assert not loaded.judge(changed(snp, snp=dataclasses.replace(GUEST, vmpl=1))).ok
    tdx = TrustPolicy.parse(TrustPolicy.pin(TDX, "roots"), tmp_path)
    assert tdx.tdx_tcb_status == frozenset({"UpToDate"}) and tdx.judge(TDX).ok
    assert not tdx.judge(changed(TDX, tcb_status="OutOfDate")).ok
    none = Presented("none", code_digest=CODE, model_digests={"default": WEIGHTS})
    assert TrustPolicy.parse(TrustPolicy.pin(none, None), tmp_path).judge(none).ok
