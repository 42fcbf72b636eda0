"""The node's TLS channel (node/tls.py): the boot's certificate, TLS 1.3 only, the key loaded without a file, and a
real `--tls` node answering a pinned official client, refusing plain HTTP, and writing its key nowhere."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import http.client
import json
import os
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from node import tls
from node.tls import (
    CERTIFICATE_LIFETIME,
    CLOCK_SKEW,
    NodeCertificate,
    NodeTls,
    TlsError,
    client_context,
    spki_sha256,
    tls_json,
)
from tests.node.conftest import Node, launch_node, stop_node, tenzro, unverified_context, wait_healthy


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def openssl_spki_sha256(pem: str) -> bytes:
    """The pin computed as curl's documentation does it, by the openssl command rather than pyca/cryptography."""
    public = subprocess.run(["openssl", "x509", "-pubkey", "-noout"], input=pem.encode(), capture_output=True,
                            check=True).stdout
    der = subprocess.run(["openssl", "pkey", "-pubin", "-outform", "der"], input=public, capture_output=True,
                         check=True).stdout
    return hashlib.sha256(der).digest()


def test_the_certificate_is_self_signed_for_this_boot() -> None:
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    node_tls = NodeTls.start("127.0.0.1")
    certificate = x509.load_der_x509_certificate(node_tls.certificate.der)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tenzro node")])
    assert (certificate.subject, certificate.issuer) == (subject, subject)
    key = certificate.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    assert isinstance(certificate.signature_hash_algorithm, hashes.SHA256)
    key.verify(certificate.signature, certificate.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    start = certificate.not_valid_before_utc + CLOCK_SKEW
    assert before <= start <= datetime.datetime.now(datetime.UTC)
    assert certificate.not_valid_after_utc - certificate.not_valid_before_utc == CERTIFICATE_LIFETIME + CLOCK_SKEW
    assert CERTIFICATE_LIFETIME == datetime.timedelta(days=30) and CLOCK_SKEW == datetime.timedelta(minutes=1)
    assert certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert list(certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert node_tls.certificate.spki_sha256 == openssl_spki_sha256(node_tls.certificate.pem)
    assert len(node_tls.certificate.spki_sha256) == 32
    assert node_tls.certificate.spki_sha256_hex == node_tls.certificate.spki_sha256.hex()


def alternative_names(host: str) -> list[str]:
    der = NodeTls.start(host).certificate.der
    names = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(name.value) for name in names]


def test_the_certificate_names_loopback_and_the_host_served_on() -> None:
    assert alternative_names("127.0.0.1") == ["localhost", "127.0.0.1", "::1"]
    assert alternative_names("0.0.0.0") == ["localhost", "127.0.0.1", "::1"]
    assert alternative_names("::") == ["localhost", "127.0.0.1", "::1"]
    assert alternative_names("10.1.2.3") == ["localhost", "127.0.0.1", "::1", "10.1.2.3"]
    assert alternative_names("node.example") == ["localhost", "127.0.0.1", "::1", "node.example"]


def test_each_start_makes_a_new_key() -> None:
    assert NodeTls.start("127.0.0.1").certificate.spki_sha256 != NodeTls.start("127.0.0.1").certificate.spki_sha256


def test_tls_json_says_whether_the_node_serves_https_and_with_which_certificate() -> None:
    certificate = NodeTls.start("127.0.0.1").certificate
    assert tls_json(None) == {"on": False, "spki_sha256": None, "certificate_pem": None}
    assert tls_json(certificate) == {"on": True, "spki_sha256": certificate.spki_sha256.hex(),
                                     "certificate_pem": ssl.DER_cert_to_PEM_cert(certificate.der)}
    assert NodeCertificate.of(certificate.der) == certificate
    assert spki_sha256(certificate.der) == certificate.spki_sha256


class OneShotServer:
    """A loopback TLS server answering each connection's first bytes with b"ok", for handshakes in-process."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(connection, server_side=True) as wrapped:
                    wrapped.recv(1)
                    wrapped.sendall(b"ok")
            except (OSError, ssl.SSLError):
                pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def node_tls_server() -> Iterator[tuple[NodeTls, OneShotServer]]:
    node_tls = NodeTls.start("127.0.0.1")
    server = OneShotServer(node_tls.context)
    yield node_tls, server
    server.close()


def handshake(port: int, context: ssl.SSLContext, hostname: str = "127.0.0.1") -> tuple[str, bytes]:
    """The negotiated version and the certificate the server presented."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=hostname) as wrapped:
        wrapped.sendall(b"x")
        assert wrapped.recv(2) == b"ok"
        presented = wrapped.getpeercert(binary_form=True)
        assert presented is not None
        return str(wrapped.version()), presented


def test_a_client_trusting_exactly_the_certificate_connects_over_tls13(
        node_tls_server: tuple[NodeTls, OneShotServer]) -> None:
    node_tls, server = node_tls_server
    strict = client_context(node_tls.certificate.pem)
    strict.verify_flags |= ssl.VERIFY_X509_STRICT  # the default from Python 3.13 on
    version, presented = handshake(server.port, strict)
    assert (version, presented) == ("TLSv1.3", node_tls.certificate.der)
    assert handshake(server.port, client_context(node_tls.certificate.pem), "localhost")[1] == presented


def test_tls12_a_system_trust_store_and_another_pin_are_refused(
        node_tls_server: tuple[NodeTls, OneShotServer]) -> None:
    _, server = node_tls_server
    old = unverified_context()
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION|UNSUPPORTED_PROTOCOL|VERSION"):
        handshake(server.port, old)
    with pytest.raises(ssl.SSLCertVerificationError, match="self-signed certificate"):
        handshake(server.port, ssl.create_default_context())
    with pytest.raises(ssl.SSLCertVerificationError, match="self-signed certificate"):
        handshake(server.port, client_context(NodeTls.start("127.0.0.1").certificate.pem))


def test_a_pem_block_too_large_for_a_pipe_is_an_error_and_leaves_no_descriptor() -> None:
    before = open_descriptors()
    with pytest.raises(TlsError, match=r"a pipe holds \d+ of the 16777216 bytes of a PEM block"):
        tls._pipe_holding(b"-" * 2**24)
    assert open_descriptors() == before


def test_a_key_openssl_refuses_is_an_error_and_leaves_no_descriptor() -> None:
    node_tls = NodeTls.start("127.0.0.1")
    before = open_descriptors()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with pytest.raises(TlsError, match="OpenSSL could not load the node's TLS key through /dev/fd"):
        tls._load_in_memory(context, node_tls.certificate.pem.encode(), b"-----BEGIN PRIVATE KEY-----\nAAAA\n")
    assert open_descriptors() == before


# A real node.

def node_json(node: Node, context: ssl.SSLContext | None) -> dict[str, Any]:
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5, context=context) as response:
        return dict(json.load(response))


