"""What verified evidence presents, and the verdict for people: what the hardware vouched for, what was pinned and
what was not checked.

A verdict line never says plain "OK" or "trusted": it names the TCB the hardware reported, which part of the workload
the caller pinned (a node whose launch measurement nobody pinned may run anything on genuine hardware), and every
check the verifier could not make. `attest verify` without a policy prints the same description, so its last line
cannot say more than a policy verdict would.

    OK: hardware verified (tdx, TCB UpToDate), workload pinned (MRTD, RTMR0-3); not pinned: code_digests;
        not checked: revocation (no Intel CRLs in the collateral)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from attestation.checks import GpuResult, SnpGuest
from attestation.errors import POLICY_REASONS

WORKLOAD_LABELS = {"sev-snp": "MEASUREMENT", "tdx": "MRTD", "none": "measurement"}
"""What `measurements` pins, per evidence type."""
RTMRS_LABEL = "RTMR0-3"


@dataclass(frozen=True, slots=True)
class Presented:
    """What a node presented, from evidence the verifier checked: each value is as the hardware or the binding
    vouches for it, or None where the evidence does not carry it. Built only by `trust_policy.presented_by`."""

    tee_type: str
    measurement: str | None = None
    rtmrs: tuple[str, str, str, str] | None = None
    tcb: Mapping[str, int] | None = None
    """SEV-SNP REPORTED_TCB's named components."""
    tcb_status: str | None = None
    """TDX: Intel's TCB status; None: not evaluated (no collateral), or not TDX."""
    advisory_ids: tuple[str, ...] = ()
    snp: SnpGuest | None = None
    code_digest: str | None = None
    model_digests: Mapping[str, str] = field(default_factory=dict)
    """Served model id -> weight digest."""
    gpu: GpuResult | None = None
    """None: the evidence has no GPU part."""
    not_checked: tuple[str, ...] = ()
    """What the verifier could not check, one `"what: why"` phrase each."""

    @property
    def gpu_verified(self) -> bool:
        return self.gpu is not None and self.gpu.verified


def hardware_phrase(presented: Presented) -> str:
    """What the hardware vouched for: the TEE, its TCB (TDX status with advisories, or SEV-SNP's components) and a
    verified GPU part."""
    if presented.tee_type == "none":
        return "UNTRUSTED (no TEE)"
    parts = [presented.tee_type]
    if presented.snp is not None:
        parts.append(" ".join(name for name in (presented.snp.product, presented.snp.signing_key) if name))
    if presented.tee_type == "tdx":
        parts.append(tdx_tcb_phrase(presented))
    else:
        parts.append("TCB not read" if presented.tcb is None else "TCB " + " ".join(
            f"{name} {value}" for name, value in presented.tcb.items() if not name.startswith("spl")))
    if presented.gpu_verified:
        assert presented.gpu is not None
        parts.append(f"{presented.gpu.devices} GPU(s) verified")
    return f"hardware verified ({', '.join(parts)})"


def tdx_tcb_phrase(presented: Presented) -> str:
    if presented.tcb_status is None:
        return "TCB status not evaluated"
    advisories = f" (advisories {' '.join(presented.advisory_ids)})" if presented.advisory_ids else ""
    return f"TCB {presented.tcb_status}{advisories}"


def workload_phrase(tee_type: str, pinned: Sequence[str]) -> str:
    """Which of the workload's values were pinned: SEV-SNP's MEASUREMENT covers the whole launched image; TDX's MRTD
    is only the firmware, and the kernel, command line and application are in RTMR0..3, so both must be pinned."""
    label = WORKLOAD_LABELS[tee_type]
    wanted = [label, RTMRS_LABEL] if tee_type == "tdx" else [label]
    named = {"measurements": label, "rtmrs": RTMRS_LABEL}
    held = [named[key] for key in ("measurements", "rtmrs") if key in pinned and named[key] in wanted]
    if held == wanted:
        return f"workload pinned ({', '.join(held)})"
    if held:
        return f"workload partly pinned ({', '.join(held)}; not {', '.join(v for v in wanted if v not in held)})"
    return "workload not pinned"


def not_checked_phrase(items: Sequence[str]) -> str:
    """`"revocation: no CRLs"` -> `"revocation (no CRLs)"`, joined."""
    return ", ".join(f"{what} ({why.strip()})" if why else what
                     for what, _, why in (item.partition(":") for item in items))


def description(presented: Presented, pinned: Sequence[str], unpinned: Sequence[str] = ()) -> str:
    """The hardware, the workload, the keys that pinned nothing and what was not checked, in one line: a verdict's
    head after `OK: `, and `attest verify`'s last line."""
    text = hardware_phrase(presented)
    if presented.tee_type != "none":
        text += ", " + workload_phrase(presented.tee_type, pinned)
    if unpinned:
        text += "; not pinned: " + ", ".join(unpinned)
    if presented.not_checked:
        text += "; not checked: " + not_checked_phrase(presented.not_checked)
    return text


@dataclass(frozen=True, slots=True)
class Verdict:
    refusals: tuple[tuple[str, str], ...]
    """Why the node is refused: (reason from `POLICY_REASONS`, message) each; empty: accepted."""
    presented: Presented
    pinned: tuple[tuple[str, str], ...] = ()
    """(policy key, what it pinned) for each key that judged this evidence with a value other than `any`."""
    unpinned: tuple[str, ...] = ()
    """The keys that accepted whatever this evidence presents (`any`, or `allowed`)."""
    untrusted: bool = False
    """Accepted `none` evidence: no hardware vouches for anything presented."""

    def __post_init__(self) -> None:
        for reason, _ in self.refusals:
            assert reason in POLICY_REASONS, reason

    @property
    def ok(self) -> bool:
        return not self.refusals

    def refused(self, reason: str, message: str) -> Verdict:
        """This verdict with one more refusal, first (a caller's own check, such as the TLS channel's)."""
        return Verdict(((reason, message), *self.refusals), self.presented, self.pinned, self.unpinned,
                       self.untrusted)

    def head(self) -> str:
        if not self.ok:
            return "REFUSED"
        if self.untrusted:
            return "OK, UNTRUSTED (none evidence, accepted by allow_none)"
        return "OK: " + description(self.presented, [key for key, _ in self.pinned], self.unpinned)

    def lines(self) -> list[str]:
        """The head line, then each refusal as `reason: message`, or each key with what it pinned or `any`."""
        if not self.ok:
            return [self.head(), *(f"  {reason}: {message}" for reason, message in self.refusals)]
        return [self.head(), *(f"  {key}: {value} (pinned)" for key, value in self.pinned),
                *(f"  {key}: {'allowed' if key == 'migration_agent' else 'any'} (not pinned)"
                  for key in self.unpinned)]
