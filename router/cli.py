"""`tenzro router serve`: the router as a command, mounted into the `tenzro` command line by node/cli.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from router.errors import RouterConfigError
from router.providers import load_router_config
from router.selection import ROUTINGS

DEFAULT_PORT = 8090


def _serve(args: argparse.Namespace) -> int:
    from router.app import create_app
    from router.edge import serve

    try:
        config = load_router_config(Path(args.providers))
    except RouterConfigError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(config, routing=args.routing)
    names = ", ".join(provider.name for provider in config.providers)
    message = (f"tenzro router: serving http://{args.host}:{args.port}/v1 for {len(config.callers)} caller(s) over "
               f"{len(config.providers)} provider(s) ({names}); routing {args.routing}")
    try:
        # A client that goes away cancels its handler (router.edge.EdgeRunner), which closes the provider's
        # connection, and the node stops that generation.
        serve(app, args.host, args.port, config.settings.header_timeout_s, started=lambda: print(message, flush=True))
    except OSError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_router_commands(groups: Any) -> None:
    """`tenzro router ...` on the `tenzro` parser's subcommand group (`argparse._SubParsersAction`)."""
    router = groups.add_parser("router", help="route callers' requests to provider nodes").add_subparsers(
        dest="command", required=True)
    serve = router.add_parser("serve", help="serve the OpenAI-compatible API in front of the providers in a file")
    serve.add_argument("--providers", required=True, metavar="FILE",
                       help="providers file (YAML): the nodes, the router's key at each, its callers")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--routing", choices=ROUTINGS, default="warm",
                       help="warm: price, load and latency with a bounded bias to the node holding the request's "
                            "prefix (the default); least-loaded: price, load and latency alone; round-robin")
    serve.set_defaults(func=_serve)
