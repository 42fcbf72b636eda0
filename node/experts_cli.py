"""`tenzro experts serve` (an expert holder) and the `--experts-*` flags of `tenzro node serve` (rank 0)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node.engine.experts import ExpertsTopology


def add_experts_serve_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--experts-world", type=int, metavar="N",
                       help="split the routed experts of a mixture-of-experts model over N-1 expert holders "
                            "(`tenzro experts serve`); this node is rank 0 and waits for them")
    serve.add_argument("--experts-master", metavar="ADDR:PORT",
                       help="where this node listens for its expert holders (with --experts-world)")
    serve.add_argument("--experts-timeout", type=float, default=30.0, metavar="S",
                       help="seconds a holder may take to answer before the request fails with 503")
    serve.add_argument("--experts-join-timeout", type=float, default=300.0, metavar="S",
                       help="seconds the start waits for every expert holder before it refuses to serve")


def experts_topology(args: argparse.Namespace) -> ExpertsTopology | None:
    """The split `tenzro node serve` was asked for; None without `--experts-world`. Raises `ExpertsError`."""
    from node.engine.experts import ExpertsError, ExpertsTopology

    if args.experts_world is None:
        if args.experts_master is not None:
            raise ExpertsError("--experts-master needs --experts-world")
        return None
    if args.experts_master is None:
        raise ExpertsError("--experts-world needs --experts-master ADDR:PORT")
    return ExpertsTopology.parse(args.experts_world, args.experts_master, answer_timeout_s=args.experts_timeout,
                                 join_timeout_s=args.experts_join_timeout)


def _serve_holder(args: argparse.Namespace) -> int:
    from node.config import tenzro_home
    from node.engine.expert_holder import serve_holder
    from node.engine.experts import ExpertsError
    from node.engine.loader import resolve_model_dir

    host, sep, port = args.master.rpartition(":")
    if not sep or not port.isdigit():
        print(f"tenzro: error: --master {args.master!r} is not ADDR:PORT", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    _, path = resolve_model_dir(args.model, tenzro_home())
    try:
        return serve_holder(Path(path), args.rank, host, int(port))
    except (ExpertsError, OSError, RuntimeError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2


def add_experts_commands(groups: Any) -> None:
    experts = groups.add_parser("experts", help="expert holders of a split mixture-of-experts model"
                                ).add_subparsers(dest="command", required=True)
    serve = experts.add_parser("serve", help="hold and compute one rank's routed experts for a node started "
                               "with --experts-world")
    serve.add_argument("--model", required=True, help="the model directory rank 0 serves")
    serve.add_argument("--rank", type=int, required=True, help="this holder's rank, 1 to N-1")
    serve.add_argument("--master", required=True, metavar="ADDR:PORT", help="rank 0's --experts-master")
    serve.add_argument("--threads", type=int, default=1,
                       help="torch threads of the experts' GEMMs; a count other than rank 0's --threads may round "
                            "differently from the single-process node")
    serve.set_defaults(func=_serve_holder)
