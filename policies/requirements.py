"""What a caller requires of the node that serves it, and which of those requirements a node's offer leaves unmet.

A caller's requirements come from two places: the node's config (`callers.NAME.requirements`, set by
the operator for that caller) and the request's headers (set by the caller per request). `merge` keeps
the stricter of the two, so a request can narrow what the config allows and never widen it.

Pure: no node, no HTTP, no prompt content. The node checks a request against its own offer here, and
the router (a later issue) reuses `unmet` for its hard constraints.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.jurisdiction import code_problem

TOKEN_CLASSES = ("input", "output", "cached_read", "cached_write")
"""The token classes a completion is billed in (metering's four prices), in the order messages list them."""
NO_TEE = "none"
"""The attestation evidence type of a node that runs without a TEE."""
MAX_WEI = 2**256 - 1
"""The largest amount an EVM word holds; a larger ceiling is a mistake, and bounds what a header may parse."""

CONFIDENTIAL_HEADER = "Tenzro-Require-Confidential"
JURISDICTIONS_HEADER = "Tenzro-Jurisdictions"
MAX_PRICE_HEADER = "Tenzro-Max-Price-Wei"
HEADERS = (CONFIDENTIAL_HEADER, JURISDICTIONS_HEADER, MAX_PRICE_HEADER)
HEADER_FAMILIES = ("tenzro-require-", "tenzro-jurisdiction", "tenzro-max-")
"""A header that starts like a requirement header but is none of them is refused: a misspelt requirement
would otherwise be ignored, and the request served without it."""
CONFIG_KEYS = ("confidential_hardware", "jurisdictions", "max_price_wei")
_DIGITS = re.compile(r"[0-9]{1,78}")


class RequirementsError(ValueError):
    """Caller requirements are malformed; the message names the key or header to change."""


class RequirementHeaderError(RequirementsError):
    """A requirement header is malformed or unknown; `header` is its name as the caller should send it."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


class TokenPrices(Mapping[str, int]):
    """Wei per token by token class, in TOKEN_CLASSES order: read-only and hashable, so that the frozen values
    holding it (and a `Caller` holding those) stay hashable."""

    __slots__ = ("_prices",)

    def __init__(self, prices: Mapping[str, int]) -> None:
        unknown = sorted(set(prices) - set(TOKEN_CLASSES))
        if unknown:
            raise RequirementsError(f"unknown token class(es) {', '.join(unknown)}; allowed: "
                                    f"{', '.join(TOKEN_CLASSES)}")
        self._prices = {name: prices[name] for name in TOKEN_CLASSES if name in prices}

    def __getitem__(self, name: str) -> int:
        return self._prices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._prices)

    def __len__(self) -> int:
        return len(self._prices)

    def __hash__(self) -> int:
        return hash(tuple(self._prices.items()))

    def __repr__(self) -> str:
        return f"TokenPrices({self._prices!r})"


@dataclass(frozen=True, slots=True)
class CallerRequirements:
    """What a caller requires; the defaults require nothing."""

    confidential_hardware: bool = False
    """Served only by a node whose attestation evidence is a TEE's and verified (`trusted`)."""
    jurisdictions: frozenset[str] | None = None
    """Served only by a node declaring one of these; None: any node, even one that declares none. Empty
    only after a merge whose two lists do not overlap: then no node qualifies."""
    max_price_wei: Mapping[str, int] = field(default_factory=dict)
    """Per token class (a subset of TOKEN_CLASSES), the highest price per token accepted, in wei."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_price_wei", TokenPrices(self.max_price_wei))

    def as_config(self) -> dict[str, Any]:
        """The node.yaml form, only the keys that require something; `parse_requirements` reads it back."""
        entry: dict[str, Any] = {}
        if self.confidential_hardware:
            entry["confidential_hardware"] = True
        if self.jurisdictions is not None:
            entry["jurisdictions"] = sorted(self.jurisdictions)
        if self.max_price_wei:
            entry["max_price_wei"] = dict(self.max_price_wei)
        return entry


NO_REQUIREMENTS = CallerRequirements()


@dataclass(frozen=True, slots=True)
class Offer:
    """What a node offers a caller: its attestation, where it runs and what it charges."""

    evidence_type: str
    """The attestation evidence type: `sev-snp`, `tdx`, or NO_TEE."""
    trusted: bool
    """Whether that evidence verified; never true for NO_TEE."""
    jurisdiction: str | None
    """The node policy's jurisdiction; None when the node declares none (`unset`)."""
    price_wei: Mapping[str, int]
    """The price per token of every class in TOKEN_CLASSES, in wei."""

    def __post_init__(self) -> None:
        missing = [name for name in TOKEN_CLASSES if name not in self.price_wei]
        if missing:
            raise RequirementsError(f"an offer prices every token class; missing: {', '.join(missing)}")
        object.__setattr__(self, "price_wei", TokenPrices(self.price_wei))


@dataclass(frozen=True, slots=True)
class Unmet:
    """One requirement a node does not meet: `requirement` names it (`confidential_hardware`, `jurisdiction`,
    `max_price_wei.input`, ...); `message` says what was required and what the node offers."""

    requirement: str
    message: str


def hardware_shortfall(evidence_type: str, trusted: bool) -> str | None:
    """Why a node with this evidence is not confidential hardware, None when it is."""
    if evidence_type == NO_TEE:
        return f"its attestation evidence is {NO_TEE} (no TEE)"
    if not trusted:
        return f"its {evidence_type} attestation evidence did not verify"
    return None


def _mapping(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RequirementsError(f"{where} must be a mapping")
    return raw


def _unknown_keys(raw: dict[str, Any], where: str, allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        raise RequirementsError(f"unknown key(s) in {where}: {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _price(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_WEI:
        raise RequirementsError(f"{where} must be a whole number of wei per token, 0 to 2**256-1, got {value!r}")
    return value


def _jurisdictions(codes: Iterable[object], where: str) -> frozenset[str]:
    checked: set[str] = set()
    for index, code in enumerate(codes):
        problem = code_problem(code)
        if problem is not None:
            raise RequirementsError(f"{where}[{index}] {problem}")
        checked.add(str(code))
    if not checked:
        raise RequirementsError(f"{where} must name at least one jurisdiction; leave it out to accept any")
    return frozenset(checked)


def parse_requirements(raw: Any, where: str) -> CallerRequirements:
    """A caller's requirements from node.yaml; `where` is their path (`callers.alice.requirements`), which
    every error names. Keys left out require nothing."""
    entry = _mapping(raw, where)
    _unknown_keys(entry, where, CONFIG_KEYS)
    confidential = entry.get("confidential_hardware", False)
    if not isinstance(confidential, bool):
        raise RequirementsError(f"{where}.confidential_hardware must be true or false, got {confidential!r}")
    jurisdictions = None
    if "jurisdictions" in entry:
        if not isinstance(entry["jurisdictions"], list):
            raise RequirementsError(f"{where}.jurisdictions must be a list of country codes, e.g. [DE, FR]")
        jurisdictions = _jurisdictions(entry["jurisdictions"], f"{where}.jurisdictions")
    ceilings = _mapping(entry.get("max_price_wei", {}), f"{where}.max_price_wei")
    _unknown_keys(ceilings, f"{where}.max_price_wei", TOKEN_CLASSES)
    prices = {name: _price(value, f"{where}.max_price_wei.{name}") for name, value in ceilings.items()}
    return CallerRequirements(confidential, jurisdictions, prices)


def _header_values(headers: Mapping[str, str]) -> dict[str, str]:
    """The requirement headers present, by canonical name. Names are matched without regard to case (HTTP);
    a header sent twice is refused rather than one copy chosen."""
    canonical = {name.lower(): name for name in HEADERS}
    found: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in canonical:
            if canonical[lower] in found:
                raise RequirementHeaderError(canonical[lower], f"{canonical[lower]} was sent more than once; send it "
                                                               f"once")
            found[canonical[lower]] = value.strip()
        elif lower.startswith(HEADER_FAMILIES):
            raise RequirementHeaderError(name, f"unknown requirement header {name}; the requirement headers are "
                                               f"{', '.join(HEADERS)}")
    return found


def _header_items(value: str, header: str) -> list[str]:
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise RequirementHeaderError(header, f"{header} has an empty item: separate items with single commas")
    return items


def _header_confidential(value: str) -> bool:
    if value not in ("true", "false"):
        raise RequirementHeaderError(CONFIDENTIAL_HEADER, f"{CONFIDENTIAL_HEADER} must be true or false, got "
                                                          f"{value!r}")
    return value == "true"


def _header_jurisdictions(value: str) -> frozenset[str]:
    codes = _header_items(value, JURISDICTIONS_HEADER)
    try:
        return _jurisdictions(codes, JURISDICTIONS_HEADER)
    except RequirementsError as exc:
        raise RequirementHeaderError(JURISDICTIONS_HEADER, str(exc)) from exc


def _header_prices(value: str) -> dict[str, int]:
    header = MAX_PRICE_HEADER
    prices: dict[str, int] = {}
    for item in _header_items(value, header):
        name, equals, amount = (part.strip() for part in item.partition("="))
        if not equals or name not in TOKEN_CLASSES or not _DIGITS.fullmatch(amount):
            raise RequirementHeaderError(header, f"{header} item {item!r} must be CLASS=WEI with CLASS one of "
                                                 f"{', '.join(TOKEN_CLASSES)} and WEI a whole number, e.g. "
                                                 f"input=2000000000")
        if name in prices:
            raise RequirementHeaderError(header, f"{header} names {name} more than once")
        try:
            prices[name] = _price(int(amount), f"{header} {name}")
        except RequirementsError as exc:
            raise RequirementHeaderError(header, str(exc)) from exc
    return prices


def requirements_from_headers(headers: Mapping[str, str]) -> CallerRequirements:
    """A request's requirements from its HTTP headers (any Mapping; aiohttp's `request.headers` is one):

        Tenzro-Require-Confidential: true | false
        Tenzro-Jurisdictions: DE,FR
        Tenzro-Max-Price-Wei: input=2000000000,output=8000000000

    Headers left out require nothing. Raises `RequirementHeaderError` naming the header to fix."""
    values = _header_values(headers)
    confidential = CONFIDENTIAL_HEADER in values and _header_confidential(values[CONFIDENTIAL_HEADER])
    jurisdictions = _header_jurisdictions(values[JURISDICTIONS_HEADER]) if JURISDICTIONS_HEADER in values else None
    prices = _header_prices(values[MAX_PRICE_HEADER]) if MAX_PRICE_HEADER in values else {}
    return CallerRequirements(confidential, jurisdictions, prices)


def merge(configured: CallerRequirements, requested: CallerRequirements) -> CallerRequirements:
    """The stricter of the two: confidential if either asks, the jurisdictions both accept, the lower ceiling
    per class. Symmetric, so it does not matter which side a requirement came from."""
    if configured.jurisdictions is None or requested.jurisdictions is None:
        jurisdictions = requested.jurisdictions if configured.jurisdictions is None else configured.jurisdictions
    else:
        jurisdictions = configured.jurisdictions & requested.jurisdictions
    prices = dict(configured.max_price_wei)
    for name, ceiling in requested.max_price_wei.items():
        prices[name] = min(ceiling, prices.get(name, ceiling))
    return CallerRequirements(configured.confidential_hardware or requested.confidential_hardware, jurisdictions,
                              prices)


def _jurisdiction_unmet(required: frozenset[str], offered: str | None) -> Unmet | None:
    if offered in required:
        return None
    declared = f"this node declares {offered}" if offered else "this node declares no jurisdiction (unset)"
    if not required:
        return Unmet("jurisdiction", f"no jurisdiction is acceptable (the configured and the requested "
                                     f"jurisdictions do not overlap); {declared}")
    return Unmet("jurisdiction", f"jurisdiction {' or '.join(sorted(required))} required; {declared}")


def unmet(requirements: CallerRequirements, offer: Offer) -> tuple[Unmet, ...]:
    """Every requirement the offer does not meet, in a fixed order (hardware, jurisdiction, prices by class);
    empty when it meets them all."""
    found = []
    shortfall = hardware_shortfall(offer.evidence_type, offer.trusted)
    if requirements.confidential_hardware and shortfall is not None:
        found.append(Unmet("confidential_hardware", f"confidential hardware required; this node does not offer "
                                                    f"it: {shortfall}"))
    if requirements.jurisdictions is not None:
        jurisdiction = _jurisdiction_unmet(requirements.jurisdictions, offer.jurisdiction)
        if jurisdiction is not None:
            found.append(jurisdiction)
    for name, ceiling in requirements.max_price_wei.items():
        if offer.price_wei[name] > ceiling:
            found.append(Unmet(f"max_price_wei.{name}", f"{name} price at most {ceiling} wei per token required; "
                                                        f"this node charges {offer.price_wei[name]}"))
    return tuple(found)
