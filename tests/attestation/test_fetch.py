"""`tenzro attest fetch-collateral`: the vendor URLs it asks, the issuer-chain headers it URL-decodes, and a directory
that `load_collateral` reads back byte for byte; against a loopback aiohttp server serving real vendor bodies.

Vectors: google/go-tdx-guest `testing/testdata/` (tdx_prod_quote_SPR_E4.dat, whose PCK certificate names FMSPC
50806f000000; sample_tcbInfo_response for that FMSPC, sample_qeIdentity_response, pckcrl, rootcrl.der) with the
issuer chains of `testing/test_cases.go`, and NVIDIA/nvtrust `.../verifier/samples/hopperCertChain.txt` (a Hopper
GPU's certificate chain). AMD's CRLs are forged here: no KDS CRL is among the public vectors.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import ocsp
from cryptography.x509.oid import NameOID

from attestation.cli import main
from attestation.collateral import load_collateral
from attestation.evidence import Evidence, GpuDeviceReport, GpuEvidence

VECTORS = Path(__file__).parent / "vectors"
TDX = VECTORS / "go-tdx-guest"
HOPPER_CHAIN = (VECTORS / "nvtrust" / "hopperCertChain.txt").read_bytes()
HOPPER_REPORT = bytes.fromhex((VECTORS / "nvtrust" / "hopperAttestationReport.txt").read_text().strip())
HOPPER_RIM_IDS = ("NV_GPU_DRIVER_GH100_550.90.07", "NV_GPU_VBIOS_1010_0200_882_96009F0001")
"""The RIM ids nvtrust's verifier would fetch for the sample report."""
FMSPC = "50806f000000"
RIM_ID = "NV_GPU_DRIVER_GH100_535.86.10"
RIM = b'<SoftwareIdentity xmlns="http://standards.iso.org/iso/19770/-2/2015/schema.xsd" name="driver"/>'
NOW = datetime(2024, 1, 1, tzinfo=UTC)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def forged_crl() -> bytes:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ARK-Milan")])
    crl = (x509.CertificateRevocationListBuilder().issuer_name(name).last_update(NOW)
           .next_update(NOW + timedelta(days=7)).sign(key, hashes.SHA384()))
    return crl.public_bytes(serialization.Encoding.DER)


AMD_CRL = forged_crl()


def ocsp_answer(request_der: bytes) -> bytes:
    """A GOOD answer for the certificate the request names, from the Hopper chain, signed by a throwaway responder."""
    request = ocsp.load_der_ocsp_request(request_der)
    chain = x509.load_pem_x509_certificates(HOPPER_CHAIN)
    position = next(i for i, cert in enumerate(chain) if cert.serial_number == request.serial_number)
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "OCSP responder")])
    responder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                 .serial_number(1).not_valid_before(NOW).not_valid_after(NOW + timedelta(days=1))
                 .sign(key, hashes.SHA384()))
    response = (ocsp.OCSPResponseBuilder()
                .add_response(cert=chain[position], issuer=chain[position + 1], algorithm=hashes.SHA384(),
                              cert_status=ocsp.OCSPCertStatus.GOOD, this_update=NOW, next_update=NOW + timedelta(1),
                              revocation_time=None, revocation_reason=None)
                .responder_id(ocsp.OCSPResponderEncoding.HASH, responder).sign(key, hashes.SHA384()))
    return response.public_bytes(serialization.Encoding.DER)


