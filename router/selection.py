"""Choosing a provider for one request: hard constraints, then a base score, then a bounded bias to warm state.

Pure: the candidates come in as values (what the registry last heard from each node), and nothing here does I/O.

1. Hard constraints. A candidate must meet every requirement of the request (its caller's configured
   requirements merged with its headers, `policies.requirements.unmet`) and the caller's lowest trust tier.
   They are applied one at a time in CONSTRAINTS order; when none are left, the refusal names the constraint
   under which the last ones fell and what each of those offers.
2. Base score, lower is better, over the eligible candidates:

       price(p) = 3 * input_price(p) + output_price(p)       wei for a reference request of 3 prompt tokens per
                                                            reply token, floored at 1 wei
       wait(p)  = max(latency(p), 50 ms) * (1 + load(p))     the time to first byte the router measured (EWMA),
                                                            floored at 50 ms, once for each request ahead of ours
       base(p)  = sqrt(price(p) / min price * wait(p) / min wait)

   A candidate best in both scores 1.0; price and speed weigh the same, so one 44% pricier but no slower, or
   20% worse in both, scores 1.2. A candidate not yet measured counts the median latency of those measured
   (1 s if none is). Ties go to the candidate this router sent a request to longest ago, then to the name: idle
   comparable providers take turns rather than the first name taking every cold request (when finished requests
   stop counting as load, equal scores are the common case of a fleet that keeps up), and two routers that
   heard the same from the nodes and have sent nothing yet choose alike.
3. Warm bias. Among the candidates whose base score is within MARGIN (20%) of the best, the one whose summary
   holds the deepest prefix of the request wins, ties going to the better base score. Warm state saves the
   caller a prefill and is billed at the cached-read price, but it never overrides a constraint, and it never
   chooses a provider more than MARGIN worse than the best. Without a warm prefix within the margin, or with
   the bias off, the choice is the best base score.

The other eligible candidates follow the chosen one in base order: where the request goes if the chosen one
fails before answering. `rotate` is round-robin over the eligible candidates: the benchmarks' contrast.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.node_policy import TRUST_TIERS
from policies.requirements import TOKEN_CLASSES, CallerRequirements, Offer, unmet
from router.errors import RequirementNotMet

ROUTINGS = ("warm", "least-loaded", "round-robin")
"""How a router chooses: the base score with the bounded warm bias (the default), the base score alone, or
`rotate`."""
MARGIN = 0.2
"""How much worse than the best base score a warm provider may be and still be chosen."""
REFERENCE_TOKENS = {"input": 3, "output": 1}
"""The token mix whose price the base score compares: prompts run longer than replies."""
UNMEASURED_LATENCY_S = 1.0
MIN_WAIT_S = 0.05
"""Waits shorter than this differ by a network's jitter: told apart, they would route on noise."""
CONSTRAINTS = ("trust_tier", "confidential_hardware", "jurisdiction",
               *(f"max_price_wei.{name}" for name in TOKEN_CLASSES))
"""The hard constraints in the order they eliminate candidates; the names a 412's `param` carries."""


class Warm(Protocol):
    def depth(self, forms: Sequence[bytes]) -> int:
        """How deep a prefix of `forms` (shortest first) the provider holds warm: 0 to len(forms)."""
        ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """A provider that serves the request's model and is up, as the registry last heard from it."""

    name: str
    offer: Offer
    trust_tier: str
    load: int
    """Requests ahead of ours: those in flight there (`router.registry`: this router's now, others' as of the
    last poll); one that has ended counts no more."""
    latency_s: float | None
    """The router's EWMA of this provider's time to first byte; None before its first answer."""
    warm: Warm | None = None
    """Its summary as this caller's requests test it; None without a verified summary."""
    last_sent: int = 0
    """When this router last sent it a request, as a count of the requests it has sent (0: never): the order of
    candidates whose base scores tie."""


@dataclass(frozen=True, slots=True)
class Choice:
    order: tuple[str, ...]
    """The chosen provider, then the other eligible ones in base order (where a failed attempt goes next)."""
    base: Mapping[str, float]
    """The base score of every eligible provider."""
    warm_depth: int
    """The prefix depth the chosen provider holds; 0 when it was chosen on its base score alone."""


