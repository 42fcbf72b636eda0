"""`tenzro attest verify EVIDENCE [--trust-root DIR]`: check an evidence document offline.

`none` evidence has no hardware report and so no chain to a root: with `--allow-none` it needs no
`--trust-root`; SEV-SNP and TDX evidence without one fail naming the root file they need.

Prints one line per check that passed and exits 0; on the first failure prints the reason code and
what was found to stderr and exits 1 (2 for a usage error). `node/cli.py` mounts the parser under
`attest`; `python -m attestation.cli verify ...` runs the same command without the node installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attestation.binding import NONCE_BYTES
from attestation.chain import TrustRoots
from attestation.checks import MEASUREMENT_BYTES, Check
from attestation.errors import VerificationError
from attestation.verify import verify_evidence

EXIT_VERIFIED = 0
EXIT_REFUSED = 1

NO_TRUST_ROOTS = TrustRoots(Path("<no --trust-root given>"), (), (), ())
"""The roots when none were given: enough for `none` evidence, which chains to nothing; hardware evidence
then fails with `missing-trust-root`, naming the file it needed."""


def add_verify_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add `verify` to a CLI's subcommands; the parser sets `func` to `run_verify`."""
    verify = subparsers.add_parser("verify", help="verify an attestation evidence document offline")
    verify.add_argument("evidence", metavar="EVIDENCE", type=Path, help="evidence document (JSON file)")
    verify.add_argument("--trust-root", metavar="DIR", type=Path,
                        help="directory of trust roots: ark.pem, ask.pem (optional), intel_root.pem; needed for "
                             "SEV-SNP and TDX evidence, not for none evidence with --allow-none")
    verify.add_argument("--expect-measurement", metavar="HEX", type=_hex_bytes(MEASUREMENT_BYTES),
                        help="required launch measurement (SNP MEASUREMENT or TDX MRTD), 96 hex characters")
    verify.add_argument("--nonce", metavar="HEX", type=_hex_bytes(NONCE_BYTES),
                        help="the nonce you issued, 64 hex characters; without it freshness is not checked")
    verify.add_argument("--allow-none", action="store_true",
                        help="accept evidence of type none (a node without a TEE) as untrusted")
    verify.set_defaults(func=run_verify)
    return verify


def run_verify(args: argparse.Namespace) -> int:
    """The handler: returns the exit code."""
    try:
        document = _read_document(args.evidence)
        result = verify_evidence(
            document,
            args.trust_root or NO_TRUST_ROOTS,
            expected_nonce=args.nonce,
            expected_measurement=args.expect_measurement,
            allow_none=args.allow_none,
            on_check=_print_check,
        )
    except VerificationError as exc:
        print(f"FAILED {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    trust = "trusted" if result.trusted else "UNTRUSTED"
    print(f"verified: {result.evidence_type} evidence, {trust}, key {result.public_key_hex}, "
          f"boot {result.boot_id}, digest {result.digest}")
    return EXIT_VERIFIED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tenzro attest", description="Check attestation evidence offline.")
    add_verify_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def _read_document(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise VerificationError("malformed-document", f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise VerificationError("malformed-document", f"{path} is not JSON: {exc}") from exc


def _print_check(check: Check) -> None:
    print(f"ok {check}", flush=True)


def _hex_bytes(size: int) -> Callable[[str], bytes]:
    def parse(text: str) -> bytes:
        try:
            value = bytes.fromhex(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not hex") from exc
        if len(value) != size:
            raise argparse.ArgumentTypeError(f"expected {2 * size} hex characters ({size} bytes), got {len(text)}")
        return value

    return parse


if __name__ == "__main__":
    sys.exit(main())
