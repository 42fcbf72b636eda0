"""The evidence document: what the node hands out per request and what a verifier checks offline.

    {"format": "tenzro-evidence-v1", "type": "sev-snp" | "tdx" | "none",
     "source": "configfs-tsm" | "sev-guest" | "none",
     "report": base64 | null,   # SNP: the 1184-byte report; TDX: the quote; none: null
     "aux": base64 | null,      # SNP: the certificate table (auxblob / extended report); else null
     "gpu": null | {"cc_enabled": bool, "environment": "unavailable" | "sim" | "prod" | "unknown",
                    "dev_tools": bool, "ready": bool | null,
                    "devices": [{"index": int, "uuid": str, "report": base64, "cert_chain": base64}]},
     "public_key": hex (32 bytes), "boot_id": str, "nonce": hex (32 bytes)}

The v2 document ("format": "tenzro-evidence-v2") has the same members and three more, the values
binding v2 ties into report_data beside the key and nonce (`attestation.binding`), so a verifier
recomputes report_data from the document alone:

     "tls_spki_sha256": hex (32 bytes) | null,   # null: the node served plain HTTP
     "code_digest": hex (32 bytes),
     "models": [{"id": str, "digest": hex (32 bytes)}, ...]   # ascending by id, at least one

A v1 document (no such members) binds the key and nonce only; a verifier tells them apart by `format`.
Every string is ASCII, so `json.dumps(sort_keys=True, separators=(",", ":"))` is already the RFC 8785
form, and `evidence_digest` can name a document in signed usage records with that one encoding.
The document's claims are only claims: a verifier trusts what the hardware signed, never `type`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from attestation.binding import BoundIdentity, ModelDigest, require_nonce, require_public_key
from attestation.errors import MalformedEvidence, VerificationError

EvidenceType = Literal["sev-snp", "tdx", "none"]
EvidenceSource = Literal["configfs-tsm", "sev-guest", "none"]
GpuEnvironment = Literal["unavailable", "sim", "prod", "unknown"]
EVIDENCE_TYPES: tuple[EvidenceType, ...] = get_args(EvidenceType)
EVIDENCE_SOURCES: tuple[EvidenceSource, ...] = get_args(EvidenceSource)
GPU_ENVIRONMENTS: tuple[GpuEnvironment, ...] = get_args(GpuEnvironment)
DOCUMENT_FORMAT_V1 = "tenzro-evidence-v1"
DOCUMENT_FORMAT_V2 = "tenzro-evidence-v2"
DOCUMENT_FORMATS = (DOCUMENT_FORMAT_V1, DOCUMENT_FORMAT_V2)

SOURCE_TYPES: dict[EvidenceSource, tuple[EvidenceType, ...]] = {
    "configfs-tsm": ("sev-snp", "tdx"),
    "sev-guest": ("sev-snp",),
    "none": ("none",),
}
"""Which evidence types each source can produce; any other pairing is a forged or broken document."""

_BOOT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DOCUMENT_KEYS_V1 = frozenset({"format", "type", "source", "report", "aux", "gpu", "public_key", "boot_id", "nonce"})
_DOCUMENT_KEYS = {
    DOCUMENT_FORMAT_V1: _DOCUMENT_KEYS_V1,
    DOCUMENT_FORMAT_V2: _DOCUMENT_KEYS_V1 | {"tls_spki_sha256", "code_digest", "models"},
}
_MODEL_KEYS = frozenset({"id", "digest"})
_GPU_KEYS = frozenset({"cc_enabled", "environment", "dev_tools", "ready", "devices"})
_DEVICE_KEYS = frozenset({"index", "uuid", "report", "cert_chain"})


@dataclass(frozen=True, slots=True)
class GpuDeviceReport:
    """One GPU's attestation as NVML returned it, requested with the binding digest as nonce."""

    index: int  # NVML device index
    uuid: str  # "GPU-..." as NVML names the device
    report: bytes  # SPDM GET_MEASUREMENTS request (37 bytes) || signed response
    cert_chain: bytes  # the device's attestation certificate chain, PEM text

    def document(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "report": _b64(self.report),
                "cert_chain": _b64(self.cert_chain)}


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """NVIDIA confidential computing state of the machine; `devices` is empty unless CC is on."""

    cc_enabled: bool
    environment: GpuEnvironment
    dev_tools: bool  # devtools mode lets a debugger read GPU memory
    ready: bool | None  # GPUs accept client work; None when CC is off (not asked)
    devices: tuple[GpuDeviceReport, ...]

    def __post_init__(self) -> None:
        if self.environment not in GPU_ENVIRONMENTS:
            raise MalformedEvidence(f"gpu environment must be one of {', '.join(GPU_ENVIRONMENTS)}")
        if not self.cc_enabled and (self.devices or self.ready is not None):
            raise MalformedEvidence("gpu evidence with CC off carries no device reports and no ready state")

    def document(self) -> dict[str, Any]:
        return {"cc_enabled": self.cc_enabled, "environment": self.environment, "dev_tools": self.dev_tools,
                "ready": self.ready, "devices": [device.document() for device in self.devices]}


