"""Choosing a provider (router/selection.py): hard constraints, the base score, the bounded warm bias."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.node_policy import TRUST_TIERS
from policies.requirements import NO_REQUIREMENTS, TOKEN_CLASSES, CallerRequirements, Offer, unmet
from router.errors import RequirementNotMet
from router.selection import CONSTRAINTS, MARGIN, Candidate, base_scores, rotate, select, shortfalls

PRICES = {"input": 1_000_000_000, "output": 4_000_000_000, "cached_read": 100_000_000,
          "cached_write": 1_250_000_000}
FORMS = [b"1" * 32, b"2" * 32, b"3" * 32, b"4" * 32]
"""Stand-ins for a four-message chat's prefix forms; `Held` below only counts them."""


@dataclass(frozen=True)
class Held:
    """A summary holding the first `held` prefixes of any request."""

    held: int

    def depth(self, forms: Sequence[bytes]) -> int:
        return min(self.held, len(forms))


def offer(factor: float = 1.0, jurisdiction: str | None = None, evidence: str = "none",
          trusted: bool = False) -> Offer:
    return Offer(evidence, trusted, jurisdiction, {name: int(price * factor) for name, price in PRICES.items()})


def candidate(name: str, factor: float = 1.0, load: int = 0, latency_s: float | None = None, held: int | None = None,
              tier: str = "standard", **offered: object) -> Candidate:
    return Candidate(name, offer(factor, **offered), tier, load, latency_s,  # type: ignore[arg-type]
                     None if held is None else Held(held))


def meets_all(item: Candidate, requirements: CallerRequirements, min_tier: str) -> bool:
    """Independently of selection: every requirement met and the tier high enough."""
    return (unmet(requirements, item.offer) == ()
            and TRUST_TIERS.index(item.trust_tier) >= TRUST_TIERS.index(min_tier))


# Exact cases


def test_the_base_score_is_the_geometric_mean_of_price_and_wait_relative_to_the_best() -> None:
    """a: best price, two requests ahead (wait 3x); b: 10% pricier, idle; c: twice the price, idle."""
    scores = base_scores([candidate("a", load=2, latency_s=0.25), candidate("b", 1.1, latency_s=0.25),
                          candidate("c", 2.0, latency_s=0.25)])
    assert scores == {"a": math.sqrt(3.0), "b": math.sqrt(1.1), "c": math.sqrt(2.0)}


def test_an_unmeasured_provider_counts_the_median_latency_and_short_waits_count_alike() -> None:
    scores = base_scores([candidate("a", latency_s=0.125), candidate("b", latency_s=0.375), candidate("c")])
    assert scores == {"a": 1.0, "b": math.sqrt(3.0), "c": math.sqrt(2.0)}  # c counts 0.25 s
    # 10 ms and 40 ms are both under the 50 ms floor: jitter, not a difference.
    assert base_scores([candidate("a", latency_s=0.01), candidate("b", latency_s=0.04)]) == {"a": 1.0, "b": 1.0}


def test_a_free_provider_is_scored_against_one_wei() -> None:
    scores = base_scores([candidate("free", 0.0), candidate("paid")])
    assert scores == {"free": 1.0, "paid": math.sqrt(7_000_000_000)}


def test_ties_go_to_the_name_so_that_routers_agree() -> None:
    choice = select([candidate("b"), candidate("a"), candidate("c")], NO_REQUIREMENTS, "standard", [])
    assert choice.order == ("a", "b", "c")


def test_ties_go_first_to_the_provider_sent_to_longest_ago() -> None:
    """Idle comparable providers take turns: with finished requests no longer load, the first name would otherwise
    take every cold request. A better score still wins whenever it was sent to."""
    tied = [replace(candidate("a"), last_sent=5), replace(candidate("b"), last_sent=3), candidate("c")]
    assert select(tied, NO_REQUIREMENTS, "standard", []).order == ("c", "b", "a")
    cheaper = [replace(candidate("a", 0.9), last_sent=5), replace(candidate("b"), last_sent=3)]
    assert select(cheaper, NO_REQUIREMENTS, "standard", []).order == ("a", "b")


def test_the_deepest_warm_prefix_within_the_margin_wins() -> None:
    """b (base 1.049) holds 2 messages, c (1.183) holds 3, d (1.204, just past 1.2) holds all 4."""
    candidates = [candidate("a"), candidate("b", 1.1, held=2), candidate("c", 1.4, held=3),
                  candidate("d", 1.45, held=4)]
    choice = select(candidates, NO_REQUIREMENTS, "standard", FORMS)
    assert (choice.order, choice.warm_depth) == (("c", "a", "b", "d"), 3)
    assert select(candidates, NO_REQUIREMENTS, "standard", FORMS, warm_bias=False).order == ("a", "b", "c", "d")


