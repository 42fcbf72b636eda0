"""`tenzro attest fetch-collateral --out DIR`: download vendor collateral into the directory verification reads.

The only code in this project that reaches the network for attestation: verification itself never does, so an
auditor can fetch on a machine with network, review, copy the directory to where verification runs and name it
there (`--collateral DIR`, or `collateral:` in a trust policy). What is fetched, where from and where it is written
(the layout of `attestation/collateral.py`):

    AMD KDS      https://kdsintf.amd.com/{vcek,vlek}/v1/<Product>/crl      amd/{vcek,vlek}_crl_<Product>.der
    Intel PCS    https://api.trustedservices.intel.com
                   /tdx/certification/v4/tcb?fmspc=<FMSPC>                 intel/tcb_info_<fmspc>.json
                     header TCB-Info-Issuer-Chain (URL-decoded)            intel/tcb_info_issuer_chain.pem
                   /tdx/certification/v4/qe/identity                       intel/qe_identity.json
                     header SGX-Enclave-Identity-Issuer-Chain              intel/qe_identity_issuer_chain.pem
                   /sgx/certification/v4/pckcrl?ca={platform,processor}&encoding=der
                                                                           intel/pck_crl_{platform,processor}.der
                     header SGX-PCK-CRL-Issuer-Chain                       intel/pck_crl_issuer_chain.pem
                 https://certificates.trustedservices.intel.com/IntelSGXRootCA.der   intel/root_crl.der
    NVIDIA       https://rim.attestation.nvidia.com/v1/rim/<id>  (JSON, `rim` base64)  nvidia/rim/<id>.swidtag
                 https://ocsp.ndis.nvidia.com/  (POST, one request per certificate of each GPU's chain, as nvtrust
                   asks: SHA-384 CertID, from the leaf's issuer up to below the root)   nvidia/ocsp/gpu<i>_<n>.der

What to fetch comes from the flags, or from an evidence document (`--evidence`): SEV-SNP evidence asks for every
product's CRLs (which product signed it is the verifier's finding, not the fetcher's), TDX evidence for the FMSPC in
its PCK certificate, GPU evidence for each report's driver and VBIOS RIMs (Hopper's RIM ids, as nvtrust derives them
from the report's versions and board) and OCSP responses for its certificate chains. AMD's roots (KDS `cert_chain`) are
not fetched: roots are a person's decision, put in the trust directory by hand (`attestation/chain.py`).

Every body is parsed before anything is written (a CRL as DER, JSON as JSON, an OCSP response as a successful one),
so an error page never lands in the directory; nothing is written unless every download succeeded. `--base-url
VENDOR=URL` points a vendor at another server (a mirror, or a test's loopback server).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509 import ocsp

from attestation.collateral import AMD_PRODUCTS, load_collateral
from attestation.errors import AttestationError, MalformedEvidence, VerificationError
from attestation.evidence import Evidence
from attestation.pck_extensions import read_pck_extensions
from attestation.spdm import parse_report

VENDOR_URLS: dict[str, str] = {
    "amd": "https://kdsintf.amd.com",
    "intel": "https://api.trustedservices.intel.com",
    "intel-certificates": "https://certificates.trustedservices.intel.com",
    "nvidia-rim": "https://rim.attestation.nvidia.com",
    "nvidia-ocsp": "https://ocsp.ndis.nvidia.com",
}
"""Vendor -> base URL; `--base-url VENDOR=URL` replaces one."""
AMD_KINDS = ("vcek", "vlek")
HOPPER_DRIVER_RIM = "NV_GPU_DRIVER_GH100_"
VBIOS_RIM = "NV_GPU_VBIOS_"
PCK_CAS = ("platform", "processor")
FETCH_TIMEOUT_S = 30.0
_FMSPC = re.compile(r"[0-9a-f]{12}")
_RIM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


class FetchError(AttestationError):
    """A download failed or served something that is not what the URL should serve; the message names the URL."""


@dataclass(frozen=True, slots=True)
class Download:
    path: str  # where the body goes, relative to the collateral directory
    url: str
    form: str  # "crl", "tcb_info", "qe_identity", "rim", "ocsp": how the body is checked (and, for rim, unwrapped)
    issuer_chain: tuple[str, str] | None = None  # (response header, relative path for its URL-decoded PEM)
    request: bytes | None = None  # a POST body (OCSP); None: GET


@dataclass(frozen=True, slots=True)
class Wanted:
    """What to fetch."""

    amd_products: tuple[str, ...] = ()
    fmspcs: tuple[str, ...] = ()
    rim_ids: tuple[str, ...] = ()
    ocsp: tuple[tuple[str, bytes], ...] = ()  # (name, DER OCSP request)


def plan(wanted: Wanted, bases: Mapping[str, str] = VENDOR_URLS) -> list[Download]:
    """The downloads `wanted` takes, each URL from `bases`."""
    amd, intel = bases["amd"], bases["intel"]
    downloads = [Download(f"amd/{kind}_crl_{product}.der", f"{amd}/{kind}/v1/{product}/crl", "crl")
                 for product in wanted.amd_products for kind in AMD_KINDS]
    if wanted.fmspcs:
        downloads += [Download(f"intel/tcb_info_{fmspc}.json", f"{intel}/tdx/certification/v4/tcb?fmspc={fmspc}",
                               "tcb_info", ("TCB-Info-Issuer-Chain", "intel/tcb_info_issuer_chain.pem"))
                      for fmspc in wanted.fmspcs]
        downloads.append(Download("intel/qe_identity.json", f"{intel}/tdx/certification/v4/qe/identity",
                                  "qe_identity", ("SGX-Enclave-Identity-Issuer-Chain",
                                                  "intel/qe_identity_issuer_chain.pem")))
        downloads += [Download(f"intel/pck_crl_{ca}.der", f"{intel}/sgx/certification/v4/pckcrl?ca={ca}&encoding=der",
                               "crl", ("SGX-PCK-CRL-Issuer-Chain", "intel/pck_crl_issuer_chain.pem"))
                      for ca in PCK_CAS]
        downloads.append(Download("intel/root_crl.der", f"{bases['intel-certificates']}/IntelSGXRootCA.der", "crl"))
    downloads += [Download(f"nvidia/rim/{rim_id}.swidtag", f"{bases['nvidia-rim']}/v1/rim/{rim_id}", "rim")
                  for rim_id in wanted.rim_ids]
    downloads += [Download(f"nvidia/ocsp/{name}.der", f"{bases['nvidia-ocsp']}/", "ocsp", request=request)
                  for name, request in wanted.ocsp]
    return downloads


def wanted_by(evidence: Evidence) -> Wanted:
    """What verifying `evidence` can use: every AMD product's CRLs for SEV-SNP, the PCK certificate's FMSPC for TDX,
    and each GPU report's RIMs and an OCSP response for each GPU certificate below the root."""
    if evidence.evidence_type == "sev-snp":
        hardware = Wanted(amd_products=AMD_PRODUCTS)
    elif evidence.evidence_type == "tdx":
        hardware = Wanted(fmspcs=(pck_fmspc(evidence.report),))
    else:
        hardware = Wanted()
    requests, rim_ids = [], []
    for device in () if evidence.gpu is None else evidence.gpu.devices:
        rim_ids += gpu_rim_ids(device.report)
        chain = _certificates(device.cert_chain, f"GPU {device.index}'s certificate chain")
        # As nvtrust: the leaf is this boot's attestation key (no OCSP entry); the root is not asked about.
        for position in range(1, len(chain) - 1):
            request = ocsp.OCSPRequestBuilder().add_certificate(chain[position], chain[position + 1],
                                                                hashes.SHA384()).build()
            requests.append((f"gpu{device.index}_{position}", request.public_bytes(serialization.Encoding.DER)))
    return Wanted(hardware.amd_products, hardware.fmspcs, tuple(dict.fromkeys(rim_ids)), tuple(requests))


