"""`tenzro attest verify EVIDENCE [--trust-root DIR] [--collateral DIR] [--trust-policy FILE]`: check an evidence
document offline (and `tenzro attest fetch-collateral`, from `attestation.fetch`, mounted beside it).

`none` evidence has no hardware report and so no chain to a root: with `--allow-none` it needs no
`--trust-root`; SEV-SNP and TDX evidence without one fail naming the root file they need.

With `--trust-policy` (the caller's policy `tenzro client verify` takes) the evidence is verified as without it,
against the policy's roots when `--trust-root` is not given, and then what it proves (measurement, code and model
digests, TCB, guest policy, GPU part) is judged by the policy. `--allow-none` is still needed for `none` evidence: a
policy allowing it does not stand in for the flag, so without the flag `none` evidence is refused whatever file is
named. `--collateral DIR` (else the policy's `collateral`) is the vendor collateral the verifier judges TCB status and
revocation by; without it the last line says what was not checked.

The last line never says "trusted" alone: it names the TCB the hardware reported, whether the workload was pinned
(by `--expect-measurement` or the policy) and what was not checked, as a policy verdict does (`attestation.verdict`).

Prints one line per check that passed and exits 0; on the first failure prints the reason code and
what was found to stderr and exits 1 (2 for a usage error, a malformed policy included). `node/cli.py` mounts the
parser under `attest`; `python -m attestation.cli verify ...` runs the same command without the node installed.
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
from attestation.fetch import add_fetch_parser
from attestation.trust_policy import TrustPolicy, TrustPolicyError, Verdict, presented_by
from attestation.verdict import description
from attestation.verify import VerificationResult, verify_evidence

EXIT_VERIFIED = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2

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
    verify.add_argument("--collateral", metavar="DIR", type=Path,
                        help="vendor collateral (tenzro attest fetch-collateral --out DIR): Intel TCB info and QE "
                             "identity, AMD and Intel CRLs, NVIDIA RIMs and OCSP; the policy's collateral serves "
                             "without it")
    verify.add_argument("--expect-measurement", metavar="HEX", type=_hex_bytes(MEASUREMENT_BYTES),
                        help="required launch measurement (SNP MEASUREMENT or TDX MRTD), 96 hex characters")
    verify.add_argument("--nonce", metavar="HEX", type=_hex_bytes(NONCE_BYTES),
                        help="the nonce you issued, 64 hex characters; without it freshness is not checked")
    verify.add_argument("--allow-none", action="store_true",
                        help="accept evidence of type none (a node without a TEE) as untrusted")
    verify.add_argument("--trust-policy", metavar="FILE", type=Path,
                        help="trust policy (YAML, as `tenzro client verify` takes): the measurement, code and model "
                             "digests the evidence proves must be ones it accepts; its roots serve without "
                             "--trust-root; none evidence still needs --allow-none")
    verify.set_defaults(func=run_verify)
    return verify


def run_verify(args: argparse.Namespace) -> int:
    """The handler: returns the exit code."""
    try:
        policy = None if args.trust_policy is None else TrustPolicy.load(args.trust_policy)
    except TrustPolicyError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    roots = args.trust_root or (policy.roots if policy is not None else None)
    collateral = args.collateral or (policy.collateral if policy is not None else None)
    try:
        document = _read_document(args.evidence)
        result = verify_evidence(
            document,
            roots or NO_TRUST_ROOTS,
            expected_nonce=args.nonce,
            expected_measurement=args.expect_measurement,
            allow_none=args.allow_none,
            on_check=_print_check,
            collateral=collateral,
        )
    except VerificationError as exc:
        print(f"FAILED {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    pinned = ["measurements"] if args.expect_measurement is not None else []
    if policy is not None:
        if args.expect_measurement is not None:
            policy = policy.expecting(args.expect_measurement.hex())
        verdict = judge(policy, result)
        print("\n".join(policy_lines(verdict)), file=sys.stdout if verdict.ok else sys.stderr)
        if not verdict.ok:
            return EXIT_REFUSED
        pinned = [key for key, _ in verdict.pinned]
    print(f"verified: {result.evidence_type} evidence, {description(presented_by(result), pinned)}; "
          f"key {result.public_key_hex}, boot {result.boot_id}, digest {result.digest}")
    return EXIT_VERIFIED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tenzro attest", description="Check attestation evidence offline.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_verify_parser(commands)
    add_fetch_parser(commands)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def judge(policy: TrustPolicy, result: VerificationResult) -> Verdict:
    """The policy's verdict on what verified evidence proves: `attest verify` and `metering verify` judge through
    this one call, as `client verify` and the router do through `client.verify.verify_node`."""
    return policy.judge(presented_by(result))


def policy_lines(verdict: Verdict) -> list[str]:
    """The verdict's lines as `attest verify` and `metering verify` print them, the first saying it is the trust
    policy's among the verifier's own."""
    head, *rest = verdict.lines()
    return [f"trust policy: {head}", *rest]


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
