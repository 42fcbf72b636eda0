"""Vendor collateral as files: what a verifier needs besides roots to judge TCB status, QE identity and revocation.

Verification never touches the network; `tenzro attest fetch-collateral --out DIR` (on a machine with network)
writes this directory, and the verifier reads it. Every file has a fixed name, so a file under a wrong name is an
error rather than silently unused:

    amd/vcek_crl_<Product>.der         AMD KDS CRL per product (Milan, Genoa, Turin): /vcek/v1/<Product>/crl
    amd/vlek_crl_<Product>.der         the same for VLEK chains: /vlek/v1/<Product>/crl
    intel/tcb_info_<fmspc>.json        Intel PCS TDX TCB info for one FMSPC (12 lowercase hex), the body as served
    intel/tcb_info_issuer_chain.pem    the TCB-Info-Issuer-Chain header, URL-decoded: TCB signing cert, root
    intel/qe_identity.json             Intel PCS TDX QE identity, the body as served
    intel/qe_identity_issuer_chain.pem the SGX-Enclave-Identity-Issuer-Chain header, URL-decoded
    intel/pck_crl_platform.der         PCK CRL of the Platform CA (pckcrl?ca=platform&encoding=der)
    intel/pck_crl_processor.der        PCK CRL of the Processor CA
    intel/pck_crl_issuer_chain.pem     the SGX-PCK-CRL-Issuer-Chain header, URL-decoded
    intel/root_crl.der                 the Intel SGX Root CA's CRL
    nvidia/rim/*.swidtag               NVIDIA RIM files (driver and VBIOS reference measurements), any names
    nvidia/ocsp/*.der                  DER OCSP responses for the GPU certificate chains, any names

Any file may be absent: a check that needs it then reports it was not done (or refuses, when the evidence cannot be
judged without it, as TDX TCB status cannot). This module only reads bytes; each vendor's verifier parses and
verifies what it uses, against roots from `attestation.chain`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from attestation.errors import VerificationError

AMD_PRODUCTS = ("Milan", "Genoa", "Turin")
_AMD_CRL = re.compile(r"(vcek|vlek)_crl_(Milan|Genoa|Turin)\.der")
_TCB_INFO = re.compile(r"tcb_info_([0-9a-f]{12})\.json")
INTEL_FILES = ("tcb_info_issuer_chain.pem", "qe_identity.json", "qe_identity_issuer_chain.pem",
               "pck_crl_platform.der", "pck_crl_processor.der", "pck_crl_issuer_chain.pem", "root_crl.der")
SUBDIRECTORIES = ("amd", "intel", "nvidia")
NVIDIA_SUBDIRECTORIES = {"rim": ".swidtag", "ocsp": ".der"}


@dataclass(frozen=True, slots=True)
class Collateral:
    directory: Path | None  # None: no collateral given
    amd_crls: Mapping[tuple[str, str], bytes] = field(default_factory=dict)
    """("vcek" | "vlek", product) -> DER CRL."""
    intel_tcb_infos: Mapping[str, bytes] = field(default_factory=dict)
    """FMSPC (lowercase hex) -> the PCS TCB info body."""
    intel: Mapping[str, bytes] = field(default_factory=dict)
    """File name in INTEL_FILES -> its bytes, for the files present."""
    nvidia_rims: Mapping[str, bytes] = field(default_factory=dict)
    """File name -> RIM (swidtag XML)."""
    nvidia_ocsp: Mapping[str, bytes] = field(default_factory=dict)
    """File name -> DER OCSP response."""

    def path(self, relative: str) -> str:
        """Where a file is or would be, for messages."""
        return str((self.directory or Path("<no collateral given>")) / relative)


NO_COLLATERAL = Collateral(directory=None)


def load_collateral(directory: str | os.PathLike[str]) -> Collateral:
    """Read the collateral directory; raises `VerificationError("missing-collateral")` if it does not exist and
    `"bad-collateral"` for a file under a name this layout does not have."""
    root = Path(directory)
    if not root.is_dir():
        raise VerificationError("missing-collateral", f"collateral directory {root} does not exist")
    unknown = [entry.name for entry in root.iterdir() if entry.name not in SUBDIRECTORIES]
    amd = _files(root / "amd", unknown, lambda name: _AMD_CRL.fullmatch(name) is not None)
    intel = _files(root / "intel", unknown, lambda name: name in INTEL_FILES or _TCB_INFO.fullmatch(name) is not None)
    nvidia: dict[str, dict[str, bytes]] = {}
    nvidia_root = root / "nvidia"
    if nvidia_root.is_dir():
        unknown += [f"nvidia/{entry.name}" for entry in nvidia_root.iterdir()
                    if entry.name not in NVIDIA_SUBDIRECTORIES]
    for sub, suffix in NVIDIA_SUBDIRECTORIES.items():
        nvidia[sub] = _files(nvidia_root / sub, unknown, _ends_with(suffix), prefix=f"nvidia/{sub}")
    if unknown:
        raise VerificationError(
            "bad-collateral", f"unknown entries {sorted(unknown)} in collateral directory {root}; its layout is "
            "amd/{vcek,vlek}_crl_<Product>.der, intel/tcb_info_<fmspc>.json and " + ", ".join(INTEL_FILES)
            + ", nvidia/rim/*.swidtag, nvidia/ocsp/*.der")
    amd_crls = {}
    for name, data in amd.items():
        match = _AMD_CRL.fullmatch(name)
        assert match is not None
        amd_crls[(match.group(1), match.group(2))] = data
    tcb_infos = {}
    for name in [name for name in intel if _TCB_INFO.fullmatch(name)]:
        match = _TCB_INFO.fullmatch(name)
        assert match is not None
        tcb_infos[match.group(1)] = intel.pop(name)
    return Collateral(directory=root, amd_crls=amd_crls, intel_tcb_infos=tcb_infos, intel=intel,
                      nvidia_rims=nvidia["rim"], nvidia_ocsp=nvidia["ocsp"])


def _ends_with(suffix: str) -> Callable[[str], bool]:
    return lambda name: name.endswith(suffix)


def _files(directory: Path, unknown: list[str], known: Callable[[str], bool], prefix: str | None = None
           ) -> dict[str, bytes]:
    if not directory.is_dir():
        return {}
    files = {}
    for entry in sorted(directory.iterdir()):
        if not entry.is_file() or not known(entry.name):
            unknown.append(f"{prefix or directory.name}/{entry.name}")
            continue
        try:
            files[entry.name] = entry.read_bytes()
        except OSError as exc:
            raise VerificationError("bad-collateral", f"cannot read {entry}: {exc.strerror}") from exc
    return files
