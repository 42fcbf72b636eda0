"""The TLS channel a caller pins: the node's certificate as the first handshake presents it, then every request
only to a peer presenting exactly that certificate.

The node's certificate is self-signed and made at its start (no CA vouches for it); what vouches for it is the
node's attestation evidence, which binds the certificate's SPKI SHA-256. So the caller takes whatever certificate
the first handshake presents, without trusting it, and pins it: every later connection (the evidence request
first) must present the very same certificate (aiohttp's `Fingerprint`, SHA-256 of the DER certificate), and the
verdict compares the pinned certificate's SPKI with the one the evidence binds. A man in the middle who terminates
TLS with a key of its own is then pinned, and its SPKI is not the one the hardware signed; one who relays the
genuine node's handshake cannot read the channel.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

HANDSHAKE_TIMEOUT_S = 10.0


class ChannelError(Exception):
    """The node's TLS channel could not be opened or is not what it must be."""


@dataclass(frozen=True, slots=True)
class PinnedChannel:
    url: str
    """The node's base URL, https://host:port."""
    certificate_der: bytes

    @property
    def fingerprint(self) -> bytes:
        """SHA-256 of the DER certificate: what every pinned connection must present."""
        return hashlib.sha256(self.certificate_der).digest()

    @property
    def spki_sha256(self) -> bytes:
        """SHA-256 of the certificate's DER SubjectPublicKeyInfo: what the evidence binds."""
        return spki_sha256(self.certificate_der)

    def pin(self) -> aiohttp.Fingerprint:
        """For aiohttp's `ssl=`: a connection succeeds only to a peer presenting this certificate."""
        return aiohttp.Fingerprint(self.fingerprint)

    def ssl_context(self) -> ssl.SSLContext:
        """For any other client (httpx, and so the official openai client): a context trusting exactly this
        certificate, TLS 1.3. The node's certificate names the addresses it serves on, which the context checks."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.certificate_der)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context


def spki_sha256(certificate_der: bytes) -> bytes:
    """SHA-256 of a certificate's DER SubjectPublicKeyInfo (32 bytes): the value a client pins (as curl's
    `--pinnedpubkey sha256//BASE64` does) and the attestation binding names. The same for any certificate of the
    same key, whatever its dates or names; the node (`node/tls.py`) computes it here too."""
    public_key = x509.load_der_x509_certificate(certificate_der).public_key()
    return hashlib.sha256(public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)).digest()


async def open_channel(url: str) -> PinnedChannel:
    """The certificate the node at `url` (https) presents now, taken untrusted to be pinned and checked against the
    evidence."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ChannelError(f"{url}: a node is verified over https only (start it with --tls); plain http carries "
                           "nothing a caller can check")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # vouched for by the evidence, not by a CA: checked in the verdict
    port = parts.port or 443
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, port, ssl=context, server_hostname=parts.hostname),
            HANDSHAKE_TIMEOUT_S)
    except (OSError, TimeoutError, ssl.SSLError) as exc:
        raise ChannelError(f"{url}: no TLS handshake: {exc}") from exc
    try:
        tls = writer.get_extra_info("ssl_object")
        certificate = tls.getpeercert(binary_form=True) if tls is not None else None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (OSError, ssl.SSLError):
            pass
    del reader
    if not certificate:
        raise ChannelError(f"{url}: the peer presented no certificate")
    return PinnedChannel(f"https://{parts.netloc}", certificate)
