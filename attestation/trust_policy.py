"""A caller's trust policy: what a verified node must present before a prompt is sent to it.

One YAML file and one type (`TrustPolicy`), taken by `tenzro client verify`, `tenzro proxy`, `tenzro attest verify`,
`tenzro metering verify` and the router. Every key is checked; an unknown key is an error, never ignored, so a
misspelt requirement cannot silently accept everything. The first nine keys must be written out; the later ones
are optional and default to the strict choice, so a file written before them stays valid and gets stricter.

    tee_types: [sev-snp, tdx]     # accepted evidence types; `none` only together with allow_none: true
    allow_none: false             # accept `none` evidence (no TEE: development only); the verdict says UNTRUSTED
    roots: roots/                 # AMD, Intel and NVIDIA roots (`tenzro attest verify --trust-root`), relative to
                                  #   this file
    measurements: any | [HEX]     # SEV-SNP MEASUREMENT or TDX MRTD, 96 hex characters each
    rtmrs: any | [[HEX, HEX, HEX, HEX]]   # TDX RTMR0..3, each set accepted whole
    min_tcb: any | {NAME: N}      # the least SEV-SNP REPORTED_TCB components: bl, tee, snp, ucode (fmc on Turin)
    code_digests: any | [HEX]     # the node's code identity (64 hex characters)
    model_digests: any | {MODEL_ID: [HEX]}   # per served model id, its accepted weight digests
    gpu: optional | required      # required: the GPU part present, CC on, verified, measurements checked (RIMs)
  optional (default first):
    collateral: null | DIR        # vendor collateral (`attestation/collateral.py`), relative to this file
    tdx_tcb_status: [UpToDate] | any | [STATUS, ...]   # Intel TCB statuses accepted; not evaluated is refused
    revocation: optional | required   # required: refuse evidence whose revocation the verifier could not check
    vmpls: any | [0..3]           # SEV-SNP: the VMPL the report was requested at
    migration_agent: forbidden | allowed   # SEV-SNP guest policy bit 18 (MIGRATE_MA)
    smt: allowed | forbidden      # SEV-SNP guest policy bit 16 (SMT)
    host_data: any | [HEX]        # SEV-SNP HOST_DATA, 64 hex characters
    id_key_digests: any | [HEX]   # SEV-SNP ID_KEY_DIGEST, 96 hex characters
    author_key_digests: any | [HEX]   # SEV-SNP AUTHOR_KEY_DIGEST, 96 hex characters
    family_ids: any | [HEX]       # SEV-SNP FAMILY_ID, 32 hex characters
    image_ids: any | [HEX]        # SEV-SNP IMAGE_ID, 32 hex characters

`any` (and `allowed`) accepts whatever is presented, and the verdict names every such key, so a person reading it sees
what was not pinned; a verdict that pinned no launch measurement says "workload not pinned" (`attestation.verdict`).
A requirement whose value the evidence does not present (a TCB the verifier did not read, a TDX TCB status without
collateral) refuses: the check fails closed, never open. `measurements`, `rtmrs` and `min_tcb` judge every evidence
type (a TDX node cannot meet a `min_tcb`); `tdx_tcb_status` judges TDX evidence only and the SEV-SNP guest keys
SEV-SNP evidence only, so a policy accepting both types keeps its defaults meaningful for each. A `Revoked` TCB
status is never accepted, not even by `any`.

Pure: it parses the file and judges `Presented` values, read off evidence the verifier has checked by
`presented_by`: the one place every caller (`client`, `attest verify`, `metering verify`, the router) turns a
verification into what a policy judges, so they cannot come to judge different values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from attestation.checks import not_checked_about
from attestation.evidence import EVIDENCE_TYPES
from attestation.verdict import WORKLOAD_LABELS, Presented, Verdict, tdx_tcb_phrase
from attestation.verify import VerificationResult

__all__ = ["ANY", "POLICY_KEYS", "OPTIONAL_KEYS", "Presented", "TrustPolicy", "TrustPolicyError", "Verdict",
           "presented_by"]

ANY: Literal["any"] = "any"
REQUIRED_KEYS = ("tee_types", "allow_none", "roots", "measurements", "rtmrs", "min_tcb", "code_digests",
                 "model_digests", "gpu")
OPTIONAL_KEYS = ("collateral", "tdx_tcb_status", "revocation", "vmpls", "migration_agent", "smt", "host_data",
                 "id_key_digests", "author_key_digests", "family_ids", "image_ids")
POLICY_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS
GPU_RULES = ("optional", "required")
REVOCATION_RULES = ("optional", "required")
GUEST_BIT_RULES = ("allowed", "forbidden")
TDX_TCB_STATUSES = ("UpToDate", "SWHardeningNeeded", "ConfigurationNeeded", "ConfigurationAndSWHardeningNeeded",
                    "OutOfDate", "OutOfDateConfigurationNeeded")
"""Intel's TCB statuses a policy may accept; `Revoked` is never one of them."""
REVOKED = "Revoked"
SMT_BIT = 1 << 16
MIGRATE_MA_BIT = 1 << 18
_MEASUREMENT = re.compile(r"[0-9a-f]{96}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ID = re.compile(r"[0-9a-f]{32}")
_TCB_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
SNP_VALUE_KEYS: dict[str, tuple[str, str, re.Pattern[str]]] = {
    "host_data": ("host_data", "HOST_DATA", _DIGEST),
    "id_key_digests": ("id_key_digest", "ID_KEY_DIGEST", _MEASUREMENT),
    "author_key_digests": ("author_key_digest", "AUTHOR_KEY_DIGEST", _MEASUREMENT),
    "family_ids": ("family_id", "FAMILY_ID", _ID),
    "image_ids": ("image_id", "IMAGE_ID", _ID),
}
"""Policy key -> (SnpGuest field, the report's name for it, its hex form)."""

Accepted = Literal["any"] | frozenset[str]
"""`any`, or the accepted lowercase hex values."""


class TrustPolicyError(ValueError):
    """The trust policy file is malformed; the message names the key to change."""


def presented_by(result: VerificationResult) -> Presented:
    """What verified evidence proves, for a policy to judge: the launch measurement and TCB the hardware signed
    (with Intel's TCB status where collateral allowed evaluating it), SEV-SNP's guest facts, the code and model
    digests the binding ties to them (a v1 document binds neither, so a policy pinning them refuses it), the GPU
    part's verdict and what the verifier could not check."""
    return Presented(result.evidence_type, measurement=result.measurement_hex, rtmrs=result.rtmrs_hex,
                     tcb=result.tcb, tcb_status=result.tcb_status, advisory_ids=result.advisory_ids, snp=result.snp,
                     code_digest=result.code_digest_hex, model_digests=dict(result.model_digests), gpu=result.gpu,
                     not_checked=result.not_checked)


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    tee_types: frozenset[str]
    allow_none: bool
    roots: Path | None
    measurements: Accepted
    rtmrs: Literal["any"] | frozenset[tuple[str, str, str, str]]
    min_tcb: Literal["any"] | Mapping[str, int]
    code_digests: Accepted
    model_digests: Literal["any"] | Mapping[str, frozenset[str]]
    gpu: str
    collateral: Path | None = None
    tdx_tcb_status: Literal["any"] | frozenset[str] = frozenset({"UpToDate"})
    revocation: str = "optional"
    vmpls: Literal["any"] | frozenset[int] = ANY
    migration_agent: str = "forbidden"
    smt: str = "allowed"
    host_data: Accepted = ANY
    id_key_digests: Accepted = ANY
    author_key_digests: Accepted = ANY
    family_ids: Accepted = ANY
    image_ids: Accepted = ANY

    @classmethod
    def load(cls, path: Path) -> TrustPolicy:
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise TrustPolicyError(f"cannot read the trust policy {path}: {exc}") from exc
        return cls.parse(raw, base=path.parent)

    @classmethod
    def parse(cls, raw: Any, base: Path) -> TrustPolicy:
        """The policy in `raw` (parsed YAML); relative `roots` and `collateral` are taken from `base`."""
        if not isinstance(raw, dict):
            raise TrustPolicyError("a trust policy is a mapping of the keys " + ", ".join(POLICY_KEYS))
        unknown = sorted(str(key) for key in raw if key not in POLICY_KEYS)
        if unknown:
            raise TrustPolicyError(f"unknown trust policy keys {', '.join(unknown)}: the keys are "
                                   + ", ".join(POLICY_KEYS))
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if missing:
            raise TrustPolicyError(f"the trust policy must set every key of {', '.join(REQUIRED_KEYS)}; missing: "
                                   f"{', '.join(missing)}")
        tee_types = raw["tee_types"]
        if (not isinstance(tee_types, list) or not tee_types
                or not all(isinstance(kind, str) and kind in EVIDENCE_TYPES for kind in tee_types)):
            raise TrustPolicyError(f"tee_types: a non-empty list of {', '.join(EVIDENCE_TYPES)}")
        if not isinstance(raw["allow_none"], bool):
            raise TrustPolicyError("allow_none: true or false")
        if ("none" in tee_types) != raw["allow_none"]:
            raise TrustPolicyError("tee_types lists none exactly when allow_none is true: accepting a node without a "
                                   "TEE is said twice, so it is never said by accident")
        roots = raw["roots"]
        if roots is not None and not isinstance(roots, str):
            raise TrustPolicyError("roots: the directory of the AMD, Intel and NVIDIA roots, or null (none evidence "
                                   "only)")
        if roots is None and set(tee_types) - {"none"}:
            raise TrustPolicyError("roots: hardware evidence is verified against roots; name their directory")
        collateral = raw.get("collateral")
        if collateral is not None and not isinstance(collateral, str):
            raise TrustPolicyError("collateral: the vendor collateral directory (tenzro attest fetch-collateral "
                                   "--out DIR), or null")
        snp_values = {key: _hex_values(raw.get(key, ANY), key, form) for key, (_, _, form) in SNP_VALUE_KEYS.items()}
        return cls(tee_types=frozenset(tee_types), allow_none=raw["allow_none"],
                   roots=None if roots is None else (base / roots),
                   measurements=_hex_values(raw["measurements"], "measurements", _MEASUREMENT),
                   rtmrs=_rtmrs(raw["rtmrs"]), min_tcb=_min_tcb(raw["min_tcb"]),
                   code_digests=_hex_values(raw["code_digests"], "code_digests", _DIGEST),
                   model_digests=_model_digests(raw["model_digests"]), gpu=_one_of(raw["gpu"], "gpu", GPU_RULES),
                   collateral=None if collateral is None else base / collateral,
                   tdx_tcb_status=_tdx_tcb_status(raw.get("tdx_tcb_status", ["UpToDate"])),
                   revocation=_one_of(raw.get("revocation", "optional"), "revocation", REVOCATION_RULES),
                   vmpls=_vmpls(raw.get("vmpls", ANY)),
                   migration_agent=_one_of(raw.get("migration_agent", "forbidden"), "migration_agent",
                                           GUEST_BIT_RULES),
                   smt=_one_of(raw.get("smt", "allowed"), "smt", GUEST_BIT_RULES), **snp_values)

    def expecting(self, measurement_hex: str) -> TrustPolicy:
        """This policy with `measurements` pinned to one value where it accepted any: the `--expect-measurement`
        shortcut, so that the verdict counts what the flag pinned."""
        if self.measurements != ANY:
            return self
        return dataclasses.replace(self, measurements=frozenset({measurement_hex}))

    def judge(self, presented: Presented) -> Verdict:
        judgement = _Judgement(presented)
        kind = presented.tee_type
        if kind not in self.tee_types:
            judgement.refuse("tee-type-not-accepted", f"the node presented {kind} evidence; tee_types accepts "
                             + ", ".join(sorted(self.tee_types)))
        self._judge_workload(judgement)
        if not isinstance(self.min_tcb, str):
            judgement.pin("min_tcb", "at least " + ", ".join(f"{name} {version}"
                                                             for name, version in sorted(self.min_tcb.items())))
            _judge_min_tcb(judgement, self.min_tcb)
        elif kind == "sev-snp":
            judgement.unpinned.append("min_tcb")
        if kind == "tdx":
            self._judge_tdx_tcb_status(judgement)
        if kind == "sev-snp":
            self._judge_snp_guest(judgement)
        self._judge_identity(judgement)
        if self.gpu == "required":
            judgement.pin("gpu", "required")
            missing = _gpu_missing(presented)
            if missing:
                judgement.refuse("gpu-missing", f"gpu: required, and {missing}")
        if self.revocation == "required":
            judgement.pin("revocation", "required")
            unchecked = _revocation_unchecked(presented)
            if unchecked:
                judgement.refuse("revocation-not-checked", "revocation: required, and the verifier did not check it: "
                                 + "; ".join(unchecked))
        return Verdict(tuple(judgement.refusals), presented, tuple(judgement.pinned), tuple(judgement.unpinned),
                       untrusted=kind == "none")

    def _judge_workload(self, judgement: _Judgement) -> None:
        presented = judgement.presented
        label = WORKLOAD_LABELS[presented.tee_type]
        if self.measurements == ANY:
            judgement.unpinned.append("measurements")
        else:
            judgement.pin("measurements", f"{label} {presented.measurement or 'none'}")
            if presented.tee_type == "none" or presented.measurement not in self.measurements:
                judgement.refuse("workload-not-accepted", f"the launch measurement ({label}) "
                                 f"{presented.measurement or 'none'} is not one measurements accepts")
        if self.rtmrs == ANY:
            if presented.tee_type == "tdx":
                judgement.unpinned.append("rtmrs")
            return
        shown = "none" if presented.rtmrs is None else " ".join(presented.rtmrs)
        judgement.pin("rtmrs", shown)
        if presented.rtmrs not in self.rtmrs:
            judgement.refuse("workload-not-accepted", f"the RTMRs {shown} are not a set rtmrs accepts")

    def _judge_tdx_tcb_status(self, judgement: _Judgement) -> None:
        presented = judgement.presented
        status = presented.tcb_status
        if status == REVOKED:
            judgement.refuse("tcb-status-not-accepted", f"the platform's {tdx_tcb_phrase(presented)}: Intel revoked "
                             "this TCB, and no policy accepts it")
            return
        if self.tdx_tcb_status == ANY:
            judgement.unpinned.append("tdx_tcb_status")
            return
        accepted = ", ".join(sorted(self.tdx_tcb_status))
        judgement.pin("tdx_tcb_status", accepted)
        if status is None:
            judgement.refuse("tcb-status-not-accepted", "the TDX TCB status was not evaluated (no Intel TCB info and "
                             f"QE identity in the collateral: give collateral); tdx_tcb_status accepts {accepted}")
        elif status not in self.tdx_tcb_status:
            judgement.refuse("tcb-status-not-accepted", f"the platform's {tdx_tcb_phrase(presented)} is not a status "
                             f"tdx_tcb_status accepts ({accepted})")

    def _judge_snp_guest(self, judgement: _Judgement) -> None:
        snp = judgement.presented.snp
        rules: list[tuple[str, bool]] = [("vmpls", self.vmpls != ANY),
                                         ("migration_agent", self.migration_agent == "forbidden"),
                                         ("smt", self.smt == "forbidden"),
                                         *((key, getattr(self, key) != ANY) for key in SNP_VALUE_KEYS)]
        # SMT allowed is the platform's default and no weakness of the guest's own: not named as unpinned.
        judgement.unpinned.extend(key for key, pinned in rules if not pinned and key != "smt")
        required = [key for key, pinned in rules if pinned]
        if required and snp is None:
            judgement.refuse("guest-policy-not-accepted", "the evidence presents no SEV-SNP guest facts this "
                             f"verifier read; {', '.join(required)} require them")
            return
        for key in required:
            problem = self._guest_problem(judgement, key)
            if problem:
                judgement.refuse("guest-policy-not-accepted", problem)

    def _guest_problem(self, judgement: _Judgement, key: str) -> str | None:
        """Pins `key` on the verdict; returns why the guest does not meet it, or None."""
        snp = judgement.presented.snp
        assert snp is not None
        if key == "vmpls":
            judgement.pin(key, f"VMPL {snp.vmpl}")
            assert not isinstance(self.vmpls, str)
            return None if snp.vmpl in self.vmpls else (
                f"the report was made at VMPL {snp.vmpl}; vmpls accepts {', '.join(map(str, sorted(self.vmpls)))}")
        if key in ("migration_agent", "smt"):
            judgement.pin(key, "forbidden")
            bit, name = (MIGRATE_MA_BIT, "a migration agent (MIGRATE_MA, bit 18)") if key == "migration_agent" else (
                SMT_BIT, "SMT (bit 16)")
            return None if not snp.policy & bit else (
                f"the guest policy {snp.policy:#x} allows {name}; {key}: forbidden")
        field, name, _ = SNP_VALUE_KEYS[key]
        value = getattr(snp, field).hex()
        judgement.pin(key, f"{name} {value}")
        accepted = getattr(self, key)
        return None if value in accepted else f"{name} {value} is not one {key} accepts"

    def _judge_identity(self, judgement: _Judgement) -> None:
        presented = judgement.presented
        if self.code_digests == ANY:
            judgement.unpinned.append("code_digests")
        else:
            judgement.pin("code_digests", presented.code_digest or "none")
            if presented.code_digest not in self.code_digests:
                judgement.refuse("code-not-accepted", f"the node runs code {presented.code_digest or 'it did not name'}"
                                 ", which code_digests does not accept")
        if isinstance(self.model_digests, str):
            judgement.unpinned.append("model_digests")
            return
        judgement.pin("model_digests", ", ".join(f"{model} {digest}" for model, digest
                                                 in sorted(presented.model_digests.items())) or "none")
        for model, digest in sorted(presented.model_digests.items()):
            if model not in self.model_digests:
                judgement.refuse("model-not-accepted", f"the node serves {model}, which model_digests does not name")
            elif digest not in self.model_digests[model]:
                judgement.refuse("model-not-accepted", f"the node serves {model} with weights {digest}, which "
                                 "model_digests does not accept")
        if not presented.model_digests:
            judgement.refuse("model-not-accepted", "the node named no model digest; model_digests requires them")

    @staticmethod
    def pin(presented: Presented, roots: str | None, collateral: str | None = None) -> dict[str, Any]:
        """A policy accepting exactly what `presented` shows (trust on first use): for a person to review."""
        hardware = presented.tee_type != "none"
        pinned: dict[str, Any] = {
            "tee_types": [presented.tee_type],
            "allow_none": not hardware,
            "roots": roots if hardware else None,
            "measurements": [presented.measurement] if hardware and presented.measurement else ANY,
            "rtmrs": [list(presented.rtmrs)] if presented.rtmrs is not None else ANY,
            "min_tcb": dict(presented.tcb) if presented.tcb is not None else ANY,
            "code_digests": [presented.code_digest] if presented.code_digest else ANY,
            "model_digests": ({model: [digest] for model, digest in sorted(presented.model_digests.items())}
                              if presented.model_digests else ANY),
            "gpu": "required" if presented.gpu_verified and presented.gpu is not None
                                  and presented.gpu.measurements_checked else "optional",
            "collateral": collateral,
        }
        if presented.tee_type == "tdx":
            pinned["tdx_tcb_status"] = [presented.tcb_status] if presented.tcb_status in TDX_TCB_STATUSES else ANY
        snp = presented.snp
        if presented.tee_type == "sev-snp" and snp is not None:
            pinned["vmpls"] = [snp.vmpl]
            pinned["migration_agent"] = "allowed" if snp.policy & MIGRATE_MA_BIT else "forbidden"
            pinned["smt"] = "allowed" if snp.policy & SMT_BIT else "forbidden"
            pinned.update({key: [getattr(snp, field).hex()] for key, (field, _, _) in SNP_VALUE_KEYS.items()})
        if hardware and not _revocation_unchecked(presented):
            pinned["revocation"] = "required"
        return pinned


class _Judgement:
    """What `TrustPolicy.judge` finds, key by key, in the order the verdict prints it."""

    def __init__(self, presented: Presented) -> None:
        self.presented = presented
        self.refusals: list[tuple[str, str]] = []
        self.pinned: list[tuple[str, str]] = []
        self.unpinned: list[str] = []

    def refuse(self, reason: str, message: str) -> None:
        self.refusals.append((reason, message))

    def pin(self, key: str, value: str) -> None:
        self.pinned.append((key, value))


def _judge_min_tcb(judgement: _Judgement, least: Mapping[str, int]) -> None:
    tcb = judgement.presented.tcb
    if tcb is None:
        judgement.refuse("tcb-below-minimum", "the evidence presents no TCB version this verifier read; min_tcb "
                         "requires one")
        return
    for name, version in sorted(least.items()):
        if tcb.get(name, -1) < version:
            judgement.refuse("tcb-below-minimum", f"TCB component {name} is {tcb.get(name, 'absent')}, min_tcb "
                             f"requires at least {version}")


def _gpu_missing(presented: Presented) -> str | None:
    """What keeps the GPU part from counting as verified, or None when it does."""
    gpu = presented.gpu
    if gpu is None:
        return "the evidence has no GPU part"
    if gpu.devices == 0:
        return "the GPU part has no report (confidential computing off)"
    if not gpu.verified:
        unchecked = f" ({'; '.join(gpu.not_checked)})" if gpu.not_checked else ""
        return f"the GPU part of {gpu.devices} report(s) was not verified{unchecked}"
    if not gpu.measurements_checked:
        # nvtrust passes no GPU whose measurements it did not compare with NVIDIA's signed RIMs: a genuine GPU
        # running a driver or VBIOS NVIDIA never published would otherwise count as verified.
        return (f"the measurements of its {gpu.devices} report(s) were not compared with NVIDIA's signed RIMs (no "
                "RIM files in the collateral)")
    return None


def _one_of(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise TrustPolicyError(f"{key}: one of {', '.join(choices)}")
    return str(value)


def _hex_values(value: Any, key: str, form: re.Pattern[str]) -> Accepted:
    if value == ANY:
        return ANY
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and form.fullmatch(v) for v in value):
        raise TrustPolicyError(f"{key}: any, or a non-empty list of lowercase hex values "
                               f"({form.pattern.split('{')[1].rstrip('}')} characters each)")
    return frozenset(value)


def _tdx_tcb_status(value: Any) -> Literal["any"] | frozenset[str]:
    if value == ANY:
        return ANY
    if not isinstance(value, list) or not value or not all(status in TDX_TCB_STATUSES for status in value):
        raise TrustPolicyError("tdx_tcb_status: any, or a non-empty list of Intel TCB statuses: "
                               + ", ".join(TDX_TCB_STATUSES) + f" ({REVOKED} is never accepted)")
    return frozenset(value)


def _vmpls(value: Any) -> Literal["any"] | frozenset[int]:
    if value == ANY:
        return ANY
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3 for v in value)):
        raise TrustPolicyError("vmpls: any, or a non-empty list of VMPLs, 0 to 3")
    return frozenset(value)


