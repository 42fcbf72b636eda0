"""A caller's trust policy: what a verified node must present before a prompt is sent to it.

One YAML file, taken by `tenzro client verify`, `tenzro proxy`, `tenzro attest verify`, `tenzro metering verify` and
the router. Every key is written out and checked; an unknown key is an error, never ignored, so a misspelt
requirement cannot silently accept everything.

    tee_types: [sev-snp, tdx]     # accepted evidence types; `none` only together with allow_none: true
    allow_none: false             # accept `none` evidence (no TEE: development only); the verdict says UNTRUSTED
    roots: roots/                 # AMD and Intel roots (`tenzro attest verify --trust-root`), relative to this file
    measurements: any | [HEX]     # SEV-SNP MEASUREMENT or TDX MRTD, 96 hex characters each
    rtmrs: any | [[HEX, HEX, HEX, HEX]]   # TDX RTMR0..3, each set accepted whole
    min_tcb: any | {NAME: N}      # the least SEV-SNP REPORTED_TCB components: bl, tee, snp, ucode (fmc on Turin)
    code_digests: any | [HEX]     # the node's code identity (64 hex characters)
    model_digests: any | {MODEL_ID: [HEX]}   # per served model id, its accepted weight digests
    gpu: optional | required      # whether GPU evidence must be present and verified

`any` accepts whatever is presented, and the verdict names every such key, so a person reading it sees what was not
pinned. A requirement whose value the evidence does not present (a TCB the verifier did not read, say) refuses: the
check fails closed, never open.

Pure: it parses the file and judges `Presented` values, read off evidence the verifier has checked by
`presented_by`: the one place every caller (`client`, `attest verify`, `metering verify`) turns a verification into
what a policy judges, so they cannot come to judge different values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from attestation.evidence import EVIDENCE_TYPES
from attestation.verify import VerificationResult

ANY: Literal["any"] = "any"
POLICY_KEYS = ("tee_types", "allow_none", "roots", "measurements", "rtmrs", "min_tcb", "code_digests",
               "model_digests", "gpu")
GPU_RULES = ("optional", "required")
_MEASUREMENT = re.compile(r"[0-9a-f]{96}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TCB_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

Accepted = Literal["any"] | frozenset[str]
"""`any`, or the accepted lowercase hex values."""


class TrustPolicyError(ValueError):
    """The trust policy file is malformed; the message names the key to change."""


@dataclass(frozen=True, slots=True)
class Presented:
    """What a node presented, from evidence the verifier checked: each value is as the hardware or the binding
    vouches for it, or None where the evidence does not carry it."""

    tee_type: str
    measurement: str | None = None
    rtmrs: tuple[str, str, str, str] | None = None
    tcb: Mapping[str, int] | None = None
    code_digest: str | None = None
    model_digests: Mapping[str, str] = field(default_factory=dict)
    """Served model id -> weight digest."""
    gpu_verified: bool = False


def presented_by(result: VerificationResult) -> Presented:
    """What verified evidence proves, for a policy to judge: the launch measurement the hardware signed, and the
    code and model digests the binding ties to it (a v1 document binds neither, so a policy pinning them refuses
    it), SEV-SNP's reported TCB and TDX's RTMRs. No GPU verdict yet (issue 36): a policy requiring it refuses."""
    return Presented(result.evidence_type, measurement=result.measurement_hex, rtmrs=result.rtmrs_hex,
                     tcb=result.tcb, code_digest=result.code_digest_hex, model_digests=dict(result.model_digests))


@dataclass(frozen=True, slots=True)
class Verdict:
    refusals: tuple[str, ...]
    """Why the node is refused, one line each; empty: accepted."""
    unpinned: tuple[str, ...]
    """The policy keys that accepted `any`."""
    untrusted: bool
    """Accepted `none` evidence: no hardware vouches for anything presented."""

    @property
    def ok(self) -> bool:
        return not self.refusals

    def lines(self) -> list[str]:
        """The verdict for people: OK or REFUSED first, then why and what was not pinned."""
        if not self.ok:
            return ["REFUSED", *(f"  {reason}" for reason in self.refusals)]
        head = "OK, UNTRUSTED (none evidence, accepted by allow_none)" if self.untrusted else "OK"
        return [head, *(f"  {key}: any (not pinned)" for key in self.unpinned)]


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

    @classmethod
    def load(cls, path: Path) -> TrustPolicy:
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise TrustPolicyError(f"cannot read the trust policy {path}: {exc}") from exc
        return cls.parse(raw, base=path.parent)

    @classmethod
    def parse(cls, raw: Any, base: Path) -> TrustPolicy:
        """The policy in `raw` (parsed YAML); relative `roots` are taken from `base`."""
        if not isinstance(raw, dict):
            raise TrustPolicyError("a trust policy is a mapping of the keys " + ", ".join(POLICY_KEYS))
        unknown = sorted(str(key) for key in raw if key not in POLICY_KEYS)
        if unknown:
            raise TrustPolicyError(f"unknown trust policy keys {', '.join(unknown)}: the keys are "
                                   + ", ".join(POLICY_KEYS))
        missing = [key for key in POLICY_KEYS if key not in raw]
        if missing:
            raise TrustPolicyError(f"the trust policy must set every key; missing: {', '.join(missing)}")
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
            raise TrustPolicyError("roots: the directory of the AMD and Intel roots, or null (none evidence only)")
        if roots is None and set(tee_types) - {"none"}:
            raise TrustPolicyError("roots: hardware evidence is verified against roots; name their directory")
        if raw["gpu"] not in GPU_RULES:
            raise TrustPolicyError(f"gpu: one of {', '.join(GPU_RULES)}")
        return cls(tee_types=frozenset(tee_types), allow_none=raw["allow_none"],
                   roots=None if roots is None else (base / roots),
                   measurements=_hex_values(raw["measurements"], "measurements", _MEASUREMENT),
                   rtmrs=_rtmrs(raw["rtmrs"]), min_tcb=_min_tcb(raw["min_tcb"]),
                   code_digests=_hex_values(raw["code_digests"], "code_digests", _DIGEST),
                   model_digests=_model_digests(raw["model_digests"]), gpu=raw["gpu"])

    def judge(self, presented: Presented) -> Verdict:
        refusals: list[str] = []
        unpinned = [key for key in ("measurements", "rtmrs", "min_tcb", "code_digests", "model_digests")
                    if getattr(self, key) == ANY]
        if presented.tee_type not in self.tee_types:
            refusals.append(f"tee_types: the node presented {presented.tee_type} evidence; the policy accepts "
                            + ", ".join(sorted(self.tee_types)))
        hardware = presented.tee_type != "none"
        if self.measurements != ANY and (not hardware or presented.measurement not in self.measurements):
            refusals.append(f"measurements: the node's launch measurement {presented.measurement or 'none'} is not "
                            "one the policy accepts")
        if self.rtmrs != ANY and presented.rtmrs not in self.rtmrs:
            refusals.append("rtmrs: the node's RTMRs " + ("none" if presented.rtmrs is None else
                                                          " ".join(presented.rtmrs)) + " are not a set the policy "
                            "accepts")
        if not isinstance(self.min_tcb, str):
            refusals.extend(_tcb_refusals(self.min_tcb, presented.tcb))
        if self.code_digests != ANY and presented.code_digest not in self.code_digests:
            refusals.append(f"code_digests: the node runs code {presented.code_digest or 'it did not name'}, which "
                            "the policy does not accept")
        if not isinstance(self.model_digests, str):
            refusals.extend(_model_refusals(self.model_digests, presented.model_digests))
        if self.gpu == "required" and not presented.gpu_verified:
            refusals.append("gpu: the policy requires verified GPU evidence; the node presented none")
        return Verdict(tuple(refusals), tuple(unpinned), untrusted=not hardware)

    @staticmethod
    def pin(presented: Presented, roots: str | None) -> dict[str, Any]:
        """A policy accepting exactly what `presented` shows (trust on first use): for a person to review."""
        hardware = presented.tee_type != "none"
        return {
            "tee_types": [presented.tee_type],
            "allow_none": not hardware,
            "roots": roots if hardware else None,
            "measurements": [presented.measurement] if hardware and presented.measurement else ANY,
            "rtmrs": [list(presented.rtmrs)] if presented.rtmrs is not None else ANY,
            "min_tcb": dict(presented.tcb) if presented.tcb is not None else ANY,
            "code_digests": [presented.code_digest] if presented.code_digest else ANY,
            "model_digests": ({model: [digest] for model, digest in sorted(presented.model_digests.items())}
                              if presented.model_digests else ANY),
            "gpu": "required" if presented.gpu_verified else "optional",
        }


def _hex_values(value: Any, key: str, form: re.Pattern[str]) -> Accepted:
    if value == ANY:
        return ANY
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and form.fullmatch(v) for v in value):
        raise TrustPolicyError(f"{key}: any, or a non-empty list of lowercase hex values "
                               f"({form.pattern.split('{')[1].rstrip('}')} characters each)")
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


def _tcb_refusals(least: Mapping[str, int], tcb: Mapping[str, int] | None) -> list[str]:
    if tcb is None:
        return ["min_tcb: the evidence presents no TCB version this verifier read; the policy requires one"]
    return [f"min_tcb: {name} is {tcb.get(name, 'absent')}, the policy requires at least {version}"
            for name, version in sorted(least.items()) if tcb.get(name, -1) < version]


def _model_refusals(accepted: Mapping[str, frozenset[str]], presented: Mapping[str, str]) -> Sequence[str]:
    refusals = []
    for model, digest in sorted(presented.items()):
        if model not in accepted:
            refusals.append(f"model_digests: the node serves {model}, which the policy does not name")
        elif digest not in accepted[model]:
            refusals.append(f"model_digests: the node serves {model} with weights {digest}, which the policy does not "
                            "accept")
    if not presented:
        refusals.append("model_digests: the node named no model digest; the policy requires them")
    return refusals
