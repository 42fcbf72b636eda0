"""The node's TLS channel: a key pair made at start in memory, a self-signed certificate for this boot, and the
server context that serves it (`tenzro node serve --tls`, on by default under a policy with `require.tls`).

A caller who trusts a node's attested hardware must know that its prompt reaches that node and no one in
between: the channel's key is made inside the node's process, never leaves it, and the certificate's SPKI
SHA-256 (`NodeCertificate.spki_sha256`) is what the attestation binding names, so a verifier who pins that
hash talks to the attested process. Nothing else vouches for the key: there is no CA, and no name to check.

- **The key** is ECDSA P-256 (pyca/cryptography): what every TLS stack accepts for a server key (Ed25519 is not
  widely accepted in TLS server certificates), and cheap to make at every start. It is never written and never
  logged: it exists as an object in this process until the server context has read it, then only inside
  OpenSSL's context. Its PEM bytes are freed after loading (overwritten by glibc when the process runs as the
  node makes it: `node.hygiene`'s freed-memory setting).
- **Loading without a file.** `ssl.SSLContext.load_cert_chain` reads only paths. The PEM is written into an
  anonymous pipe and OpenSSL opens the pipe's read end by its `/dev/fd/N` name: the bytes sit in the kernel's
  pipe buffer (kernel memory, never swapped, never a file on any file system, not even tmpfs or a memfd's
  shmem, which can be swapped) until OpenSSL's read consumes them; both ends are closed in a `finally`, so an
  error leaves nothing behind. The certificate and key each get their own pipe, as OpenSSL opens each file once.
  A temporary file, even unlinked at once, would sit in a directory others may back up or snapshot, and on a
  disk; a memfd would work too but its pages can be swapped out on a node that does not forbid swap.
- **The certificate** is self-signed and its lifetime is the boot's: valid from a minute before the start (for
  a client's clock a little behind) for `CERTIFICATE_LIFETIME` (30 days). A node serving longer must be
  restarted (a new boot: a new key, certificate and evidence); clients check the dates of a pinned certificate
  too. Its subject alternative names are loopback and the host it serves on, so a client trusting exactly
  this certificate (`client_context`) also passes the hostname check there.
- **TLS 1.3 only.** The certificate is made per boot, so it identifies the boot: TLS 1.2 sends it in clear,
  letting anyone on the path link a caller's connections to one node start, where 1.3 encrypts it. 1.3 also
  has only forward-secret key exchanges and AEAD ciphers, with no suites or renegotiation to configure, and
  one round trip fewer to set up a connection. Every maintained client stack (OpenSSL 1.1.1+, Go, rustls,
  browsers, the official OpenAI clients) speaks it.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from client.channel import spki_sha256

CERTIFICATE_LIFETIME = datetime.timedelta(days=30)
"""How long after its start a node's certificate stays valid: a boot older than this is restarted."""
CLOCK_SKEW = datetime.timedelta(minutes=1)
"""The certificate is valid from this long before the start: a client whose clock is a little behind accepts it."""
MINIMUM_VERSION = ssl.TLSVersion.TLSv1_3
SUBJECT = "tenzro node"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Hosts that listen on every address: they name no address a client connects to."""


class TlsError(RuntimeError):
    """TLS could not be set up at start; the message says why."""


@dataclass(frozen=True, slots=True)
class NodeCertificate:
    """This boot's certificate (public): what `GET /v1/node` shows and the attestation binding names."""

    der: bytes
    spki_sha256: bytes
    """SHA-256 of `der`'s SubjectPublicKeyInfo, 32 bytes (`spki_sha256`)."""

    @classmethod
    def of(cls, der: bytes) -> NodeCertificate:
        return cls(der, spki_sha256(der))

    @property
    def spki_sha256_hex(self) -> str:
        """Lowercase hex, 64 characters."""
        return self.spki_sha256.hex()

    @property
    def pem(self) -> str:
        return ssl.DER_cert_to_PEM_cert(self.der)

    @property
    def curl_pin(self) -> str:
        """The pin as curl's `--pinnedpubkey` takes it."""
        return "sha256//" + base64.b64encode(self.spki_sha256).decode()

    @property
    def not_after(self) -> datetime.datetime:
        return x509.load_der_x509_certificate(self.der).not_valid_after_utc


def tls_json(certificate: NodeCertificate | None) -> dict[str, Any]:
    """`GET /v1/node`'s `tls`: whether the node serves HTTPS, and with which certificate (None: plain HTTP)."""
    if certificate is None:
        return {"on": False, "spki_sha256": None, "certificate_pem": None}
    return {"on": True, "spki_sha256": certificate.spki_sha256_hex, "certificate_pem": certificate.pem}


def _alternative_names(host: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for name in dict.fromkeys([*LOOPBACK_NAMES, *(() if host in WILDCARD_HOSTS else (host,))]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    return names


def _self_signed(key: ec.EllipticCurvePrivateKey, host: str, now: datetime.datetime) -> x509.Certificate:
    """An end-entity certificate for TLS servers, self-signed: its own trust anchor for a client that pins it."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SUBJECT)])
    public_key = key.public_key()
    return (x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CERTIFICATE_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(_alternative_names(host)), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False)
            .sign(key, hashes.SHA256()))


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe holding `data` whole, its write end closed (so a reader sees the end after it)."""
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        written = os.write(write_end, data)
    except OSError as exc:
        os.close(read_end)
        raise TlsError(f"could not pass the TLS key to OpenSSL through a pipe: {exc}") from exc
    finally:
        os.close(write_end)
    if written != len(data):
        os.close(read_end)
        raise TlsError(f"a pipe holds {written} of the {len(data)} bytes of a PEM block: the pipe is too small")
    return read_end


def _load_in_memory(context: ssl.SSLContext, certificate_pem: bytes, key_pem: bytes) -> None:
    """`context.load_cert_chain` from bytes, through pipes rather than files (see the module's docstring)."""
    opened: list[int] = []
    try:
        opened.append(_pipe_holding(certificate_pem))
        opened.append(_pipe_holding(key_pem))
        context.load_cert_chain(f"/dev/fd/{opened[0]}", f"/dev/fd/{opened[1]}")
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"OpenSSL could not load the node's TLS key through /dev/fd: {exc}") from exc
    finally:
        for descriptor in opened:
            os.close(descriptor)


def server_context(certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> ssl.SSLContext:
    """A TLS 1.3 server context serving `certificate` with `key`, neither written to any file."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _load_in_memory(context, certificate.public_bytes(serialization.Encoding.PEM), key_pem)
    return context


@dataclass(frozen=True, slots=True)
class NodeTls:
    """What the node serves HTTPS with: the server context (holding the key) and the certificate (public)."""

    certificate: NodeCertificate
    context: ssl.SSLContext

    @classmethod
    def start(cls, host: str) -> NodeTls:
        """A new key and a certificate for this boot, valid for loopback and `host` (the address served on)."""
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _self_signed(key, host, datetime.datetime.now(datetime.UTC))
        context = server_context(certificate, key)
        return cls(NodeCertificate.of(certificate.public_bytes(serialization.Encoding.DER)), context)


def client_context(certificate_pem: str) -> ssl.SSLContext:
    """A client context trusting exactly this one certificate (TLS 1.3, hostname checked): pinning for a client
    that has the certificate, e.g. from `GET /v1/node` once its `spki_sha256` matched a hash obtained out of band
    (the node's start line, verified evidence)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=certificate_pem)
    context.minimum_version = MINIMUM_VERSION
    return context
