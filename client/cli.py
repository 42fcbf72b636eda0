"""`tenzro client verify`, `tenzro client pin` and `tenzro proxy`: a caller's commands, mounted into the `tenzro`
command line by node/cli.py.

    tenzro client verify URL --trust-policy FILE [--allow-none]   one verdict; exit 0 only for OK
    tenzro client pin URL [--allow-none] [--roots DIR] [--collateral DIR] > FILE   a policy accepting exactly what
                                                                  the node presents
    tenzro proxy --node URL --trust-policy FILE [--port 8089] [--allow-none] [--reverify-s S]

Without `--allow-none` a node with `none` evidence (no TEE) is refused by every one of them, whatever the policy
says; with it, the policy must accept `none` too (`tee_types: [none]`, `allow_none: true`). The verdict names the TCB
the hardware reported, what the policy pinned and what the verifier could not check (`attestation.verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import yaml

from attestation.trust_policy import TrustPolicy, TrustPolicyError
from client.verify import NodeRefused

DEFAULT_PROXY_PORT = 8089
PIN_HEADER = """\
# A trust policy written by `tenzro client pin` from what the node at {url} presented now, verified
# (trust on first use, as ssh-keyscan): review it before you rely on it. Every value it pins must match
# again for `tenzro client verify` and `tenzro proxy` to accept the node; `any` accepts whatever is presented.
"""


def _policy(path: str) -> TrustPolicy | None:
    try:
        return TrustPolicy.load(Path(path))
    except TrustPolicyError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return None


def _verify(args: argparse.Namespace) -> int:
    from client.verify import verify_node

    policy = _policy(args.trust_policy)
    if policy is None:
        return 2
    try:
        node = asyncio.run(verify_node(args.url, policy, args.allow_none))
    except NodeRefused as exc:
        print("\n".join(exc.lines))
        return 1
    print("\n".join(node.lines()))
    return 0


def _pin(args: argparse.Namespace) -> int:
    """Verify under a policy that accepts anything the evidence can prove, then write what was presented."""
    from client.verify import verify_node

    tee_types = [*(["sev-snp", "tdx"] if args.roots else []), *(["none"] if args.allow_none else [])]
    if not tee_types:
        print("tenzro: error: give --roots DIR to verify hardware evidence (or --allow-none for a node without a "
              "TEE, development only)", file=sys.stderr)
        return 2
    open_policy = TrustPolicy.parse({
        "tee_types": tee_types, "allow_none": args.allow_none,
        "roots": args.roots, "measurements": "any", "rtmrs": "any", "min_tcb": "any", "code_digests": "any",
        "model_digests": "any", "gpu": "optional", "collateral": args.collateral, "tdx_tcb_status": "any",
        "migration_agent": "allowed"}, base=Path.cwd())
    try:
        node = asyncio.run(verify_node(args.url, open_policy, args.allow_none))
    except NodeRefused as exc:
        print("\n".join(exc.lines), file=sys.stderr)
        return 1
    pinned: dict[str, Any] = TrustPolicy.pin(node.presented, args.roots, args.collateral)
    sys.stdout.write(PIN_HEADER.format(url=args.url) + yaml.safe_dump(pinned, sort_keys=False))
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from aiohttp import web

    from client.proxy import Verifier, create_app

    policy = _policy(args.trust_policy)
    if policy is None:
        return 2
    app = create_app(Verifier(args.node, policy, args.allow_none, reverify_s=args.reverify_s))
    print(f"tenzro proxy: serving http://{args.host}:{args.port}/v1 for the node at {args.node}, verified under "
          f"{args.trust_policy} before anything is forwarded", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


def add_client_commands(groups: Any) -> None:
    """`tenzro client ...` and `tenzro proxy` on the `tenzro` parser's subcommand group."""
    client = groups.add_parser("client", help="verify a node before sending it a prompt").add_subparsers(
        dest="command", required=True)
    verify = client.add_parser("verify", help="verify a node's hardware, code, model and TLS channel under a trust "
                                              "policy; prints one verdict (exit 0 only when it is OK)")
    verify.add_argument("url", help="the node, https://HOST:PORT (it serves with --tls)")
    verify.add_argument("--trust-policy", required=True, metavar="FILE", help="trust policy (YAML)")
    verify.add_argument("--allow-none", action="store_true",
                        help="accept a node without a TEE (none evidence) where the policy does too: development only")
    verify.set_defaults(func=_verify)
    pin = client.add_parser("pin", help="write a trust policy accepting exactly what the node presents now, for a "
                                        "person to review (trust on first use)")
    pin.add_argument("url", help="the node, https://HOST:PORT")
    pin.add_argument("--roots", metavar="DIR", default=None,
                     help="the AMD and Intel roots directory the policy names (needed for hardware evidence)")
    pin.add_argument("--collateral", metavar="DIR", default=None,
                     help="the vendor collateral directory the policy names (tenzro attest fetch-collateral): "
                          "without it a TDX node's TCB status is not evaluated and none is pinned")
    pin.add_argument("--allow-none", action="store_true", help="pin a node without a TEE: development only")
    pin.set_defaults(func=_pin)
    proxy = groups.add_parser("proxy", help="an OpenAI-compatible endpoint on localhost that forwards only to a "
                                            "verified node, over the verified channel")
    proxy.add_argument("--node", required=True, metavar="URL", help="the node, https://HOST:PORT")
    proxy.add_argument("--trust-policy", required=True, metavar="FILE", help="trust policy (YAML)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT)
    proxy.add_argument("--allow-none", action="store_true",
                       help="accept a node without a TEE (none evidence) where the policy does too: development only")
    proxy.add_argument("--reverify-s", type=float, default=300.0,
                       help="verify the node again this often (default %(default)s s), and whenever its pinned "
                            "channel fails")
    proxy.set_defaults(func=_proxy)