@dataclass(frozen=True, slots=True)
class Evidence:
    """One request's evidence. `report` and `aux` are empty for `none`, which is never trusted."""

    evidence_type: EvidenceType
    source: EvidenceSource
    report: bytes
    aux: bytes  # the SNP certificate table; empty when the host supplied none, and for TDX and none
    gpu: GpuEvidence | None  # None: no NVML on this machine
    public_key: bytes  # the node's raw Ed25519 metering key
    boot_id: str
    nonce: bytes  # the verifier's 32-byte nonce
    bound: BoundIdentity | None = None  # TLS, code and models bound too (binding v2); None: key and nonce only (v1)

    def __post_init__(self) -> None:
        if self.evidence_type not in EVIDENCE_TYPES:
            raise MalformedEvidence(f"type must be one of {', '.join(EVIDENCE_TYPES)}, got {self.evidence_type!r}")
        if self.source not in EVIDENCE_SOURCES or self.evidence_type not in SOURCE_TYPES[self.source]:
            raise MalformedEvidence(f"source {self.source!r} cannot produce {self.evidence_type} evidence")
        if self.evidence_type == "none" and (self.report or self.aux):
            raise MalformedEvidence("none evidence carries no report and no aux blob")
        if self.evidence_type != "none" and not self.report:
            raise MalformedEvidence(f"{self.evidence_type} evidence needs a report")
        if self.evidence_type == "tdx" and self.aux:
            raise MalformedEvidence("tdx evidence carries its certificates inside the quote, not in aux")
        require_public_key(self.public_key)
        require_nonce(self.nonce)
        if self.bound is not None and not isinstance(self.bound, BoundIdentity):
            raise MalformedEvidence(f"bound values must be a BoundIdentity, got a {type(self.bound).__name__}")
        if not isinstance(self.boot_id, str) or not _BOOT_ID.fullmatch(self.boot_id):
            raise MalformedEvidence(f"boot_id must be 1-64 characters of A-Z a-z 0-9 _ -, got {self.boot_id!r}")

    @property
    def trusted(self) -> bool:
        """Whether the evidence can be hardware-backed at all; `none` never is, whatever a verifier allows."""
        return self.evidence_type != "none"

    def document(self) -> dict[str, Any]:
        """The JSON-serialisable document, v2 when values are bound beside the key; `from_document` reads it back."""
        document: dict[str, Any] = {
            "format": DOCUMENT_FORMAT_V1 if self.bound is None else DOCUMENT_FORMAT_V2,
            "type": self.evidence_type,
            "source": self.source,
            "report": _b64(self.report) if self.report else None,
            "aux": _b64(self.aux) if self.aux else None,
            "gpu": None if self.gpu is None else self.gpu.document(),
            "public_key": self.public_key.hex(),
            "boot_id": self.boot_id,
            "nonce": self.nonce.hex(),
        }
        if self.bound is not None:
            tls = self.bound.tls_spki_sha256
            document["tls_spki_sha256"] = None if tls is None else tls.hex()
            document["code_digest"] = self.bound.code_digest.hex()
            document["models"] = [{"id": model.model_id, "digest": model.digest.hex()} for model in self.bound.models]
        return document

    @classmethod
    def from_document(cls, document: object) -> Evidence:
        """Parse a document; raises `VerificationError("malformed-document")` naming the bad field."""
        try:
            return _evidence_from(document)
        except MalformedEvidence as exc:
            raise VerificationError("malformed-document", str(exc)) from exc

    def digest(self) -> str:
        return evidence_digest(self.document())


