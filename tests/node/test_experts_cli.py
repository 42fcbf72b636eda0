"""The `--experts-*` flags of `tenzro node serve` and `tenzro experts serve`'s arguments."""

from __future__ import annotations

import pytest

from node.cli import build_parser
from node.engine.experts import ExpertsError, ExpertsTopology
from node.experts_cli import experts_topology


def test_serve_flags_make_the_topology() -> None:
    args = build_parser().parse_args(["node", "serve", "--experts-world", "3", "--experts-master", "10.0.0.2:29500",
                                      "--experts-timeout", "5"])
    assert experts_topology(args) == ExpertsTopology(3, "10.0.0.2", 29500, answer_timeout_s=5.0,
                                                     join_timeout_s=300.0)
    assert experts_topology(build_parser().parse_args(["node", "serve"])) is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--experts-world", "3"], "needs --experts-master"),
    (["--experts-master", "127.0.0.1:1"], "needs --experts-world"),
    (["--experts-world", "1", "--experts-master", "127.0.0.1:1"], "leaves no expert holder"),
])
def test_incomplete_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ExpertsError, match=message):
        experts_topology(build_parser().parse_args(["node", "serve", *flags]))


def test_holder_arguments() -> None:
    args = build_parser().parse_args(["experts", "serve", "--model", "m", "--rank", "2", "--master", "h:1"])
    assert (args.model, args.rank, args.master, args.threads) == ("m", 2, "h:1", 1)