def presented_certificate(node: Node) -> bytes:
    """The certificate the node's TLS handshake presents, read from the socket."""
    port = int(node.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            unverified_context().wrap_socket(raw, server_hostname="127.0.0.1") as wrapped:
        presented = wrapped.getpeercert(binary_form=True)
    assert presented is not None
    return presented


def files_under(*roots: Path) -> Iterator[Path]:
    for root in roots:
        yield from (path for path in root.rglob("*") if path.is_file())


@pytest.fixture
def tls_node(tmp_path: Path, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the node's temporary files, scanned below
    node = launch_node(tmp_path, small_model_dir, "--tls")
    try:
        yield wait_healthy(node)
    finally:
        stop_node(node)


def test_a_tls_node_serves_the_official_client_pinned_to_its_certificate(tls_node: Node,
                                                                         small_model_dir: Path) -> None:
    about = node_json(tls_node, unverified_context())  # the first connection, unverified: pinned from here on
    assert about["tls"]["on"] is True
    presented = presented_certificate(tls_node)
    assert about["tls"]["spki_sha256"] == spki_sha256(presented).hex() == openssl_spki_sha256(
        about["tls"]["certificate_pem"]).hex()
    assert ssl.PEM_cert_to_DER_cert(about["tls"]["certificate_pem"]) == presented
    log = (tls_node.config.parent / "node.log").read_text()
    assert tls_node.url.startswith("https://") and f"serving model 'small' at {tls_node.url}/v1" in log
    assert f"SPKI SHA-256 {about['tls']['spki_sha256']}" in log
    assert NodeCertificate.of(presented).curl_pin in log

    pinned = client_context(about["tls"]["certificate_pem"])
    client = openai.OpenAI(base_url=tls_node.base, api_key=tls_node.add_key("alice"), max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=pinned))
    stream = client.chat.completions.create(model=small_model_dir.name, max_tokens=4, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Hello over TLS"}],
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    unpinned = openai.OpenAI(base_url=tls_node.base, api_key="tz-unused", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        unpinned.models.list()


def test_plain_http_to_a_tls_node_fails(tls_node: Node) -> None:
    plain = tls_node.url.replace("https://", "http://")
    with pytest.raises(http.client.RemoteDisconnected):
        urllib.request.urlopen(plain + "/health", timeout=5)
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=plain + "/v1", api_key="tz-unused", max_retries=0).models.list()
    assert node_json(tls_node, unverified_context())["tls"]["on"] is True  # and the node still serves


PKCS8_EC_PREFIX = bytes.fromhex("308187020100301306072a8648ce3d020106082a8648ce3d030107046d306b0201010420")
"""How the DER of a PKCS#8 P-256 private key begins: the key's 32 secret bytes follow."""


def test_the_private_key_is_in_no_file_of_the_node(tls_node: Node, tmp_path: Path) -> None:
    """Every file under TENZRO_HOME, the node's TMPDIR, its config and log: no PEM private key, and no DER PKCS#8 or
    SEC1 key of this certificate's key (both carry its public point, which no file holds: none holds the certificate
    either)."""
    about = node_json(tls_node, unverified_context())
    certificate = x509.load_pem_x509_certificate(about["tls"]["certificate_pem"].encode())
    public_key = certificate.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    point = public_key.public_numbers().x.to_bytes(32, "big") + public_key.public_numbers().y.to_bytes(32, "big")
    scanned = sorted(str(path.relative_to(tmp_path)) for path in files_under(tmp_path))
    assert {"node.yaml", "node.log", "home/pricing.yaml"} <= set(scanned)
    for name in scanned:
        data = (tmp_path / name).read_bytes()
        assert b"PRIVATE KEY" not in data, name
        assert PKCS8_EC_PREFIX not in data and point not in data, name


def write_policy(tmp_path: Path, require_tls: bool) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text("jurisdiction: DE\ntrust_tier: standard\nrequire: {memory_locked: false, no_swap: false, "
                    f"sealing: false, confidential_hardware: false, tls: {str(require_tls).lower()}}}\n")
    return path


TLS_REFUSAL = ("node policy 'site' requires TLS, and --no-tls asks for plain HTTP, which whoever relays the connection "
               "reads: serve without --no-tls (TLS is on by default under this policy), or use a policy with tls: "
               "false for local development")


def test_a_policy_requiring_tls_refuses_plain_http_at_start(tmp_path: Path, small_model_dir: Path) -> None:
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    serve = ("node", "serve", "--model", str(small_model_dir), "--port", "1", "--config", str(tmp_path / "node.yaml"))
    refused = tenzro(*serve, "--policy", str(write_policy(tmp_path, True)), "--no-tls", env=env)
    assert (refused.returncode, refused.stderr) == (2, f"tenzro: error: the node policy 'site' is not met:\n"
                                                       f"  - {TLS_REFUSAL}\n")
    confidential = tenzro(*serve, "--policy", "confidential", "--no-tls", env=env)
    assert confidential.returncode == 2
    assert "  - " + TLS_REFUSAL.replace("'site'", "'confidential'") in confidential.stderr.splitlines()


def test_a_policy_requiring_tls_serves_https_by_default(tmp_path: Path, small_model_dir: Path) -> None:
    node = launch_node(tmp_path, small_model_dir, "--policy", str(write_policy(tmp_path, True)))
    node = dataclasses.replace(node, url=node.url.replace("http://", "https://"))
    try:
        about = node_json(wait_healthy(node), unverified_context())
        assert about["tls"]["on"] is True
        assert about["tls"]["spki_sha256"] == spki_sha256(presented_certificate(node)).hex()
    finally:
        stop_node(node)


def test_a_node_without_tls_says_so(tmp_path: Path, small_model_dir: Path) -> None:
    node = launch_node(tmp_path, small_model_dir, "--policy", str(write_policy(tmp_path, False)))
    try:
        assert node_json(wait_healthy(node), None)["tls"] == {
            "on": False, "spki_sha256": None, "certificate_pem": None}
        assert "TLS: off, plain HTTP" in (tmp_path / "node.log").read_text()
    finally:
        stop_node(node)
