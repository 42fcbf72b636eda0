"""Price schedules: strict YAML loading, atomic saving, and reload while the node runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metering.pricing import (
    DEFAULT_PRICING,
    PRICE_FIELDS,
    PriceSchedule,
    PricingError,
    PricingSource,
    load_pricing,
    save_pricing,
)

VALID_YAML = """\
input_price_wei: 1000
output_price_wei: 4000
cached_read_price_wei: 100
cached_write_price_wei: 1250
"""


def test_load_reads_all_four_prices(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(VALID_YAML)
    assert load_pricing(path) == PriceSchedule(1000, 4000, 100, 1250)


def test_prices_beyond_64_bits_load_exactly(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(VALID_YAML.replace("4000", "1000000000000000000000000"))
    assert load_pricing(path).output_price_wei == 10**24


def test_save_writes_the_documented_file_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "home" / "pricing.yaml"
    save_pricing(path, DEFAULT_PRICING)
    assert path.read_text() == (
        "# Prices in integer wei: per token, and per image (image_price_wei).\n"
        "input_price_wei: 1000000000\n"
        "output_price_wei: 4000000000\n"
        "cached_read_price_wei: 100000000\n"
        "cached_write_price_wei: 1250000000\n"
        "image_price_wei: 0\n"
    )
    assert load_pricing(path) == DEFAULT_PRICING
    assert sorted(os.listdir(path.parent)) == ["pricing.yaml"]  # no temporary file left behind


def test_save_replaces_the_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    save_pricing(path, DEFAULT_PRICING)
    inode_before = path.stat().st_ino
    save_pricing(path, PriceSchedule(1, 2, 3, 4))
    assert path.stat().st_ino != inode_before  # a new file renamed over the old, not rewritten in place
    assert load_pricing(path) == PriceSchedule(1, 2, 3, 4)


def test_missing_file_is_an_error_not_a_zero_schedule(tmp_path: Path) -> None:
    with pytest.raises(
        PricingError, match=r"pricing.yaml does not exist; create it with `tenzro provider pricing set`"
    ):
        load_pricing(tmp_path / "pricing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (VALID_YAML + "discount_wei: 5\n", "unknown field\\(s\\) discount_wei; allowed: input_price_wei"),
        (VALID_YAML.replace("output_price_wei: 4000\n", ""), "missing field\\(s\\) output_price_wei"),
        (
            VALID_YAML.replace("4000", "-1"),
            "output_price_wei must be a non-negative integer \\(wei\\), got -1",
        ),
        (
            VALID_YAML.replace("4000", "4000.0"),
            "output_price_wei must be a non-negative integer \\(wei\\), got 4000.0",
        ),
        (
            VALID_YAML.replace("4000", "'4000'"),
            "output_price_wei must be a non-negative integer \\(wei\\), got '4000'",
        ),
        (
            VALID_YAML.replace("4000", "true"),
            "output_price_wei must be a non-negative integer \\(wei\\), got True",
        ),
        ("- 1\n- 2\n", "expected a mapping of the fields input_price_wei, output_price_wei"),
        ("", "expected a mapping"),
        ("input_price_wei: [\n", "is not valid YAML"),
    ],
)
def test_invalid_files_name_what_to_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(text)
    with pytest.raises(PricingError, match=message):
        load_pricing(path)


def test_schedule_rejects_negative_prices() -> None:
    with pytest.raises(PricingError, match="cached_read_price_wei must be a non-negative integer"):
        PriceSchedule(1, 1, -5, 1)


def test_price_fields_in_file_order() -> None:
    assert PRICE_FIELDS == (
        "input_price_wei",
        "output_price_wei",
        "cached_read_price_wei",
        "cached_write_price_wei",
        "cached_write_1h_price_wei",
        "cached_write_24h_price_wei",
        "image_price_wei",
    )


def test_class_write_prices_are_optional_default_to_the_write_price_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text("input_price_wei: 10\noutput_price_wei: 40\ncached_read_price_wei: 1\n"
                    "cached_write_price_wei: 12\n")
    old = load_pricing(path)
    assert (old.write_1h_price_wei, old.write_24h_price_wei) == (12, 12)
    assert "cached_write_1h_price_wei" not in old.to_mapping()
    save_pricing(path, PriceSchedule(10, 40, 1, 12, 20, 30))
    new = load_pricing(path)
    assert (new.write_1h_price_wei, new.write_24h_price_wei) == (20, 30)
    with pytest.raises(PricingError, match="cached_write_1h_price_wei must be a non-negative integer"):
        PriceSchedule(1, 1, 1, 1, -1)


def test_the_image_price_is_optional_zero_when_left_out_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(VALID_YAML)
    assert load_pricing(path).image_price_wei == 0  # a file from before image prices: images cost no more
    assert load_pricing(path).to_mapping()["image_price_wei"] == 0  # shown as 0, not left out
    path.write_text(VALID_YAML + "image_price_wei: 2500\n")
    assert load_pricing(path) == PriceSchedule(1000, 4000, 100, 1250, image_price_wei=2500)
    save_pricing(path, PriceSchedule(1, 2, 3, 4, image_price_wei=5))
    assert load_pricing(path).image_price_wei == 5
    with pytest.raises(PricingError, match="image_price_wei must be a non-negative integer"):
        PriceSchedule(1, 1, 1, 1, image_price_wei=-1)
    with pytest.raises(PricingError, match="image_price_wei must be a non-negative integer"):
        PriceSchedule(1, 1, 1, 1, image_price_wei=None)  # type: ignore[arg-type]


def test_source_picks_up_a_saved_change_without_restart(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    save_pricing(path, DEFAULT_PRICING)
    source = PricingSource(path)
    assert source.current() == DEFAULT_PRICING
    save_pricing(path, PriceSchedule(7, 8, 9, 10))
    assert source.current() == PriceSchedule(7, 8, 9, 10)
    assert source.reload_error is None


def test_source_sees_an_in_place_edit(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(VALID_YAML)
    source = PricingSource(path)
    assert source.current() == PriceSchedule(1000, 4000, 100, 1250)
    path.write_text(VALID_YAML.replace("4000", "40000"))  # same inode, size changes
    assert source.current() == PriceSchedule(1000, 40000, 100, 1250)


def test_source_does_not_reparse_an_unchanged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pricing.yaml"
    save_pricing(path, DEFAULT_PRICING)
    source = PricingSource(path)
    loads: list[Path] = []
    monkeypatch.setattr("metering.pricing.load_pricing", lambda p: loads.append(p))
    for _ in range(3):
        assert source.current() == DEFAULT_PRICING
    assert loads == []


def test_source_keeps_last_good_schedule_after_a_bad_edit(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    save_pricing(path, DEFAULT_PRICING)
    source = PricingSource(path)
    path.write_text(VALID_YAML + "typo_wei: 1\n")
    assert source.current() == DEFAULT_PRICING
    assert source.reload_error is not None and "unknown field(s) typo_wei" in source.reload_error
    path.unlink()
    assert source.current() == DEFAULT_PRICING
    assert source.reload_error is not None and "cannot be read" in source.reload_error
    save_pricing(path, PriceSchedule(1, 1, 1, 1))
    assert source.current() == PriceSchedule(1, 1, 1, 1)
    assert source.reload_error is None


def test_source_refuses_to_start_without_a_price_file(tmp_path: Path) -> None:
    with pytest.raises(PricingError, match="does not exist"):
        PricingSource(tmp_path / "pricing.yaml")