def test_equal_depths_go_to_the_better_base_score_and_no_depth_to_the_best() -> None:
    candidates = [candidate("a", held=0), candidate("b", 1.1, held=2), candidate("c", 1.05, held=2)]
    assert select(candidates, NO_REQUIREMENTS, "standard", FORMS).order == ("c", "a", "b")
    assert select(candidates, NO_REQUIREMENTS, "standard", []).order == ("a", "c", "b")
    cold = [candidate("a", held=0), candidate("b", 1.1, held=0)]
    assert select(cold, NO_REQUIREMENTS, "standard", FORMS).warm_depth == 0


def test_the_last_constraint_standing_is_named_with_each_providers_reason() -> None:
    candidates = [candidate("a", jurisdiction="FR"), candidate("b", 0.5, jurisdiction="DE"),
                  candidate("c", tier="confidential", jurisdiction="DE", evidence="sev-snp", trusted=True)]
    requirements = CallerRequirements(jurisdictions=frozenset({"DE"}), max_price_wei={"input": 500_000_000})
    assert select(candidates, requirements, "standard", []).order == ("b",)
    with pytest.raises(RequirementNotMet) as raised:
        select(candidates, CallerRequirements(jurisdictions=frozenset({"DE"}), max_price_wei={"input": 1}),
               "standard", [])
    assert raised.value.param == "max_price_wei.input"
    assert raised.value.message == (
        "no provider of this model meets the requirement max_price_wei.input (b: input price at most 1 wei per "
        "token required; this node charges 500000000; c: input price at most 1 wei per token required; this node "
        "charges 1000000000)")
    with pytest.raises(RequirementNotMet) as raised:  # only c passes the tier, and it is in DE
        select(candidates, CallerRequirements(confidential_hardware=True, jurisdictions=frozenset({"FR"})),
               "confidential", [])
    assert (raised.value.param, raised.value.message) == (
        "jurisdiction", "no provider of this model meets the requirement jurisdiction (c: jurisdiction FR required; "
                        "this node declares DE)")


def test_a_trust_tier_below_the_callers_minimum_eliminates() -> None:
    with pytest.raises(RequirementNotMet) as raised:
        select([candidate("a")], NO_REQUIREMENTS, "confidential", [])
    assert (raised.value.param, raised.value.message) == (
        "trust_tier", "no provider of this model meets the requirement trust_tier (a: trust tier confidential "
                      "required; this node declares standard)")


# Properties

NAMES = ("a", "b", "c", "d", "e")
offers = st.builds(
    lambda evidence, trusted, jurisdiction, prices: Offer(evidence, trusted and evidence != "none", jurisdiction,
                                                          prices),
    st.sampled_from(("none", "sev-snp", "tdx")), st.booleans(), st.sampled_from((None, "DE", "FR", "US")),
    # Mostly comparable prices, so that the margin has candidates to choose between; sometimes any price.
    st.fixed_dictionaries({name: st.integers(10**9, 13 * 10**8) | st.integers(0, 10**10) for name in TOKEN_CLASSES}))
candidate_lists = st.lists(
    st.builds(lambda offered, tier, load, latency, held: (offered, tier, load, latency, held), offers,
              st.sampled_from(TRUST_TIERS), st.integers(0, 1) | st.integers(0, 20),
              st.none() | st.floats(0.5, 0.6) | st.floats(0, 10), st.none() | st.integers(0, 4)),
    min_size=1, max_size=len(NAMES)).map(lambda rows: [
        Candidate(name, offered, tier, load, latency, None if held is None else Held(held))
        for name, (offered, tier, load, latency, held) in zip(NAMES, rows, strict=False)])
comparable_lists = st.lists(
    st.builds(lambda factor, latency, held: (factor, latency, held), st.floats(1.0, 1.6),
              st.none() | st.floats(0.5, 0.7), st.none() | st.integers(0, 4)),
    min_size=2, max_size=len(NAMES)).map(lambda rows: [
        candidate(name, factor, latency_s=latency, held=held)
        for name, (factor, latency, held) in zip(NAMES, rows, strict=False)])
"""Providers that meet every requirement, within about the margin of each other: the warm bias's ground."""
requirement_sets = st.builds(
    CallerRequirements, st.booleans(),
    st.none() | st.frozensets(st.sampled_from(("DE", "FR", "US")), max_size=2),
    st.dictionaries(st.sampled_from(TOKEN_CLASSES), st.integers(0, 10**10), max_size=2))