def evidence_digest(document: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys, no spaces, ASCII) of an evidence document."""
    encoded = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(encoded.encode("ascii")).hexdigest()


def _evidence_from(document: object) -> Evidence:
    if not isinstance(document, dict):
        raise MalformedEvidence("evidence document must be a JSON object")
    form = document.get("format", DOCUMENT_FORMAT_V1)  # a missing format is named as a missing member below
    if not isinstance(form, str) or form not in DOCUMENT_FORMATS:
        raise MalformedEvidence(f"format must be {' or '.join(map(repr, DOCUMENT_FORMATS))}, got {form!r}")
    doc = _object(document, "evidence document", _DOCUMENT_KEYS[form])
    gpu = doc["gpu"]
    return Evidence(
        evidence_type=doc["type"],
        source=doc["source"],
        report=b"" if doc["report"] is None else _from_b64(doc["report"], "report"),
        aux=b"" if doc["aux"] is None else _from_b64(doc["aux"], "aux"),
        gpu=None if gpu is None else _gpu_from(gpu),
        public_key=_from_hex(doc["public_key"], "public_key"),
        boot_id=doc["boot_id"],
        nonce=_from_hex(doc["nonce"], "nonce"),
        bound=_bound_from(doc) if form == DOCUMENT_FORMAT_V2 else None,
    )


def _bound_from(doc: dict[str, Any]) -> BoundIdentity:
    """The v2 members. Models stay in the document's order: one not in canonical order is refused, not sorted,
    so a document has one form and one digest."""
    tls = doc["tls_spki_sha256"]
    if not isinstance(doc["models"], list):
        raise MalformedEvidence("models must be a list")
    models = tuple(_model_from(model) for model in doc["models"])
    return BoundIdentity(tls_spki_sha256=None if tls is None else _from_hex(tls, "tls_spki_sha256"),
                         code_digest=_from_hex(doc["code_digest"], "code_digest"), models=models)


def _model_from(value: object) -> ModelDigest:
    model = _object(value, "model", _MODEL_KEYS)
    return ModelDigest(model_id=model["id"], digest=_from_hex(model["digest"], f"model {model['id']!r} digest"))


def _gpu_from(value: object) -> GpuEvidence:
    gpu = _object(value, "gpu", _GPU_KEYS)
    for name in ("cc_enabled", "dev_tools"):
        if not isinstance(gpu[name], bool):
            raise MalformedEvidence(f"gpu.{name} must be true or false")
    if gpu["ready"] is not None and not isinstance(gpu["ready"], bool):
        raise MalformedEvidence("gpu.ready must be true, false or null")
    if not isinstance(gpu["devices"], list):
        raise MalformedEvidence("gpu.devices must be a list")
    return GpuEvidence(cc_enabled=gpu["cc_enabled"], environment=gpu["environment"], dev_tools=gpu["dev_tools"],
                       ready=gpu["ready"], devices=tuple(_device_from(device) for device in gpu["devices"]))


def _device_from(value: object) -> GpuDeviceReport:
    device = _object(value, "gpu device", _DEVICE_KEYS)
    if type(device["index"]) is not int or device["index"] < 0:
        raise MalformedEvidence("gpu device index must be a non-negative integer")
    if not isinstance(device["uuid"], str) or not device["uuid"].isascii():
        raise MalformedEvidence("gpu device uuid must be an ASCII string")
    return GpuDeviceReport(index=device["index"], uuid=device["uuid"],
                           report=_from_b64(device["report"], "gpu device report"),
                           cert_chain=_from_b64(device["cert_chain"], "gpu device cert_chain"))


def _object(value: object, what: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedEvidence(f"{what} must be a JSON object")
    if set(value) != keys:
        missing, unknown = sorted(keys - set(value)), sorted(set(value) - keys)
        raise MalformedEvidence(f"{what}: missing members {missing}, unknown members {unknown}")
    return value


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _from_b64(value: object, field: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedEvidence(f"{field} must be a base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise MalformedEvidence(f"{field} is not valid base64: {exc}") from exc


def _from_hex(value: object, field: str) -> bytes:
    if not isinstance(value, str) or not re.fullmatch(r"(?:[0-9a-f]{2})*", value):
        raise MalformedEvidence(f"{field} must be lowercase hex")
    return bytes.fromhex(value)
