"""This node start's identity: the key that signs its usage records, its boot id, and the evidence binding the key.

The key is made first, then the boot's evidence binds it (`attestation.binding`, under a nonce derived from the
boot id, so anyone can recompute it), then the meter opens a ledger segment whose header, records and tree
heads name the evidence's digest. The evidence document is written beside the segment as
`<boot_id>.evidence.json`: an auditor checks with it, offline, that the key signing a segment is the attested
one (`tenzro metering verify LEDGER --trust-root DIR`). A verifier that wants freshness asks
`GET /v1/attestation?nonce=HEX` for evidence under its own nonce.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attestation.binding import BoundIdentity
from attestation.collect import collect_evidence
from attestation.configfs_tsm import TSM_REPORT_ROOT
from attestation.evidence import Evidence
from attestation.nvml_cc import load_pynvml
from attestation.sev_guest import SEV_GUEST_DEVICE
from metering.signer import NodeSigner
from node.code_identity import ServedIdentity

BOOT_NONCE_DOMAIN = b"tenzro-boot-evidence\0"
EVIDENCE_SUFFIX = ".evidence.json"


def boot_nonce(boot_id: str) -> bytes:
    """The nonce of a boot's own evidence: SHA-256(domain || boot id), 32 bytes."""
    return hashlib.sha256(BOOT_NONCE_DOMAIN + boot_id.encode()).digest()


@dataclass(frozen=True, slots=True)
class EvidenceSources:
    """Where evidence comes from: the kernel's interfaces and NVML (tests point them at fakes)."""

    tsm_root: Path = TSM_REPORT_ROOT
    sev_guest: Path = SEV_GUEST_DEVICE
    nvml: Callable[[], Any] = field(default=load_pynvml)


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    signer: NodeSigner
    boot_id: str
    evidence: Evidence
    """The boot's evidence, under `boot_nonce(boot_id)`."""
    sources: EvidenceSources
    served: ServedIdentity | None = None
    """The digests of the code and models this start runs (`node.code_identity`), once hashed (`with_served`)."""
    bound: BoundIdentity | None = None
    """What the evidence binds beside the key (binding v2): the TLS key, the code and the models; None until
    `with_served` (the start's first evidence, v1, only answers the node policy's hardware check)."""

    @classmethod
    def start(cls, sources: EvidenceSources | None = None) -> NodeIdentity:
        """A new key and boot id, and the evidence binding them; raises EvidenceUnavailable when a TEE
        interface is present but fails (a broken confidential machine never passes for a plain one)."""
        sources = sources or EvidenceSources()
        signer, boot_id = NodeSigner.generate(), uuid.uuid4().hex
        return cls(signer, boot_id, cls._collect(signer, boot_id, boot_nonce(boot_id), sources), sources)

    @staticmethod
    def _collect(signer: NodeSigner, boot_id: str, nonce: bytes, sources: EvidenceSources,
                 bound: BoundIdentity | None = None) -> Evidence:
        return collect_evidence(signer.public_key, nonce, boot_id, tsm_root=sources.tsm_root,
                                sev_guest=sources.sev_guest, nvml=sources.nvml, bound=bound)

    @property
    def evidence_digest(self) -> str:
        return self.evidence.digest()

    def evidence_for(self, nonce: bytes) -> Evidence:
        """Fresh evidence under a verifier's 32-byte nonce (hardware calls: run it off the event loop)."""
        return self._collect(self.signer, self.boot_id, nonce, self.sources, self.bound)

    def with_served(self, served: ServedIdentity, tls_spki_sha256: bytes | None) -> NodeIdentity:
        """This identity naming what the start runs, and the boot's evidence collected again to bind it (binding
        v2: the key, the TLS key when the node serves TLS, the code and the models): `GET /v1/node`, the ledger
        segment's header and every evidence document show it."""
        bound = BoundIdentity.of(tls_spki_sha256=tls_spki_sha256, code_digest=bytes.fromhex(served.code.digest),
                                 model_digests=[(model.model_id, bytes.fromhex(model.digest))
                                                for model in served.models])
        evidence = self._collect(self.signer, self.boot_id, boot_nonce(self.boot_id), self.sources, bound)
        return dataclasses.replace(self, served=served, bound=bound, evidence=evidence)

    def write_evidence(self, directory: Path) -> Path:
        """The boot's evidence document beside its ledger segment; it holds keys and ids, nothing of a prompt."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.boot_id}{EVIDENCE_SUFFIX}"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.evidence.document(), sort_keys=True, indent=1) + "\n")
        os.replace(temporary, path)
        return path
