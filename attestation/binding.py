"""Key binding: the 64 bytes of report_data that tie a TEE report to the node key, what it serves, and a nonce.

The hardware signs report_data, so a report carrying this value says "the guest that holds this key
(and, in v2, serves TLS with this certificate key, runs this code and serves these models) answered
this nonce". Two versions exist, told apart by their domain strings; the evidence document's `format`
says which one a verifier recomputes, and v1 documents stay verifiable because auditors hold old ledgers.

v1 (`tenzro-evidence-v1`): the metering key and the nonce.

    report_data[0:32]  = SHA-256(b"tenzro-attestation-v1\\0" || public_key (32) || nonce (32))
    report_data[32:64] = zero

v2 (`tenzro-evidence-v2`): also the TLS certificate's key, the code identity and the model identities.

    report_data[0:32]  = SHA-256(binding_input)
    report_data[32:64] = zero

    binding_input = b"tenzro-attestation-v2\\0"       22 bytes
                    public_key                        32  raw Ed25519 metering key
                    0x01 || tls_spki_sha256           33  SHA-256 of the certificate's DER SubjectPublicKeyInfo
                      or 0x00                          1  the node serves no TLS (plain HTTP, development)
                    code_digest                       32  the code identity's SHA-256
                    model count                        2  big-endian, at least 1
                    per model, ascending by id:
                      id length                        2  big-endian, 1..256
                      id                               n  printable ASCII, the name callers send as `model`
                      digest                          32  the model directory's SHA-256
                    nonce                             32  the verifier's

Why it is built this way:
- The domain strings keep the digest from ever equalling a hash the node computes for another purpose,
  and a v1 input never equals a v2 input, so a report made under one version never checks under the other.
- Every field has a fixed length, a presence byte or a length (count) prefix before it, so an input
  parses back to exactly one set of values: no two different sets share an input, and only a SHA-256
  collision makes two share a digest.
- The models are in one canonical order (ascending id, no id twice) so the same models give the same
  bytes whatever order the node listed them in; an empty list is refused, because a trust policy that
  checks "every served model is accepted" would pass it vacuously.
- report_data[32:64] stays zero. SHA-256 over the input above already binds every value at 128-bit
  collision resistance, the strength of the Ed25519 key it binds, so a second digest stops no forger
  this one does not. The first 32 bytes are also the nonce of the GPU attestation reports (NVML takes
  exactly 32), so anything put in the second half would be bound by the CPU report and not by the
  GPUs'; zero keeps both binding the same values. A verifier compares all 64 bytes, so a report with
  anything else there is refused, and the space stays free for a later version under a new domain.
- The TLS value may be absent so a plain-HTTP development node still binds its code and models to its
  ledger's evidence; a client that needs an attested channel refuses a binding without one.
- Model ids are printable ASCII so the evidence document stays ASCII (see `attestation.evidence`).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from attestation.errors import MalformedEvidence

BINDING_DOMAIN = b"tenzro-attestation-v1\0"
BINDING_DOMAIN_V2 = b"tenzro-attestation-v2\0"
PUBLIC_KEY_BYTES = 32
NONCE_BYTES = 32
DIGEST_BYTES = 32
"""tls_spki_sha256, code_digest and each model digest are SHA-256 digests."""
REPORT_DATA_BYTES = 64
"""Both SEV-SNP (REPORT_DATA) and TDX (REPORTDATA) carry exactly 64 bytes of guest data."""
MODEL_ID_MAX = 256
MODELS_MAX = 0xFFFF
"""The largest count the two-byte prefix holds."""

_MODEL_ID = re.compile(rf"[\x20-\x7e]{{1,{MODEL_ID_MAX}}}")
_U16 = struct.Struct(">H")
_NO_TLS, _TLS = b"\x00", b"\x01"


def require_public_key(public_key: bytes) -> bytes:
    """The node's raw Ed25519 public key, checked for length."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise MalformedEvidence(
            f"public key must be the {PUBLIC_KEY_BYTES} raw bytes of an Ed25519 key, got {_size(public_key)}"
        )
    return public_key


def require_nonce(nonce: bytes) -> bytes:
    """A verifier nonce, checked for length: exactly 32 bytes, so no shorter guessable nonce passes."""
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise MalformedEvidence(f"nonce must be exactly {NONCE_BYTES} bytes, got {_size(nonce)}")
    return nonce