class Vendors:
    """One loopback server playing AMD KDS, Intel PCS (both hosts) and NVIDIA's RIM and OCSP services."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.missing: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Vendors:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> str:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/{kind:vcek|vlek}/v1/{product}/crl", self._amd_crl)
        app.router.add_get("/tdx/certification/v4/tcb", self._tcb_info)
        app.router.add_get("/tdx/certification/v4/qe/identity", self._qe_identity)
        app.router.add_get("/sgx/certification/v4/pckcrl", self._pck_crl)
        app.router.add_get("/IntelSGXRootCA.der", self._root_crl)
        app.router.add_get("/v1/rim/{id}", self._rim)
        app.router.add_post("/", self._ocsp)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path_qs}")
        if request.path in self.missing:
            raise web.HTTPNotFound()
        return await handler(request)

    @staticmethod
    def _file(name: str, header: str | None = None, chain: str | None = None) -> web.Response:
        headers = {} if header is None or chain is None else {header: quote((TDX / chain).read_text())}
        return web.Response(body=(TDX / name).read_bytes(), headers=headers)

    async def _amd_crl(self, _: web.Request) -> web.Response:
        return web.Response(body=AMD_CRL)

    async def _qe_identity(self, _: web.Request) -> web.Response:
        return self._file("sample_qeIdentity_response", "SGX-Enclave-Identity-Issuer-Chain",
                          "qe_identity_issuer_chain.pem")

    async def _root_crl(self, _: web.Request) -> web.Response:
        return self._file("rootcrl.der")

    async def _rim(self, request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["id"], "rim": base64.b64encode(RIM).decode()})

    async def _tcb_info(self, request: web.Request) -> web.Response:
        if request.query.get("fmspc") != FMSPC:
            raise web.HTTPNotFound()
        return self._file("sample_tcbInfo_response", "TCB-Info-Issuer-Chain", "tcb_info_issuer_chain.pem")

    async def _pck_crl(self, request: web.Request) -> web.Response:
        assert request.query["ca"] in ("platform", "processor") and request.query["encoding"] == "der"
        return self._file("pckcrl", "SGX-PCK-CRL-Issuer-Chain", "pck_crl_issuer_chain.pem")

    async def _ocsp(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/ocsp-request"
        return web.Response(body=ocsp_answer(await request.read()),
                            headers={"Content-Type": "application/ocsp-response"})


@pytest.fixture
def vendors() -> Iterator[Vendors]:
    with Vendors() as server:
        yield server


def base_urls(url: str) -> list[str]:
    return [argument for vendor in ("amd", "intel", "intel-certificates", "nvidia-rim", "nvidia-ocsp")
            for argument in ("--base-url", f"{vendor}={url}")]


def tdx_evidence(tmp_path: Path) -> Path:
    """The real SPR quote as TDX evidence (go-tdx-guest), with a GPU part carrying the real Hopper report and
    certificate chain (nvtrust samples: driver 550.90.07, VBIOS 96.00.9f.00.01, board 1010_0200_882)."""
    device = GpuDeviceReport(index=0, uuid="GPU-0", report=HOPPER_REPORT, cert_chain=HOPPER_CHAIN)
    evidence = Evidence(evidence_type="tdx", source="configfs-tsm",
                        report=(TDX / "tdx_prod_quote_SPR_E4.dat").read_bytes(), aux=b"",
                        gpu=GpuEvidence(cc_enabled=True, environment="prod", dev_tools=False, ready=True,
                                        devices=(device,)),
                        public_key=bytes(range(32)), boot_id="boot-a", nonce=bytes(32))
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps(evidence.document()))
    return path


def test_fetch_writes_the_collateral_layout_with_the_exact_vendor_bytes(
        vendors: Vendors, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "collateral"
    code = main(["fetch-collateral", "--out", str(out), "--evidence", str(tdx_evidence(tmp_path)),
                 "--amd-product", "Milan", "--nvidia-rim", RIM_ID, *base_urls(vendors.url)])
    assert code == 0, capsys.readouterr()
    assert vendors.requests == [
        "GET /vcek/v1/Milan/crl", "GET /vlek/v1/Milan/crl", f"GET /tdx/certification/v4/tcb?fmspc={FMSPC}",
        "GET /tdx/certification/v4/qe/identity", "GET /sgx/certification/v4/pckcrl?ca=platform&encoding=der",
        "GET /sgx/certification/v4/pckcrl?ca=processor&encoding=der", "GET /IntelSGXRootCA.der",
        f"GET /v1/rim/{RIM_ID}", *(f"GET /v1/rim/{rim_id}" for rim_id in HOPPER_RIM_IDS),
        "POST /", "POST /", "POST /"]
    collateral = load_collateral(out)
    assert collateral.amd_crls == {("vcek", "Milan"): AMD_CRL, ("vlek", "Milan"): AMD_CRL}
    assert collateral.intel_tcb_infos == {FMSPC: (TDX / "sample_tcbInfo_response").read_bytes()}
    assert collateral.intel == {
        "tcb_info_issuer_chain.pem": (TDX / "tcb_info_issuer_chain.pem").read_bytes(),
        "qe_identity.json": (TDX / "sample_qeIdentity_response").read_bytes(),
        "qe_identity_issuer_chain.pem": (TDX / "qe_identity_issuer_chain.pem").read_bytes(),
        "pck_crl_platform.der": (TDX / "pckcrl").read_bytes(),
        "pck_crl_processor.der": (TDX / "pckcrl").read_bytes(),
        "pck_crl_issuer_chain.pem": (TDX / "pck_crl_issuer_chain.pem").read_bytes(),
        "root_crl.der": (TDX / "rootcrl.der").read_bytes(),
    }
    assert collateral.nvidia_rims == {f"{rim_id}.swidtag": RIM for rim_id in (RIM_ID, *HOPPER_RIM_IDS)}
    assert sorted(collateral.nvidia_ocsp) == ["gpu0_1.der", "gpu0_2.der", "gpu0_3.der"]
    chain = x509.load_pem_x509_certificates(HOPPER_CHAIN)
    answered = [ocsp.load_der_ocsp_response(collateral.nvidia_ocsp[f"gpu0_{i}.der"]) for i in (1, 2, 3)]
    assert [response.serial_number for response in answered] == [cert.serial_number for cert in chain[1:4]]
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {out / 'amd/vcek_crl_Milan.der'} ({len(AMD_CRL)} bytes)"


def test_a_failed_download_writes_nothing_and_names_the_url(
        vendors: Vendors, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vendors.missing.add("/tdx/certification/v4/qe/identity")
    out = tmp_path / "collateral"
    code = main(["fetch-collateral", "--out", str(out), "--fmspc", FMSPC.upper(), *base_urls(vendors.url)])
    assert code == 1
    assert capsys.readouterr().out == f"FAILED {vendors.url}/tdx/certification/v4/qe/identity answered 404 Not Found\n"
    assert not out.exists()


def test_a_body_that_is_not_what_the_url_serves_is_refused(
        vendors: Vendors, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The RIM service's address given for AMD: its JSON is no DER CRL.
    code = main(["fetch-collateral", "--out", str(tmp_path / "c"), "--amd-product", "Turin",
                 "--base-url", f"amd={vendors.url}/v1/rim/x?"])
    assert code == 1
    assert capsys.readouterr().out.startswith(f"FAILED {vendors.url}/v1/rim/x?/vcek/v1/Turin/crl served no valid crl: ")


@pytest.mark.parametrize(("argv", "message"), [
    ([], "tenzro: error: nothing to fetch: give --evidence, --fmspc, --amd-product or --nvidia-rim\n"),
    (["--fmspc", "50806f"], "tenzro: error: --fmspc is 12 hex characters, got 50806f\n"),
    (["--nvidia-rim", "../x"], "tenzro: error: --nvidia-rim is a RIM id (letters, digits, _ . -), got ../x\n"),
    (["--fmspc", FMSPC, "--base-url", "arm=https://x"],
     "tenzro: error: --base-url VENDOR=URL, VENDOR one of amd, intel, intel-certificates, nvidia-rim, nvidia-ocsp: "
     "got 'arm=https://x'\n"),
])
def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["fetch-collateral", "--out", str(tmp_path / "c"), *argv]) == 2
    assert capsys.readouterr().out == message


def test_evidence_fetch_cannot_read_is_refused_before_any_download(
        vendors: Vendors, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU report too short to name its RIMs, and a document that is no evidence, each fail with the verifier's
    reason and nothing is asked of any vendor."""
    document = json.loads(tdx_evidence(tmp_path).read_text())
    document["gpu"]["devices"][0]["report"] = base64.b64encode(HOPPER_REPORT[:40]).decode()
    (tmp_path / "short.json").write_text(json.dumps(document))
    (tmp_path / "other.json").write_text(json.dumps({"format": "tenzro-evidence-v1"}))
    for name, reason in (("short.json", "gpu-truncated-report"), ("other.json", "malformed-document")):
        code = main(["fetch-collateral", "--out", str(tmp_path / "out"), "--evidence", str(tmp_path / name),
                     *base_urls(vendors.url)])
        assert (code, capsys.readouterr().out.split(":")[0]) == (1, f"FAILED {reason}")
    assert vendors.requests == []
    assert not (tmp_path / "out").exists()
