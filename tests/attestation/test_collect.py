"""collect_evidence: configfs-tsm first, then /dev/sev-guest, then `none`; collected evidence verifies."""

from __future__ import annotations

from pathlib import Path

import pytest
from amd_forge import BOOT_ID, NODE_KEY, NONCE, REPORT_DATA, AmdPki, snp_report, vcek_and_ask
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from fake_nvml import FakeNvml
from fake_tsm import FakeTsm
from intel_forge import IntelPki, tdx_quote
from verifying import verified

from attestation.binding import binding_digest
from attestation.collect import collect_evidence
from attestation.errors import EvidenceUnavailable, MalformedEvidence
from attestation.evidence import Evidence
from attestation.nvml_cc import NvmlLoader


def no_nvml() -> None:
    return None


def collect(tmp_path: Path, tsm: FakeTsm | None = None, nvml: NvmlLoader = no_nvml) -> Evidence:
    root = tmp_path / "no-tsm" if tsm is None else tsm.root
    return collect_evidence(NODE_KEY, NONCE, BOOT_ID, tsm_root=root, sev_guest=tmp_path / "no-sev-guest",
                            nvml=nvml, tsm_files=tsm)


def test_a_machine_without_a_tee_gets_untrusted_none_evidence(tmp_path: Path) -> None:
    evidence = collect(tmp_path)
    assert evidence == Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None,
                                public_key=NODE_KEY, boot_id=BOOT_ID, nonce=NONCE)
    assert not evidence.trusted


def test_snp_through_configfs_tsm_verifies(
    tmp_path: Path, amd: AmdPki, vcek: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], trust_dir: Path
) -> None:
    table = vcek_and_ask(amd, vcek[1])
    tsm = FakeTsm(tmp_path / "tsm", "sev_guest", lambda inblob: (snp_report(vcek[0], inblob), table))
    evidence = collect(tmp_path, tsm)
    assert (evidence.evidence_type, evidence.source, evidence.aux) == ("sev-snp", "configfs-tsm", table)
    assert tsm.inblobs == [REPORT_DATA]
    result = verified(evidence.document(), trust_dir)
    assert (result.trusted, result.digest) == (True, evidence.digest())


def test_tdx_through_configfs_tsm_verifies(tmp_path: Path, intel: IntelPki, trust_dir: Path) -> None:
    tsm = FakeTsm(tmp_path / "tsm", "tdx_guest", lambda inblob: (tdx_quote(intel, inblob), b""))
    evidence = collect(tmp_path, tsm)
    assert (evidence.evidence_type, evidence.source, evidence.aux) == ("tdx", "configfs-tsm", b"")
    assert verified(evidence, trust_dir).evidence_type == "tdx"


def test_the_gpu_part_is_requested_with_the_binding_digest(tmp_path: Path) -> None:
    evidence = collect(tmp_path, nvml=FakeNvml)
    assert evidence.gpu is not None
    assert [device.report[4:36] for device in evidence.gpu.devices] == [binding_digest(NODE_KEY, NONCE)]


def test_a_tee_interface_that_fails_is_never_downgraded_to_none(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "tsm", "sev_guest", lambda inblob: (b"", b""))
    with pytest.raises(EvidenceUnavailable):
        collect(tmp_path, tsm)


@pytest.mark.parametrize(("key", "nonce"), [(NODE_KEY, NONCE[:31]), (NODE_KEY[:31], NONCE)])
def test_a_wrong_length_key_or_nonce_is_refused(tmp_path: Path, key: bytes, nonce: bytes) -> None:
    with pytest.raises(MalformedEvidence):
        collect_evidence(key, nonce, BOOT_ID, tsm_root=tmp_path / "x", sev_guest=tmp_path / "y", nvml=no_nvml)