def shortfalls(candidate: Candidate, requirements: CallerRequirements, min_trust_tier: str) -> dict[str, str]:
    """Each hard constraint the candidate does not meet, with why."""
    found = {item.requirement: item.message for item in unmet(requirements, candidate.offer)}
    if TRUST_TIERS.index(candidate.trust_tier) < TRUST_TIERS.index(min_trust_tier):
        found["trust_tier"] = f"trust tier {min_trust_tier} required; this node declares {candidate.trust_tier}"
    return found


def eligible(candidates: Sequence[Candidate], requirements: CallerRequirements,
             min_trust_tier: str) -> list[Candidate]:
    """The candidates that meet every hard constraint; raises RequirementNotMet naming the constraint that
    eliminated the last ones."""
    assert candidates, "the registry hands over at least one provider that is up"
    remaining = [(candidate, shortfalls(candidate, requirements, min_trust_tier)) for candidate in candidates]
    for constraint in CONSTRAINTS:
        kept = [(candidate, found) for candidate, found in remaining if constraint not in found]
        if not kept:
            reasons = "; ".join(f"{candidate.name}: {found[constraint]}" for candidate, found in remaining)
            raise RequirementNotMet(f"no provider of this model meets the requirement {constraint} ({reasons})",
                                    param=constraint)
        remaining = kept
    return [candidate for candidate, _ in remaining]


def reference_price(offer: Offer) -> int:
    return max(1, sum(count * offer.price_wei[name] for name, count in REFERENCE_TOKENS.items()))


def base_scores(candidates: Sequence[Candidate]) -> dict[str, float]:
    """base(p) for every candidate (the formula in the module's docstring); 1.0 is the best possible."""
    measured = [candidate.latency_s for candidate in candidates if candidate.latency_s is not None]
    typical = statistics.median(measured) if measured else UNMEASURED_LATENCY_S
    prices = {candidate.name: reference_price(candidate.offer) for candidate in candidates}
    # The floor is on the latency, before the load multiplies it: floored after, a fast-answering node's queue
    # would count for nothing until it was 50 ms deep.
    waits = {candidate.name: max(MIN_WAIT_S, typical if candidate.latency_s is None else candidate.latency_s)
             * (1 + candidate.load) for candidate in candidates}
    best_price, best_wait = min(prices.values()), min(waits.values())
    return {name: math.sqrt(prices[name] / best_price * (waits[name] / best_wait)) for name in prices}


def select(candidates: Sequence[Candidate], requirements: CallerRequirements, min_trust_tier: str,
           forms: Sequence[bytes], warm_bias: bool = True) -> Choice:
    """The provider for a request whose prefix forms (shortest first) are `forms`; raises RequirementNotMet when
    no candidate meets the hard constraints."""
    qualified = eligible(candidates, requirements, min_trust_tier)
    scores = base_scores(qualified)
    ranked = sorted(qualified, key=lambda candidate: (scores[candidate.name], candidate.last_sent, candidate.name))
    chosen, depth = ranked[0], 0
    if warm_bias and forms:
        ceiling = scores[ranked[0].name] * (1 + MARGIN)
        for candidate in ranked:
            if scores[candidate.name] > ceiling:
                break
            held = candidate.warm.depth(forms) if candidate.warm is not None else 0
            if held > depth:
                chosen, depth = candidate, held
    order = (chosen.name, *(candidate.name for candidate in ranked if candidate is not chosen))
    return Choice(order, scores, depth)


def rotate(candidates: Sequence[Candidate], requirements: CallerRequirements, min_trust_tier: str, turn: int
           ) -> Choice:
    """The `turn`-th eligible candidate in name order, then the others in turn: constraints still hold, scores
    and summaries decide nothing."""
    qualified = sorted(eligible(candidates, requirements, min_trust_tier), key=lambda candidate: candidate.name)
    first = turn % len(qualified)
    order = tuple(candidate.name for candidate in qualified[first:] + qualified[:first])
    return Choice(order, base_scores(qualified), 0)
