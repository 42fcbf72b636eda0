"""Certificate chains from a TEE's signing key up to the verifier's trust roots.

    AMD:   VCEK <- ASK <- ARK        RSASSA-PSS, SHA-384, MGF1-SHA-384, salt 48 (every link)
    Intel: PCK  <- Platform CA <- Intel SGX Root CA      ECDSA P-256 with SHA-256

A link holds when the issuer's subject is the certificate's issuer name, the issuer is a CA (basic
constraints), the certificate uses the vendor's algorithm, and the signature verifies under the issuer's key;
every certificate on the path must also be valid at the verification time. The walk starts at the leaf
and stops at a trusted root: roots come only from the verifier's trust directory, never from the evidence.

The trust directory holds PEM files, each role under one fixed name:

    ark.pem         AMD Root Key(s) (ARK), self-signed, RSASSA-PSS SHA-384. Required for SEV-SNP.
                    May hold several (Milan, Genoa, Turin); the VCEK's chain picks the one it names.
    ask.pem         AMD SEV Key(s) (ASK) signed by an ARK. Optional: without it the ASK comes from
                    the evidence's certificate table, and is checked against ark.pem all the same.
    intel_root.pem  Intel SGX Root CA, self-signed, ECDSA P-256. Required for TDX.
    nvidia_device_root.pem   NVIDIA Device Identity CA, self-signed, ECDSA P-384. Required for GPU evidence.
    nvidia_rim_root.pem      NVIDIA CoRIM signing Root CA, self-signed, ECDSA P-384: the RIM files' root.

AMD publishes ARK and ASK per product at https://kdsintf.amd.com/vcek/v1/<product>/cert_chain (ASK
first, then ARK: split it into the two files); Intel publishes the root at
https://certificates.trustedservices.intel.com/Intel_SGX_Provisioning_Certification_RootCA.pem.
NVIDIA publishes both in nvtrust (`certs/verifier_device_root.pem`, `certs/verifier_RIM_root.pem`).
Any other .pem file in the directory is an error: a root under a wrong name would otherwise be
silently unused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import SignatureAlgorithmOID

from attestation.errors import VerificationError

MAX_CHAIN_LENGTH = 4
"""Leaf, at most two intermediates, root: the longest path either vendor issues."""
AMD_PSS_SALT_BYTES = 48

ARK_FILE = "ark.pem"
ASK_FILE = "ask.pem"
INTEL_ROOT_FILE = "intel_root.pem"
NVIDIA_DEVICE_ROOT_FILE = "nvidia_device_root.pem"
NVIDIA_RIM_ROOT_FILE = "nvidia_rim_root.pem"
TRUST_ROOT_FILES = (ARK_FILE, ASK_FILE, INTEL_ROOT_FILE, NVIDIA_DEVICE_ROOT_FILE, NVIDIA_RIM_ROOT_FILE)


def _verify_pss_sha384(key: CertificatePublicKeyTypes, certificate: x509.Certificate) -> None:
    if not isinstance(key, rsa.RSAPublicKey):
        raise InvalidSignature("the issuer's key is not RSA")
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=AMD_PSS_SALT_BYTES)
    key.verify(certificate.signature, certificate.tbs_certificate_bytes, pss, hashes.SHA384())


def _verify_ecdsa_sha256(key: CertificatePublicKeyTypes, certificate: x509.Certificate) -> None:
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise InvalidSignature("the issuer's key is not EC P-256")
    key.verify(certificate.signature, certificate.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))


def _verify_ecdsa_sha384(key: CertificatePublicKeyTypes, certificate: x509.Certificate) -> None:
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise InvalidSignature("the issuer's key is not EC P-384")
    key.verify(certificate.signature, certificate.tbs_certificate_bytes, ec.ECDSA(hashes.SHA384()))


@dataclass(frozen=True, slots=True)
class SignatureScheme:
    """How one vendor signs its certificates."""

    name: str
    algorithm: x509.ObjectIdentifier
    verify: Callable[[CertificatePublicKeyTypes, x509.Certificate], None]  # raises InvalidSignature

    def verifies(self, certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
        """Whether `issuer`'s key made `certificate`'s signature, under exactly this scheme."""
        if certificate.signature_algorithm_oid != self.algorithm:
            return False
        try:
            self.verify(issuer.public_key(), certificate)
        except InvalidSignature:
            return False
        return True


AMD_SCHEME = SignatureScheme("RSASSA-PSS SHA-384 salt 48", SignatureAlgorithmOID.RSASSA_PSS, _verify_pss_sha384)
INTEL_SCHEME = SignatureScheme("ECDSA P-256 SHA-256", SignatureAlgorithmOID.ECDSA_WITH_SHA256, _verify_ecdsa_sha256)
NVIDIA_SCHEME = SignatureScheme("ECDSA P-384 SHA-384", SignatureAlgorithmOID.ECDSA_WITH_SHA384, _verify_ecdsa_sha384)
SELF_SIGNED: dict[str, SignatureScheme] = {ARK_FILE: AMD_SCHEME, INTEL_ROOT_FILE: INTEL_SCHEME,
                                           NVIDIA_DEVICE_ROOT_FILE: NVIDIA_SCHEME, NVIDIA_RIM_ROOT_FILE: NVIDIA_SCHEME}
"""Files whose certificates are roots, and the scheme each must be self-signed with."""


def describe(certificate: x509.Certificate) -> str:
    return certificate.subject.rfc4514_string() or f"serial {certificate.serial_number:#x}"


def describe_path(path: Sequence[x509.Certificate], scheme: SignatureScheme) -> str:
    return " <- ".join(describe(certificate) for certificate in path) + f" ({scheme.name})"


def verify_chain(
    leaf: x509.Certificate,
    carried: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
    scheme: SignatureScheme,
    now: datetime,
) -> tuple[x509.Certificate, ...]:
    """The path leaf -> ... -> root, each link verified; `carried` are intermediates the evidence brings.

    Raises `VerificationError("untrusted-chain")` when no path reaches a root in `roots`, and
    `"expired-certificate"` when a certificate on the path is not valid at `now`.
    """
    path = [leaf]
    # A self-signed certificate the evidence brings can only end a path, never reach a trusted root.
    pool = [certificate for certificate in carried if certificate.issuer != certificate.subject and certificate != leaf]
    while len(path) <= MAX_CHAIN_LENGTH:
        current = path[-1]
        root = _issuer_among(current, roots, scheme)
        if root is not None:
            path.append(root)
            _check_validity(path, now)
            return tuple(path)
        issuer = _issuer_among(current, pool, scheme)
        if issuer is None:
            raise VerificationError("untrusted-chain", _no_issuer(current, [*roots, *pool], scheme))
        pool.remove(issuer)
        path.append(issuer)
    raise VerificationError("untrusted-chain", f"no trusted root within {MAX_CHAIN_LENGTH} links of {describe(leaf)}")


def _issuer_among(
    certificate: x509.Certificate, candidates: Sequence[x509.Certificate], scheme: SignatureScheme
) -> x509.Certificate | None:
    for candidate in candidates:
        if candidate.subject == certificate.issuer and _is_ca(candidate) and scheme.verifies(certificate, candidate):
            return candidate
    return None


def _is_ca(certificate: x509.Certificate) -> bool:
    """Whether `certificate` may issue others (basic constraints cA), as Go's x509 and OpenSSL require of every
    issuer: otherwise a leaf's key (a PCK key extracted from one out-of-date platform) could mint a PCK certificate or
    a TCB Signing certificate of its choosing, and its chain would still reach the vendor's root."""
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _no_issuer(certificate: x509.Certificate, candidates: list[x509.Certificate], scheme: SignatureScheme) -> str:
    issuer = certificate.issuer.rfc4514_string()
    if certificate.signature_algorithm_oid != scheme.algorithm:
        return f"{describe(certificate)} is not signed with {scheme.name}"
    named = [candidate for candidate in candidates if candidate.subject == certificate.issuer]
    if any(not _is_ca(candidate) and scheme.verifies(certificate, candidate) for candidate in named):
        return f"{describe(certificate)} is signed by {issuer}, which is no CA (basic constraints): it cannot issue"
    if named:
        return (f"{describe(certificate)} names issuer {issuer}, but its signature does not verify under "
                "that certificate's key: the chain was signed by another root")
    return f"{describe(certificate)} is issued by {issuer}, which is neither a trusted root nor in the evidence"