def require_digest(digest: bytes, field: str) -> bytes:
    """A SHA-256 digest, checked for length; `field` names it in the error."""
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise MalformedEvidence(f"{field} must be a {DIGEST_BYTES}-byte SHA-256 digest, got {_size(digest)}")
    return digest


@dataclass(frozen=True, slots=True)
class ModelDigest:
    """One served model: the id callers name it by and the SHA-256 of its directory."""

    model_id: str
    digest: bytes  # [32]

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not _MODEL_ID.fullmatch(self.model_id):
            raise MalformedEvidence(
                f"model id must be 1-{MODEL_ID_MAX} printable ASCII characters, got {self.model_id!r}"
            )
        require_digest(self.digest, f"model {self.model_id!r} digest")


@dataclass(frozen=True, slots=True)
class BoundIdentity:
    """What binding v2 ties to the key and nonce: the TLS certificate's key, the code and the models serving."""

    tls_spki_sha256: bytes | None  # [32]; None: the node serves plain HTTP, no channel is bound
    code_digest: bytes  # [32]
    models: tuple[ModelDigest, ...]  # ascending by model id, each id once, at least one

    def __post_init__(self) -> None:
        if self.tls_spki_sha256 is not None:
            require_digest(self.tls_spki_sha256, "tls_spki_sha256")
        require_digest(self.code_digest, "code_digest")
        if not isinstance(self.models, tuple) or not all(isinstance(m, ModelDigest) for m in self.models):
            raise MalformedEvidence("models must be a tuple of ModelDigest")
        if not 1 <= len(self.models) <= MODELS_MAX:
            raise MalformedEvidence(f"a binding names 1 to {MODELS_MAX} models, got {len(self.models)}")
        ids = [model.model_id for model in self.models]
        if ids != sorted(set(ids)):
            raise MalformedEvidence(f"models must be in ascending order of id, each id once; got ids {ids}")

    @classmethod
    def of(
        cls, *, tls_spki_sha256: bytes | None, code_digest: bytes, model_digests: Iterable[tuple[str, bytes]]
    ) -> BoundIdentity:
        """From (model id, digest) pairs in any order: puts them in the canonical order; a repeated id is refused."""
        models = sorted((ModelDigest(model_id, digest) for model_id, digest in model_digests),
                        key=lambda model: model.model_id)
        return cls(tls_spki_sha256=tls_spki_sha256, code_digest=code_digest, models=tuple(models))

    def describe(self) -> str:
        """The values in one line, for check lines and error messages."""
        tls = "none (plain HTTP)" if self.tls_spki_sha256 is None else self.tls_spki_sha256.hex()
        models = ", ".join(f"{model.model_id}={model.digest.hex()}" for model in self.models)
        return f"TLS SPKI SHA-256 {tls}, code {self.code_digest.hex()}, models [{models}]"


def binding_input(public_key: bytes, nonce: bytes, bound: BoundIdentity | None = None) -> bytes:
    """The exact bytes hashed into report_data: v1 without `bound`, v2 with it (layout in the module docstring)."""
    key, fresh = require_public_key(public_key), require_nonce(nonce)
    if bound is None:
        return BINDING_DOMAIN + key + fresh
    if not isinstance(bound, BoundIdentity):
        raise MalformedEvidence(f"bound values must be a BoundIdentity, got a {type(bound).__name__}")
    tls = _NO_TLS if bound.tls_spki_sha256 is None else _TLS + bound.tls_spki_sha256
    models = b"".join(
        _U16.pack(len(model.model_id)) + model.model_id.encode("ascii") + model.digest for model in bound.models
    )
    return BINDING_DOMAIN_V2 + key + tls + bound.code_digest + _U16.pack(len(bound.models)) + models + fresh


def binding_digest(public_key: bytes, nonce: bytes, bound: BoundIdentity | None = None) -> bytes:
    """SHA-256 of `binding_input`: 32 bytes, report_data's first half and the GPU reports' nonce."""
    return hashlib.sha256(binding_input(public_key, nonce, bound)).digest()


def report_data_for(public_key: bytes, nonce: bytes, bound: BoundIdentity | None = None) -> bytes:
    """The 64 bytes a TEE report must carry as report_data for this key, nonce and (v2) bound values."""
    return binding_digest(public_key, nonce, bound) + bytes(REPORT_DATA_BYTES - DIGEST_BYTES)


def _size(value: object) -> str:
    return f"{len(value)} bytes" if isinstance(value, bytes) else f"a {type(value).__name__}"
