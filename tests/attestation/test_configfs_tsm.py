"""configfs-tsm against a directory that answers writes like the kernel: the 64-byte rule, generation retries."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_tsm import FakeTsm

from attestation.configfs_tsm import TSM_ATTEMPTS, TsmFiles, TsmReport, tsm_report
from attestation.errors import EvidenceUnavailable

INBLOB = bytes(range(64))


def echo(inblob: bytes) -> tuple[bytes, bytes]:
    return b"report over " + inblob, b"certificates"


def test_a_report_is_the_answer_to_our_inblob(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "sev_guest", echo)
    report = tsm_report(INBLOB, tsm.root, tsm)
    assert report == TsmReport(provider="sev_guest", outblob=b"report over " + INBLOB, auxblob=b"certificates",
                               generation=1)
    assert report.evidence_type == "sev-snp"
    assert tsm.inblobs == [INBLOB]
    assert len(tsm.removed) == 1 and tsm.removed[0].startswith("tenzro-")
    assert list(tsm.root.iterdir()) == []  # the entry is gone


def test_tdx_has_no_auxblob(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "tdx_guest", echo)
    report = tsm_report(INBLOB, tsm.root, tsm)
    assert report is not None
    assert (report.evidence_type, report.outblob, report.auxblob) == ("tdx", b"report over " + INBLOB, b"")


@pytest.mark.parametrize("size", [0, 32, 63, 65])
def test_inblobs_other_than_64_bytes_are_refused_before_any_write(tmp_path: Path, size: int) -> None:
    tsm = FakeTsm(tmp_path / "report", "sev_guest", echo)
    with pytest.raises(ValueError) as refused:
        tsm_report(bytes(size), tsm.root, tsm)
    assert str(refused.value) == f"configfs-tsm inblob must be exactly 64 bytes, got {size}"
    assert tsm.inblobs == []


def test_the_fake_refuses_short_inblobs_like_the_kernel(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "sev_guest", echo)
    entry = tsm.root / "entry"
    tsm.make_entry(entry)
    with pytest.raises(OSError, match="Invalid argument"):
        tsm.write(entry / "inblob", bytes(63))


def test_a_generation_moved_by_another_writer_is_retried(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "sev_guest", echo, racing_writes=1)
    report = tsm_report(INBLOB, tsm.root, tsm)
    # first attempt: 0 -> write 1 -> racing write 2 (moved by two); second attempt: 2 -> 3
    assert report is not None and report.generation == 3
    assert tsm.inblobs == [INBLOB, INBLOB]


def test_a_generation_that_keeps_moving_gives_up(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "sev_guest", echo, racing_writes=TSM_ATTEMPTS)
    with pytest.raises(EvidenceUnavailable) as refused:
        tsm_report(INBLOB, tsm.root, tsm)
    assert str(refused.value).startswith(
        "configfs-tsm: generation moved by more than our one write in each of 3 attempts (0 -> 2, 2 -> 4, 4 -> 6)"
    )
    assert len(tsm.removed) == 1


def test_no_root_means_no_provider(tmp_path: Path) -> None:
    assert tsm_report(INBLOB, tmp_path / "absent") is None


def test_a_root_without_a_registered_provider_means_none(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "", echo)
    assert tsm_report(INBLOB, tsm.root, tsm) is None
    assert len(tsm.removed) == 1


def test_an_unknown_provider_is_an_error_not_none(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "arm_cca_guest", echo)
    with pytest.raises(EvidenceUnavailable, match="provider 'arm_cca_guest' is not one of sev_guest, tdx_guest"):
        tsm_report(INBLOB, tsm.root, tsm)


def test_an_empty_outblob_is_an_error(tmp_path: Path) -> None:
    tsm = FakeTsm(tmp_path / "report", "tdx_guest", lambda inblob: (b"", b""))
    with pytest.raises(EvidenceUnavailable, match="returned an empty outblob"):
        tsm_report(INBLOB, tsm.root, tsm)


def test_plain_files_that_never_get_populated_are_an_error(tmp_path: Path) -> None:
    """What the real `TsmFiles` meets on a directory that is not configfs: mkdir works, no files appear."""
    root = tmp_path / "report"
    root.mkdir()
    with pytest.raises(EvidenceUnavailable, match="configfs-tsm: cannot read .*/provider"):
        tsm_report(INBLOB, root, TsmFiles())
    assert list(root.iterdir()) == []