def _check_validity(path: list[x509.Certificate], now: datetime) -> None:
    for certificate in path:
        if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
            raise VerificationError(
                "expired-certificate",
                f"{describe(certificate)} is valid from {certificate.not_valid_before_utc.isoformat()} to "
                f"{certificate.not_valid_after_utc.isoformat()}, not at {now.isoformat()}",
            )


@dataclass(frozen=True, slots=True)
class TrustRoots:
    directory: Path
    amd_arks: tuple[x509.Certificate, ...]
    amd_asks: tuple[x509.Certificate, ...]  # empty: take the ASK from the evidence
    intel_roots: tuple[x509.Certificate, ...]
    nvidia_device_roots: tuple[x509.Certificate, ...] = ()
    nvidia_rim_roots: tuple[x509.Certificate, ...] = ()

    def roots_in(self, file: str, evidence_type: str) -> tuple[x509.Certificate, ...]:
        """The roots loaded from `file` (a self-signed role); `missing-trust-root` when there are none."""
        roots = {ARK_FILE: self.amd_arks, INTEL_ROOT_FILE: self.intel_roots,
                 NVIDIA_DEVICE_ROOT_FILE: self.nvidia_device_roots, NVIDIA_RIM_ROOT_FILE: self.nvidia_rim_roots}[file]
        if not roots:
            raise VerificationError(
                "missing-trust-root", f"{evidence_type} evidence needs {self.directory / file}, which is absent"
            )
        return roots


