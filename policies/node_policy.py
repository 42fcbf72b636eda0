"""The node policy: where the node declares it runs, the trust tier it declares, and what it refuses to start without.

A YAML file under `policies/` (`standard`, `confidential`) or the operator's own, parsed once at start.
Every key is written out, a forgotten one is an error rather than a silent default, and unknown keys are
errors. The tier a node declares is enforced: `confidential` is accepted only when every requirement is
on, so a node cannot call itself confidential and then start without locked memory or a TEE.

Pure: which hygiene the process achieved and which attestation evidence it holds are the node's to find
out; this module says what the policy requires of them.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from policies import policy_file
from policies.jurisdiction import FORM, code_problem
from policies.requirements import Unmet, hardware_shortfall

SHIPPED_POLICIES = ("confidential", "standard")
TRUST_TIERS = ("standard", "confidential")
UNSET = "unset"
"""The `jurisdiction` of a node that declares none: a caller who requires any jurisdiction is refused."""
POLICY_KEYS = ("jurisdiction", "trust_tier", "require")


class NodePolicyError(ValueError):
    """A node policy file is malformed or missing; the message names the key or file to change."""


@dataclass(frozen=True, slots=True)
class NodeRequirements:
    """What the node refuses to start without."""

    memory_locked: bool
    """All of the process's memory is locked (mlockall): nothing it holds is written to swap."""
    no_swap: bool
    """No swap device or file is active."""
    sealing: bool
    """Prompt state stored for reuse is sealed (AES-256-GCM under per-scope keys)."""
    confidential_hardware: bool
    """The node's attestation evidence is a TEE's (not `none`) and verified."""
    tls: bool
    """The node serves HTTPS with a key made in its memory (`node/tls.py`), never plain HTTP: whoever relays a
    plain connection reads every prompt."""


REQUIREMENTS = tuple(item.name for item in fields(NodeRequirements))


@dataclass(frozen=True, slots=True)
class NodePolicy:
    name: str
    jurisdiction: str | None
    """ISO 3166-1 alpha-2 code; None when the file says `unset` and no `--jurisdiction` was given."""
    trust_tier: str
    """One of TRUST_TIERS; `confidential` only with every requirement on."""
    require: NodeRequirements

    def as_json(self) -> dict[str, Any]:
        """For `GET /v1/node`: callers see what the node declares and what it started under."""
        return {"name": self.name, "jurisdiction": self.jurisdiction, "trust_tier": self.trust_tier,
                "require": {key: getattr(self.require, key) for key in REQUIREMENTS}}


def _mapping(raw: Any, where: str, allowed: tuple[str, ...], name: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise NodePolicyError(f"'{where}' in node policy '{name}' must be a mapping")
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        raise NodePolicyError(f"unknown key(s) in '{where}' of node policy '{name}': {', '.join(unknown)}; "
                              f"allowed: {', '.join(allowed)}")
    missing = [key for key in allowed if key not in raw]
    if missing:
        raise NodePolicyError(f"missing key(s) in '{where}' of node policy '{name}': {', '.join(missing)}; every "
                              f"key is written out")
    return raw


def _jurisdiction(value: object, name: str) -> str | None:
    if value == UNSET:
        return None
    problem = code_problem(value, f"{FORM} or {UNSET} (none declared)")
    if problem is not None:
        raise NodePolicyError(f"'jurisdiction' in node policy '{name}' {problem}")
    return str(value)


def parse_node_policy(raw: Any, name: str) -> NodePolicy:
    """A node policy from parsed YAML; `name` is what errors and `GET /v1/node` call it."""
    policy = _mapping(raw, "policy", POLICY_KEYS, name)
    require = _mapping(policy["require"], "require", REQUIREMENTS, name)
    for key in REQUIREMENTS:
        if not isinstance(require[key], bool):
            raise NodePolicyError(f"'require.{key}' in node policy '{name}' must be true or false")
    requirements = NodeRequirements(**{key: require[key] for key in REQUIREMENTS})
    tier = policy["trust_tier"]
    if tier not in TRUST_TIERS:
        raise NodePolicyError(f"'trust_tier' in node policy '{name}' must be one of {', '.join(TRUST_TIERS)}, "
                              f"got {tier!r}")
    off = [key for key, value in zip(REQUIREMENTS, astuple(requirements), strict=True) if not value]
    if tier == "confidential" and off:
        raise NodePolicyError(f"trust_tier 'confidential' in node policy '{name}' needs every requirement on; off: "
                              f"{', '.join(off)}: set them true or declare trust_tier: standard")
    return NodePolicy(name=name, jurisdiction=_jurisdiction(policy["jurisdiction"], name), trust_tier=tier,
                      require=requirements)


def load_node_policy(name_or_path: str) -> NodePolicy:
    """A shipped policy by name (`confidential`, `standard`) or a policy file by path."""
    path = policy_file(f"{name_or_path}.yaml") if name_or_path in SHIPPED_POLICIES else Path(name_or_path)
    if not path.is_file():
        raise NodePolicyError(f"no node policy '{name_or_path}': name one of {', '.join(SHIPPED_POLICIES)} or give "
                              f"the path of a YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise NodePolicyError(f"{path} is not valid YAML: {exc}") from exc
    return parse_node_policy(raw, path.stem)


def with_jurisdiction(policy: NodePolicy, code: str) -> NodePolicy:
    """The policy with the operator's jurisdiction (`tenzro node serve --jurisdiction CC`) in place of the file's."""
    problem = code_problem(code)
    if problem is not None:
        raise NodePolicyError(f"the jurisdiction {problem}")
    return replace(policy, jurisdiction=code)


def hardware_unmet(policy: NodePolicy, evidence_type: str, trusted: bool) -> tuple[Unmet, ...]:
    """The node requirements its attestation evidence leaves unmet (`require.confidential_hardware`), with
    what to change; empty when there are none. `trusted` is whether the evidence verified."""
    shortfall = hardware_shortfall(evidence_type, trusted)
    if not policy.require.confidential_hardware or shortfall is None:
        return ()
    return (Unmet("require.confidential_hardware",
                  f"node policy '{policy.name}' requires confidential hardware, and {shortfall}: run the node in a "
                  f"confidential VM (SEV-SNP or TDX) whose evidence verifies, or use a policy with "
                  f"confidential_hardware: false"),)


def tls_unmet(policy: NodePolicy, tls: bool) -> tuple[Unmet, ...]:
    """The node requirement serving plain HTTP leaves unmet (`require.tls`), with what to change; empty when
    `tls` (the node serves HTTPS) or the policy does not require it."""
    if not policy.require.tls or tls:
        return ()
    return (Unmet("require.tls",
                  f"node policy '{policy.name}' requires TLS, and --no-tls asks for plain HTTP, which whoever relays "
                  f"the connection reads: serve without --no-tls (TLS is on by default under this policy), or use "
                  f"a policy with tls: false for local development"),)