def gpu_rim_ids(report: bytes) -> list[str]:
    """The RIM service ids of a Hopper report's driver and VBIOS RIMs, as nvtrust names them:
    `NV_GPU_DRIVER_GH100_<driver version>` and `NV_GPU_VBIOS_<project>_<project SKU>_<chip SKU>_<VBIOS version
    without dots>`, upper case. Parsing the report only names files: the verifier checks it."""
    parsed = parse_report(report)
    ids = []
    if parsed.driver_version:
        ids.append(f"{HOPPER_DRIVER_RIM}{parsed.driver_version}")
    if parsed.vbios_version:
        ids.append(f"{VBIOS_RIM}{parsed.board().upper()}_{parsed.vbios_version.replace('.', '').upper()}")
    return [rim_id for rim_id in ids if _RIM_ID.fullmatch(rim_id)]


def pck_fmspc(quote: bytes) -> str:
    """The FMSPC (12 lowercase hex) of the PCK leaf certificate a TDX quote carries (the first PEM certificate in
    its certification data, in quote v4 and v5 alike)."""
    leaf = _certificates(quote, "the quote's PCK chain")[0]
    try:
        return read_pck_extensions(leaf).fmspc.hex()
    except VerificationError as exc:
        raise FetchError(f"{exc.message} (give --fmspc)") from exc