def _rtmrs(value: Any) -> Literal["any"] | frozenset[tuple[str, str, str, str]]:
    if value == ANY:
        return ANY
    if (not isinstance(value, list) or not value
            or not all(isinstance(item, list) and len(item) == 4
                       and all(isinstance(v, str) and _MEASUREMENT.fullmatch(v) for v in item) for item in value)):
        raise TrustPolicyError("rtmrs: any, or a non-empty list of [RTMR0, RTMR1, RTMR2, RTMR3] sets of 96 lowercase "
                               "hex characters each")
    return frozenset((item[0], item[1], item[2], item[3]) for item in value)


def _min_tcb(value: Any) -> Literal["any"] | Mapping[str, int]:
    if value == ANY:
        return ANY
    if (not isinstance(value, dict) or not value
            or not all(isinstance(k, str) and _TCB_NAME.fullmatch(k) and isinstance(v, int) and not isinstance(v, bool)
                       and 0 <= v <= 255 for k, v in value.items())):
        raise TrustPolicyError("min_tcb: any, or a mapping of SEV-SNP TCB component names (bl, tee, snp, ucode, fmc) "
                               "to their least versions, 0 to 255")
    return dict(value)


def _model_digests(value: Any) -> Literal["any"] | Mapping[str, frozenset[str]]:
    if value == ANY:
        return ANY
    if not isinstance(value, dict) or not value:
        raise TrustPolicyError("model_digests: any, or a mapping of model ids to lists of accepted digests")
    models = {}
    for model, digests in value.items():
        if not isinstance(model, str) or not model:
            raise TrustPolicyError("model_digests: each key is a served model id")
        accepted = _hex_values(digests, f"model_digests.{model}", _DIGEST)
        if isinstance(accepted, str):
            raise TrustPolicyError(f"model_digests.{model}: a list of digests (any is said of model_digests whole)")
        models[model] = accepted
    return models


def _revocation_unchecked(presented: Presented) -> list[str]:
    """The verifier's `not_checked` phrases about revocation (CPU or GPU certificates)."""
    return [item for item in presented.not_checked if not_checked_about(item).endswith("revocation")]
