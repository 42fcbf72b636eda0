"""The trust policy: every key checked, unknown keys refused, and a verdict that fails closed and names what it did
not pin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.trust_policy import ANY, Presented, TrustPolicy, TrustPolicyError

MEASUREMENT = "ab" * 48
CODE, WEIGHTS = "c0" * 32, "d1" * 32
SNP = Presented("sev-snp", measurement=MEASUREMENT, tcb={"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
                code_digest=CODE, model_digests={"default": WEIGHTS})


def policy(**changes: Any) -> dict[str, Any]:
    raw = {"tee_types": ["sev-snp"], "allow_none": False, "roots": "roots", "measurements": [MEASUREMENT],
           "rtmrs": ANY, "min_tcb": {"snp": 8, "microcode": 115}, "code_digests": [CODE],
           "model_digests": {"default": [WEIGHTS]}, "gpu": "optional"}
    return {**raw, **changes}


def test_a_node_presenting_what_the_policy_pins_is_accepted_and_the_unpinned_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump(policy()))
    loaded = TrustPolicy.load(path)
    assert loaded.roots == tmp_path / "roots"
    verdict = loaded.judge(SNP)
    assert verdict.ok and not verdict.untrusted
    assert verdict.lines() == ["OK", "  rtmrs: any (not pinned)"]


@pytest.mark.parametrize(("presented", "reason"), [
    (Presented("tdx", measurement=MEASUREMENT, code_digest=CODE, model_digests={"default": WEIGHTS}),
     "tee_types: the node presented tdx evidence; the policy accepts sev-snp"),
    (Presented("sev-snp", measurement="cd" * 48, tcb=SNP.tcb, code_digest=CODE, model_digests={"default": WEIGHTS}),
     f"measurements: the node's launch measurement {'cd' * 48} is not one the policy accepts"),
    (Presented("sev-snp", measurement=MEASUREMENT, tcb={"snp": 7, "microcode": 115}, code_digest=CODE,
               model_digests={"default": WEIGHTS}), "min_tcb: snp is 7, the policy requires at least 8"),
    (Presented("sev-snp", measurement=MEASUREMENT, code_digest=CODE, model_digests={"default": WEIGHTS}),
     "min_tcb: the evidence presents no TCB version this verifier read; the policy requires one"),
    (Presented("sev-snp", measurement=MEASUREMENT, tcb=SNP.tcb, code_digest="c1" * 32,
               model_digests={"default": WEIGHTS}),
     f"code_digests: the node runs code {'c1' * 32}, which the policy does not accept"),
    (Presented("sev-snp", measurement=MEASUREMENT, tcb=SNP.tcb, code_digest=CODE, model_digests={"default": "d2" * 32}),
     f"model_digests: the node serves default with weights {'d2' * 32}, which the policy does not accept"),
    (Presented("sev-snp", measurement=MEASUREMENT, tcb=SNP.tcb, code_digest=CODE, model_digests={"other": WEIGHTS}),
     "model_digests: the node serves other, which the policy does not name"),
    (Presented("sev-snp", measurement=MEASUREMENT, tcb=SNP.tcb, code_digest=CODE),
     "model_digests: the node named no model digest; the policy requires them"),
])
def test_each_mismatch_refuses_naming_what(presented: Presented, reason: str) -> None:
    verdict = TrustPolicy.parse(policy(), Path("/p")).judge(presented)
    assert not verdict.ok
    assert reason in verdict.refusals
    assert verdict.lines()[0] == "REFUSED"


def test_gpu_required_refuses_a_node_without_verified_gpu_evidence() -> None:
    required = TrustPolicy.parse(policy(gpu="required"), Path("/p"))
    assert required.judge(SNP).refusals == ("gpu: the policy requires verified GPU evidence; the node presented none",)
    assert required.judge(Presented(**{**_fields(SNP), "gpu_verified": True})).ok


def _fields(presented: Presented) -> dict[str, Any]:
    return {name: getattr(presented, name) for name in Presented.__dataclass_fields__}


def test_none_evidence_needs_allow_none_said_twice_and_is_untrusted() -> None:
    none = Presented("none", code_digest=CODE, model_digests={"default": WEIGHTS})
    assert "tee_types: the node presented none evidence; the policy accepts sev-snp" in \
        TrustPolicy.parse(policy(), Path("/p")).judge(none).refusals
    for half in ({"allow_none": True}, {"tee_types": ["sev-snp", "none"]}):
        with pytest.raises(TrustPolicyError, match="tee_types lists none exactly when allow_none is true"):
            TrustPolicy.parse(policy(**half), Path("/p"))
    development = TrustPolicy.parse(policy(tee_types=["none"], allow_none=True, roots=None, measurements=ANY,
                                           min_tcb=ANY), Path("/p"))
    verdict = development.judge(none)
    assert verdict.ok and verdict.untrusted
    assert verdict.lines() == ["OK, UNTRUSTED (none evidence, accepted by allow_none)",
                               "  measurements: any (not pinned)", "  rtmrs: any (not pinned)",
                               "  min_tcb: any (not pinned)"]
    # A measurement pinned by the policy is never met by none evidence.
    assert not TrustPolicy.parse(policy(tee_types=["none"], allow_none=True, roots=None, min_tcb=ANY),
                                 Path("/p")).judge(none).ok


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
])
def test_a_malformed_policy_names_the_key(raw: Any, message: str) -> None:
    with pytest.raises(TrustPolicyError, match=message):
        TrustPolicy.parse(raw, Path("/p"))


def test_pin_accepts_exactly_what_was_presented(tmp_path: Path) -> None:
    pinned = TrustPolicy.pin(SNP, "roots")
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(pinned))
    loaded = TrustPolicy.load(path)
    assert loaded.judge(SNP).ok
    assert not loaded.judge(Presented(**{**_fields(SNP), "code_digest": "c1" * 32})).ok
    none = Presented("none", code_digest=CODE, model_digests={"default": WEIGHTS})
    assert TrustPolicy.parse(TrustPolicy.pin(none, None), tmp_path).judge(none).ok
