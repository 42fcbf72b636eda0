"""`tenzro bench seal`'s rows and goals from given timings (the bench itself runs a node: a benchmark, not a test)."""

from __future__ import annotations

from bench.seal import GIB, CipherRow, cipher_row, format_report, goals, ttft_row


def test_what_sealing_adds_is_taken_run_by_run() -> None:
    """Each run's sealed hit minus the hot hit right after it: a slow run lifts both. The medians taken apart
    (32 - 31 = 1 ms) would hide the 2 ms the runs show."""
    times = {"miss": [900.0, 950.0, 1000.0], "sealed": [30.0, 50.0, 32.0], "hot": [28.0, 45.0, 31.0]}
    per_token = 32 * 1024
    row = ttft_row(4096, times, [4064, 4064, 4064], per_token, open_gib_s=10.0)
    assert (row.miss_ms, row.sealed_ms, row.hot_ms, row.extra_ms) == (950.0, 32.0, 31.0, 2.0)
    assert row.sealed_cached_tokens == 4064
    assert row.open_ms_at_all_cores == 4064 * per_token / (10.0 * GIB) * 1000.0  # 12.4 ms
    ciphers = [CipherRow("seal", 1.0, 1.8, 2, 1.8), CipherRow("open", 5.0, 10.0, 2, 2.0),
               CipherRow("memcpy", 5.0, 6.0, 2, 1.2)]
    assert [met for _, met in goals(ciphers, [row])] == [True, True, True]
    slow = ttft_row(4096, {**times, "sealed": [45.0, 65.0, 47.0]}, [4064] * 3, per_token, open_gib_s=10.0)
    assert slow.extra_ms == 17.0  # over 1.2 x 12.4 ms
    assert [met for _, met in goals(ciphers, [slow])] == [True, True, False]
    assert "memcpy" in format_report(ciphers, [row])  # shown beside the cipher, judged by nothing


def test_the_cipher_speedup_is_taken_run_by_run() -> None:
    """Slow spells that take a run of each kind down together: the medians apart give 1.5x (0.3 s over
    0.2 s), the runs 2x, 1.5x and 2x."""
    row = cipher_row("open", 1.0, [0.2, 0.3, 0.6], [0.1, 0.2, 0.3], cores=2)
    assert (row.one_core_gib_s, row.all_cores_gib_s) == (1.0 / 0.3, 1.0 / 0.2)
    assert row.speedup == 2.0
    assert [met for text, met in goals([row], []) if "1.7x" in text] == [True]
    assert not goals([cipher_row("open", 1.0, [0.2, 0.3], [0.2, 0.2], cores=2)], [])[0][1]


def test_opening_in_cache_is_judged_apart_from_the_memory_bound_rate() -> None:
    """Large state opens at what the memory allows (a plain copy scales as little); state in cache shows whether
    the opening uses every core."""
    ciphers = [CipherRow("open", 9.0, 11.0, 2, 1.23), CipherRow("memcpy", 14.0, 17.0, 2, 1.24),
               CipherRow("open in cache", 9.5, 18.0, 2, 1.9)]
    checks = goals(ciphers, [])
    assert [met for _, met in checks] == [False, True]
    assert "a plain copy of the same bytes 1.24x" in checks[0][0] and "(1.90x)" in checks[1][0]
    assert "open in cache" in format_report(ciphers, [])


def test_the_report_shows_the_rates_ratio_beside_the_speedup_by_run() -> None:
    """The table's ratio column agrees with its rates (issue 34: a `speedup` of 2.00 stood beside rates of
    3.33 and 5.00 GiB/s); the speedup by run, which the goals judge, has its own column."""
    row = cipher_row("open", 1.0, [0.2, 0.3, 0.6], [0.1, 0.2, 0.3], cores=2)
    assert row.rate_ratio == row.all_cores_gib_s / row.one_core_gib_s == 1.5
    assert format_report([row], []).splitlines()[:3] == [
        "                  1 core GiB/s  all cores GiB/s  cores  rate ratio  speedup by run",
        "open                      3.33             5.00      2        1.50            2.00",
        "(rate ratio: all cores' median rate over one core's; speedup by run: the median of each run's one-core "
        "time over the all-cores time right after it, what the goals judge)",
    ]