tiers = st.sampled_from(TRUST_TIERS)
form_lists = st.integers(0, 4).map(lambda count: FORMS[:count])


def choose(candidates: list[Candidate], requirements: CallerRequirements, min_tier: str, forms: list[bytes],
           warm_bias: bool = True) -> tuple[str, ...] | RequirementNotMet:
    try:
        return select(candidates, requirements, min_tier, forms, warm_bias).order
    except RequirementNotMet as exc:
        return exc


@settings(max_examples=300)
@given(candidate_lists, requirement_sets, tiers, form_lists, st.booleans())
def test_the_chosen_provider_meets_every_hard_constraint(candidates: list[Candidate],
                                                         requirements: CallerRequirements, min_tier: str,
                                                         forms: list[bytes], warm_bias: bool) -> None:
    qualified = {item.name for item in candidates if meets_all(item, requirements, min_tier)}
    order = choose(candidates, requirements, min_tier, forms, warm_bias)
    if isinstance(order, RequirementNotMet):
        assert qualified == set()
    else:
        assert sorted(order) == sorted(qualified)  # the chosen one first, and every retry meets them too


@settings(max_examples=300)
@given(candidate_lists | comparable_lists, requirement_sets | st.just(NO_REQUIREMENTS), st.just("standard") | tiers,
       form_lists)
def test_the_warm_bias_never_chooses_a_provider_past_the_margin(candidates: list[Candidate],
                                                                requirements: CallerRequirements, min_tier: str,
                                                                forms: list[bytes]) -> None:
    try:
        choice = select(candidates, requirements, min_tier, forms)
    except RequirementNotMet:
        return
    best = min(choice.base.values())
    assert choice.base[choice.order[0]] <= best * (1 + MARGIN)
    ranked = select(candidates, requirements, min_tier, forms, warm_bias=False).order
    if choice.warm_depth == 0:
        assert choice.order == ranked
    else:  # it holds more than every provider ranked above it
        by_name = {item.name: item for item in candidates}
        above = ranked[:ranked.index(choice.order[0])]
        assert all(held.depth(forms) < choice.warm_depth for held in (by_name[name].warm for name in above) if held)


@settings(max_examples=300)
@given(candidate_lists | comparable_lists, requirement_sets | st.just(NO_REQUIREMENTS), st.just("standard") | tiers,
       form_lists)
def test_without_the_bias_the_choice_is_the_base_ranking(candidates: list[Candidate],
                                                         requirements: CallerRequirements, min_tier: str,
                                                         forms: list[bytes]) -> None:
    order = choose(candidates, requirements, min_tier, forms, warm_bias=False)
    if isinstance(order, RequirementNotMet):
        return
    qualified = [item for item in candidates if meets_all(item, requirements, min_tier)]
    scores = base_scores(qualified)
    assert order == tuple(sorted(scores, key=lambda name: (scores[name], name)))


@settings(max_examples=300)
@given(candidate_lists, requirement_sets, tiers)
def test_no_eligible_provider_names_the_constraint_that_eliminated_the_last_ones(
        candidates: list[Candidate], requirements: CallerRequirements, min_tier: str) -> None:
    failure = choose(candidates, requirements, min_tier, [])
    if not isinstance(failure, RequirementNotMet):
        return
    assert failure.param in CONSTRAINTS
    earlier = set(CONSTRAINTS[:CONSTRAINTS.index(failure.param)])
    survivors = [item for item in candidates if not earlier & set(shortfalls(item, requirements, min_tier))]
    assert survivors  # someone met every earlier constraint ...
    assert all(failure.param in shortfalls(item, requirements, min_tier) for item in survivors)  # ... and this one
    assert all(f"{item.name}: " in failure.message for item in survivors)


def test_round_robin_turns_through_the_eligible_providers_only() -> None:
    candidates = [candidate(name, latency_s=0.1) for name in ("c", "a", "b")]
    assert [rotate(candidates, NO_REQUIREMENTS, "standard", turn).order for turn in range(4)] == [
        ("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]


def test_a_fast_answering_node_s_queue_still_counts() -> None:
    """A stream's first byte comes before its job is queued, so measured latencies are tiny: the floor applies to
    the latency, and the queue multiplies it (floored after, ten queued requests counted for nothing)."""
    scores = base_scores([candidate("idle", latency_s=0.002), candidate("busy", load=10, latency_s=0.002)])
    assert scores["idle"] == 1.0 and scores["busy"] == pytest.approx(math.sqrt(11))