def fetch(downloads: Sequence[Download], out: Path, timeout_s: float = FETCH_TIMEOUT_S) -> list[tuple[str, int]]:
    """Download every body, check it, then write all of them under `out`; returns (path, size) per file written.
    Raises `FetchError` before writing anything if one download fails."""
    files: dict[str, bytes] = {}
    for download in downloads:
        body, headers = _get(download, timeout_s)
        files[download.path] = _checked(download, body)
        if download.issuer_chain is not None:
            header, path = download.issuer_chain
            files[path] = _issuer_chain(download, headers.get(header))
    for path, data in files.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    try:
        load_collateral(out)
    except VerificationError as exc:
        raise FetchError(f"{out} is not a collateral directory after writing: {exc}") from exc
    return [(path, len(data)) for path, data in files.items()]


def _get(download: Download, timeout_s: float) -> tuple[bytes, Mapping[str, str]]:
    headers = {} if download.request is None else {"Content-Type": "application/ocsp-request"}
    request = urllib.request.Request(download.url, data=download.request, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - vendor https URLs
            return response.read(), response.headers
    except urllib.error.HTTPError as exc:
        raise FetchError(f"{download.url} answered {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"cannot fetch {download.url}: {exc}") from exc


def _checked(download: Download, body: bytes) -> bytes:
    """The bytes to write for `download`, once they are what its URL serves."""
    try:
        if download.form == "crl":
            x509.load_der_x509_crl(body)
        elif download.form in ("tcb_info", "qe_identity"):
            key = "tcbInfo" if download.form == "tcb_info" else "enclaveIdentity"
            if key not in json.loads(body):
                raise ValueError(f"no {key}")
        elif download.form == "rim":
            return base64.b64decode(json.loads(body)["rim"], validate=True)
        elif download.form == "ocsp":
            status = ocsp.load_der_ocsp_response(body).response_status
            if status != ocsp.OCSPResponseStatus.SUCCESSFUL:
                raise ValueError(f"response status {status.name}")
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        raise FetchError(f"{download.url} served no valid {download.form.replace('_', ' ')}: {exc}") from exc
    return body


def _issuer_chain(download: Download, value: str | None) -> bytes:
    assert download.issuer_chain is not None
    header = download.issuer_chain[0]
    if not value:
        raise FetchError(f"{download.url} answered without its {header} header")
    pem = urllib.parse.unquote(value).encode()
    _certificates(pem, f"the {header} header of {download.url}")
    return pem


def _certificates(data: bytes, what: str) -> list[x509.Certificate]:
    blocks = _PEM_CERTIFICATE.findall(data)
    try:
        if not blocks:
            raise ValueError("no PEM certificate")
        return [x509.load_pem_x509_certificate(block) for block in blocks]
    except ValueError as exc:
        raise FetchError(f"{what} holds no certificate: {exc}") from exc


def add_fetch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add `fetch-collateral` to a CLI's subcommands; the parser sets `func` to `run_fetch`."""
    parser = subparsers.add_parser("fetch-collateral", help="download AMD, Intel and NVIDIA collateral into a "
                                                            "directory (the only command that uses the network)")
    parser.add_argument("--out", required=True, metavar="DIR", type=Path, help="collateral directory to write")
    parser.add_argument("--evidence", metavar="FILE", type=Path,
                        help="an evidence document: fetch what verifying it can use")
    parser.add_argument("--fmspc", action="append", default=[], metavar="HEX",
                        help="Intel TDX TCB info for this FMSPC (12 hex), with the QE identity and Intel CRLs")
    parser.add_argument("--amd-product", action="append", default=[], choices=AMD_PRODUCTS,
                        help="AMD KDS VCEK and VLEK CRLs of this product")
    parser.add_argument("--nvidia-rim", action="append", default=[], metavar="ID",
                        help="an NVIDIA RIM by id (e.g. NV_GPU_DRIVER_GH100_535.86.10)")
    parser.add_argument("--base-url", action="append", default=[], metavar="VENDOR=URL",
                        help=f"another base URL for a vendor ({', '.join(VENDOR_URLS)})")
    parser.add_argument("--timeout", type=float, default=FETCH_TIMEOUT_S, metavar="S", help="per request")
    parser.set_defaults(func=run_fetch)
    return parser


def run_fetch(args: argparse.Namespace) -> int:
    """The handler: 0 when every file was written, 1 when a download or the evidence failed, 2 for a usage error."""
    try:
        bases = _bases(args.base_url)
        fmspcs = tuple(fmspc.lower() for fmspc in args.fmspc)
        if bad := [fmspc for fmspc in fmspcs if not _FMSPC.fullmatch(fmspc)]:
            raise ValueError(f"--fmspc is 12 hex characters, got {', '.join(bad)}")
        if bad := [rim_id for rim_id in args.nvidia_rim if not _RIM_ID.fullmatch(rim_id)]:
            raise ValueError(f"--nvidia-rim is a RIM id (letters, digits, _ . -), got {', '.join(bad)}")
    except ValueError as exc:
        print(f"tenzro: error: {exc}")
        return 2
    try:
        found = Wanted() if args.evidence is None else wanted_by(_evidence(args.evidence))
        wanted = Wanted(tuple(dict.fromkeys([*args.amd_product, *found.amd_products])),
                        tuple(dict.fromkeys([*fmspcs, *found.fmspcs])),
                        tuple(dict.fromkeys([*args.nvidia_rim, *found.rim_ids])),
                        found.ocsp)
        downloads = plan(wanted, bases)
        if not downloads:
            print("tenzro: error: nothing to fetch: give --evidence, --fmspc, --amd-product or --nvidia-rim")
            return 2
        written = fetch(downloads, args.out, args.timeout)
    except (FetchError, MalformedEvidence, VerificationError) as exc:
        print(f"FAILED {exc}")
        return 1
    for path, size in written:
        print(f"wrote {args.out / path} ({size} bytes)")
    return 0


def _bases(overrides: Sequence[str]) -> dict[str, str]:
    bases = dict(VENDOR_URLS)
    for override in overrides:
        vendor, _, url = override.partition("=")
        if vendor not in VENDOR_URLS or not url.startswith(("https://", "http://")):
            raise ValueError(f"--base-url VENDOR=URL, VENDOR one of {', '.join(VENDOR_URLS)}: got {override!r}")
        bases[vendor] = url.rstrip("/")
    return bases


def _evidence(path: Path) -> Evidence:
    try:
        document: Any = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise MalformedEvidence(f"cannot read the evidence document {path}: {exc}") from exc
    return Evidence.from_document(document)
