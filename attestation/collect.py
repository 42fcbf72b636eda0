"""Collecting evidence on the node: the one call it makes per request, whatever hardware it runs on.

Order: configfs-tsm (SEV-SNP or TDX, Linux 6.7+), then `/dev/sev-guest` (SEV-SNP on older kernels),
then `none`. A machine with none of these gets `none` evidence, which is never trusted; a machine
whose TEE interface exists but fails raises `EvidenceUnavailable` instead, so a broken confidential
machine is never passed off as a plain one (nor the reverse). The GPU part is added when NVML is there.
With `bound` values the evidence is binding v2 (TLS, code and models bound beside the key); without, v1.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from attestation.binding import BoundIdentity, report_data_for
from attestation.configfs_tsm import TSM_REPORT_ROOT, TsmFiles, tsm_report
from attestation.evidence import Evidence
from attestation.nvml_cc import NvmlLoader, gpu_evidence, load_pynvml
from attestation.sev_guest import SEV_GUEST_DEVICE, sev_guest_report


def collect_evidence(
    public_key: bytes,
    nonce: bytes,
    boot_id: str,
    *,
    tsm_root: Path = TSM_REPORT_ROOT,
    sev_guest: Path = SEV_GUEST_DEVICE,
    nvml: NvmlLoader = load_pynvml,
    tsm_files: TsmFiles | None = None,
    bound: BoundIdentity | None = None,
) -> Evidence:
    """Evidence binding `public_key` (32 raw Ed25519 bytes), and `bound` when given, to the verifier's `nonce`.

    Raises `MalformedEvidence` for a key, nonce or bound value of the wrong form and `EvidenceUnavailable`
    when a TEE or NVML interface is present but fails.
    """
    report_data = report_data_for(public_key, nonce, bound)
    none = Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=public_key,
                    boot_id=boot_id, nonce=nonce, bound=bound)
    gpu = gpu_evidence(report_data[:32], nvml())
    tsm = tsm_report(report_data, tsm_root, tsm_files)
    if tsm is not None:
        return replace(none, evidence_type=tsm.evidence_type, source="configfs-tsm", report=tsm.outblob,
                       aux=tsm.auxblob, gpu=gpu)
    snp = sev_guest_report(report_data, sev_guest)
    if snp is not None:
        return replace(none, evidence_type="sev-snp", source="sev-guest", report=snp.report, aux=snp.cert_table,
                       gpu=gpu)
    return replace(none, gpu=gpu)