def load_trust_roots(directory: str | os.PathLike[str]) -> TrustRoots:
    """Read and check the trust directory; raises `VerificationError` with `missing-trust-root` or `bad-trust-root`."""
    path = Path(directory)
    if not path.is_dir():
        raise VerificationError("missing-trust-root", f"trust root directory {path} does not exist")
    unknown = sorted(file.name for file in path.glob("*.pem") if file.name not in TRUST_ROOT_FILES)
    if unknown:
        raise VerificationError(
            "bad-trust-root",
            f"unknown files {unknown} in {path}; trust roots are named {', '.join(TRUST_ROOT_FILES)}",
        )
    return TrustRoots(
        directory=path,
        amd_arks=_load(path / ARK_FILE),
        amd_asks=_load(path / ASK_FILE),
        intel_roots=_load(path / INTEL_ROOT_FILE),
        nvidia_device_roots=_load(path / NVIDIA_DEVICE_ROOT_FILE),
        nvidia_rim_roots=_load(path / NVIDIA_RIM_ROOT_FILE),
    )


def _load(file: Path) -> tuple[x509.Certificate, ...]:
    if not file.exists():
        return ()
    try:
        certificates = x509.load_pem_x509_certificates(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise VerificationError("bad-trust-root", f"{file} is not a readable PEM certificate file: {exc}") from exc
    scheme = SELF_SIGNED.get(file.name)
    if scheme is None:
        return tuple(certificates)
    for certificate in certificates:
        if certificate.issuer != certificate.subject or not scheme.verifies(certificate, certificate):
            raise VerificationError(
                "bad-trust-root", f"{describe(certificate)} in {file} is not a root self-signed with {scheme.name}"
            )
    return tuple(certificates)


def check_crl(
    certificate: x509.Certificate, issuer: x509.Certificate, crl_bytes: bytes, source: str, now: datetime
) -> None:
    """`certificate` must not be on `issuer`'s CRL (DER or PEM, read from `source`, a file name for messages).

    The CRL must name `issuer`, verify under its key and be current at `now`; raises `VerificationError` with
    `bad-collateral`, `expired-collateral` or `revoked`.
    """
    try:
        crl = (x509.load_pem_x509_crl(crl_bytes) if crl_bytes.lstrip().startswith(b"-----")
               else x509.load_der_x509_crl(crl_bytes))
    except ValueError as exc:
        raise VerificationError("bad-collateral", f"{source} is not a DER or PEM CRL: {exc}") from exc
    if crl.issuer != issuer.subject:
        raise VerificationError("bad-collateral", f"{source} is issued by {crl.issuer.rfc4514_string()}, not by "
                                f"{describe(issuer)}, the issuer of {describe(certificate)}")
    if not _crl_signature_valid(crl, issuer):
        raise VerificationError("bad-collateral", f"{source}'s signature does not verify under {describe(issuer)}")
    next_update = crl.next_update_utc
    if not crl.last_update_utc <= now or (next_update is not None and now > next_update):
        raise VerificationError(
            "expired-collateral", f"{source} is current from {crl.last_update_utc.isoformat()} to "
            f"{next_update.isoformat() if next_update else 'no next update'}, not at {now.isoformat()}")
    revoked = crl.get_revoked_certificate_by_serial_number(certificate.serial_number)
    if revoked is not None:
        raise VerificationError("revoked", f"{describe(certificate)} (serial {certificate.serial_number:#x}) is "
                                f"revoked by {describe(issuer)} since {revoked.revocation_date_utc.isoformat()} "
                                f"({source})")


def _crl_signature_valid(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    key = issuer.public_key()
    if not isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
        return False
    try:
        return crl.is_signature_valid(key)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return False
