"""Seeded prompts: cold prefixes share no first token, suffixes avoid the tokens they are told to."""

from __future__ import annotations

from bench.prompts import TOKEN_HIGH, TOKEN_LOW, PromptSource


def test_prompts_are_seeded_and_in_range() -> None:
    first, again = PromptSource(3), PromptSource(3)
    assert [first.prefix(5) for _ in range(3)] == [again.prefix(5) for _ in range(3)]
    assert first.suffix(4) == again.suffix(4)
    assert all(TOKEN_LOW <= token < TOKEN_HIGH for token in PromptSource(4).prefix(1000))


def test_no_two_prefixes_start_alike_and_a_suffix_avoids_what_it_is_told() -> None:
    source = PromptSource(0)
    starts = [source.prefix(2)[0] for _ in range(2000)]
    assert len(set(starts)) == 2000
    unlike = tuple(range(TOKEN_LOW, TOKEN_HIGH - 1))  # every token but the last
    assert source.suffix(3, unlike=unlike)[0] == TOKEN_HIGH - 1
