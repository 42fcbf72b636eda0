"""The `tenzro` command line: serve a node, manage API keys, generate models, run benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from attestation.cli import add_verify_parser
from attestation.fetch import add_fetch_parser
from bench.agent import add_agent_bench
from bench.experts import add_experts_bench
from bench.hostile import add_hostile_bench
from bench.load import add_load_bench
from bench.media import add_media_bench
from bench.reuse import add_reuse_bench
from bench.route import add_route_bench
from bench.scenarios import add_scenarios_bench
from bench.seal import add_seal_bench
from client.cli import add_client_commands
from metering.ledger import LedgerError
from metering.pricing import PricingError, load_pricing
from node.audit_timing import add_audit_commands
from node.cli_metering import add_metering_commands, default_pricing_path
from node.config import (
    RETENTIONS,
    ROLES,
    ConfigError,
    add_key,
    default_config_path,
    default_ledger_dir,
    load_config,
    remove_key,
    tenzro_home,
)
from node.experts_cli import add_experts_commands, add_experts_serve_flags, experts_topology
from node.log_privacy import install_privacy_filter
from router.cli import add_router_commands

if TYPE_CHECKING:
    from node.code_identity import PendingIdentity
    from node.config import NodeConfig
    from node.hygiene import HygieneState
    from node.identity import NodeIdentity
    from node.meter import Meter, MeteringPaths
    from node.service import ModelService
    from node.tls import NodeCertificate, NodeTls
    from policies.node_policy import NodePolicy


ARCHITECTURE_CLASSES = ("dense", "swa", "alternating", "ssm", "hybrid", "moe", "hybrid-moe")
MODEL_FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "mixtral", "olmoe", "qwen2-moe", "mamba", "mamba2",
                  "jamba", "bamba", "falcon-h1", "granite-moe-hybrid", "lfm2", "qwen3-next")
VISION_LANGUAGE_FAMILIES = ("vlm-llava", "vlm-qwen2", "vlm-gemma3")
AUDIO_LANGUAGE_FAMILIES = ("alm-audioflamingo3",)
MEDIA_FAMILIES = ("diffusion",)
"""What `tenzro models init --arch` builds (node.engine.synthetic's CLASSES and FAMILIES, synthetic_vlm's
VISION_LANGUAGE and synthetic_alm's AUDIO_LANGUAGE, which tests hold equal): named here because importing those
modules loads torch and transformers, seconds `--help` should not take."""


def default_threads() -> int:
    """Leave a core to the rest of a shared machine: oversubscribed OpenMP is many times slower."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1)


def _how_to_call(host: str, port: int, model: str, key: str | None, tls: NodeCertificate | None) -> str:
    base = f"{'https' if tls else 'http'}://{host}:{port}/v1"
    pin = f"--insecure --pinnedpubkey {tls.curl_pin} " if tls else ""
    key_line = (f"A new API key for caller 'local' (shown once; only its hash is stored):\n"
                f"  export TENZRO_API_KEY={key}\n" if key else
                "Use a key from 'tenzro keys add NAME' as TENZRO_API_KEY.\n")
    return (f"tenzro node: serving model '{model}' at {base}\n{key_line}"
            f"Try:\n  curl -s {pin}{base}/chat/completions -H \"Authorization: Bearer $TENZRO_API_KEY\" "
            f"-H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
            f"\"max_tokens\": 16}}'\n")


def _metering_lines(meter: Meter, paths: MeteringPaths, created_prices: bool) -> str:
    from node.meter import DEFAULT_PRICE_POLICY

    created = f" (new: the defaults from {DEFAULT_PRICE_POLICY})" if created_prices else ""
    return (f"Metering: records signed by node key {meter.signer.public_key_hex} (GET /v1/node)\n"
            f"  ledger segment {meter.ledger.path}\n"
            f"  prices from {paths.pricing_file}{created}; change them with 'tenzro provider pricing set'\n")


def _tls_lines(tls: NodeCertificate | None) -> str:
    if tls is None:
        return "TLS: off, plain HTTP (for local development; --tls serves HTTPS)\n"
    return (f"TLS: this boot's self-signed certificate (ECDSA P-256, TLS 1.3, valid until "
            f"{tls.not_after:%Y-%m-%d %H:%M} UTC), SPKI SHA-256 {tls.spki_sha256_hex}\n"
            f"  pin it: curl --pinnedpubkey {tls.curl_pin} (with --insecure: nothing else vouches for it), or trust "
            f"exactly GET /v1/node's tls.certificate_pem once its tls.spki_sha256 is this hash\n")


def _attestation_line(identity: NodeIdentity) -> str:
    evidence = identity.evidence
    trust = "a TEE's report" if evidence.trusted else "untrusted: no TEE found"
    return (f"Attestation: {evidence.evidence_type} evidence ({trust}) binds the node key; digest "
            f"{identity.evidence_digest} (GET /v1/attestation?nonce=HEX for fresh evidence)\n")


def _served_lines(identity: NodeIdentity, waited_s: float) -> str:
    served = identity.served
    assert served is not None  # hashed before the app was made
    code = served.code
    models = "".join(f"  model {model.model_id}: {model.digest} ({len(model.files)} files)\n"
                     for model in served.models)
    return (f"Code and models (GET /v1/node, ledger segment header): code {code.digest} ({code.source}: "
            f"{len(code.files)} files, {code.python})\n{models}"
            f"  hashed in {served.code_s + served.model_s:.2f} s beside the model load, which then waited "
            f"{waited_s:.2f} s for it\n")


def _serve(args: argparse.Namespace) -> int:
    # First, so that the memory lock covers everything loaded after it.
    from attestation.errors import EvidenceUnavailable, MalformedEvidence
    from node.hygiene import HygienePolicy, apply_hygiene, without_freed_memory_caches
    from node.identity import NodeIdentity
    from node.tls import NodeTls, TlsError
    from policies.node_policy import NodePolicyError, hardware_unmet, load_node_policy, tls_unmet, with_jurisdiction

    environment = without_freed_memory_caches()
    if environment is not None:  # once: glibc's tunables and the interpreter's allocator are read at start
        os.execve(sys.executable, [sys.executable, "-m", "node", *_ARGV], environment)

    hygiene = apply_hygiene()
    try:
        policy = load_node_policy(args.policy)
        if args.jurisdiction:
            policy = with_jurisdiction(policy, args.jurisdiction)
        tls = policy.require.tls if args.tls is None else args.tls
        # The channel's key, made in memory and never written, before the evidence (which is to bind it).
        node_tls = NodeTls.start(args.host) if tls else None
        # The key first, then the evidence binding it: a TEE interface that fails stops the start here.
        identity = NodeIdentity.start()
    except (NodePolicyError, EvidenceUnavailable, TlsError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    evidence = identity.evidence
    missing = HygienePolicy(policy).missing(hygiene, sealing=args.no_reuse or not args.no_seal) + [
        unmet.message for unmet in (*hardware_unmet(policy, evidence.evidence_type, evidence.trusted),
                                    *tls_unmet(policy, tls))]
    if missing:
        print(f"tenzro: error: the node policy '{policy.name}' is not met:\n"
              + "\n".join(f"  - {line}" for line in missing), file=sys.stderr)
        return 2

    import torch

    from cache.lanes import FRESH_BUFFER_HOOKS
    from node.hygiene import exclude_from_dumps

    if hygiene.dump_exclusion:
        FRESH_BUFFER_HOOKS.append(exclude_from_dumps)  # the working buffers hold plaintext state

    from cache.arena import new_prefix_cache
    from cache.snapshot_policy import PolicyError, SnapshotPolicy
    from node.api.app import create_app
    from node.api.keys import METER
    from node.code_identity import IdentityError, start_hashing
    from node.engine.experts import ExpertsError
    from node.engine.loader import ModelLoadError, load_model, resolve_model_dir
    from node.media.model_dir import is_diffusers_dir
    from node.meter import MeteringPaths, ensure_price_file
    from node.service import ModelService
    from router.edge import serve

    torch.set_num_threads(args.threads)
    config_path = Path(args.config) if args.config else default_config_path()
    metering = MeteringPaths(ledger_dir=Path(args.ledger) if args.ledger else default_ledger_dir(),
                             pricing_file=Path(args.pricing) if args.pricing else default_pricing_path())
    try:
        created_prices = ensure_price_file(metering.pricing_file)
        load_pricing(metering.pricing_file)  # a bad price file fails now, before the model loads
        config = load_config(config_path)
        new_key = None
        if not config.callers:
            new_key = add_key(config_path, "local")
            config = load_config(config_path)
        model_id, path = resolve_model_dir(args.model, tenzro_home())
        # The code and the weights hash on threads of their own while the model loads (node.code_identity).
        hashing = start_hashing({model_id: path})
        if is_diffusers_dir(path):
            return _serve_media(args, config, config_path, metering, model_id, path, created_prices, new_key,
                                policy, hygiene, identity, node_tls, hashing)
        loaded = load_model(model_id, path, device=args.device, dtype=args.dtype, experts=experts_topology(args))
        # The boot's evidence again, now binding the TLS key, the code and the model (binding v2).
        identity = identity.with_served(hashing.result(), node_tls.certificate.spki_sha256 if node_tls else None)
    except (ConfigError, ModelLoadError, PricingError, OSError, IdentityError, EvidenceUnavailable,
            MalformedEvidence, ExpertsError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    try:
        reuse_policy = SnapshotPolicy.named(args.reuse_policy, args.snapshot_interval)
    except PolicyError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    budget = dataclasses.replace(config.cache, eviction=args.eviction) if args.eviction else config.cache
    prefix_cache = None if args.no_reuse else new_prefix_cache(budget, sealed=not args.no_seal,
                                                               plaintext_bytes=config.plaintext_bytes,
                                                               reserve_bytes=config.reserve_bytes,
                                                               compute_threads=args.threads)
    service = ModelService.create(loaded, prefix_cache, config.limits, reuse_policy, config.device_bytes)
    certificate = node_tls.certificate if node_tls else None
    app = create_app(config, config_path, service, metering, identity, policy,
                     hygiene={**hygiene.as_json(), "policy": policy.name}, tls=certificate)
    # The model, tokenizer and app are loaded for good: out of the collector's reach, a full collection
    # (which a request building many objects, e.g. 20,000 messages, sets off) no longer walks them all
    # while holding the interpreter lock, stalling /health (RESULTS.md, 2026-11-30).
    gc.collect()
    gc.freeze()
    forward = loaded.forward
    message = (_how_to_call(args.host, args.port, model_id, new_key, certificate) + _tls_lines(certificate)
               + f"Forward: {forward.backend} ({forward.reason}); TENZRO_NATIVE=off selects the library backend\n"
               + _lanes_line(service, config.limits.max_running) + _reserve_line(service) + _device_line(service))
    try:
        # A client that goes away cancels its handler, which stops its generation (router.edge.EdgeRunner).
        serve(app, args.host, args.port, config.limits.header_timeout_s, started=lambda: print(
            message + _metering_lines(app[METER], metering, created_prices) + _attestation_line(identity)
            + _served_lines(identity, hashing.waited_s),
            flush=True), ssl_context=node_tls.context if node_tls else None)
    except (LedgerError, PricingError, OSError) as exc:  # the meter's files, or the port, at startup
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve_media(args: argparse.Namespace, config: NodeConfig, config_path: Path, metering: MeteringPaths,
                 model_id: str, path: Path, created_prices: bool, new_key: str | None, policy: NodePolicy,
                 hygiene: HygieneState, identity: NodeIdentity, node_tls: NodeTls | None,
                 hashing: PendingIdentity) -> int:
    """`node serve` of a diffusers directory: an image node (`node.media`), with the same keys, identity, metering
    and TLS as a text node."""
    from node.api.keys import METER
    from node.media.api import create_media_app
    from node.media.pipeline import PipelineLoadError
    from node.media.service import MediaService
    from router.edge import serve

    try:
        media = MediaService.create(model_id, path, config.limits, reuse=not args.no_reuse, sealed=not args.no_seal,
                                    device=args.device, dtype=args.dtype)
        identity = identity.with_served(hashing.result(), node_tls.certificate.spki_sha256 if node_tls else None)
    except (PipelineLoadError, OSError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    certificate = node_tls.certificate if node_tls else None
    app = create_media_app(config, config_path, media, metering, identity, policy,
                           hygiene={**hygiene.as_json(), "policy": policy.name}, tls=certificate)
    base = f"{'https' if certificate else 'http'}://{args.host}:{args.port}/v1"
    key_line = (f"A new API key for caller 'local' (shown once; only its hash is stored):\n"
                f"  export TENZRO_API_KEY={new_key}\n" if new_key else "")
    message = (f"tenzro node: serving model '{model_id}' at {base}, an image model (POST /v1/images/generations, "
               f"/v1/images/edits; sizes {', '.join(media.pipeline.sizes)}; encodings "
               f"{'reused per caller' if media.reuse_enabled else 'not kept (--no-reuse)'})\n{key_line}"
               + _tls_lines(certificate))
    try:
        serve(app, args.host, args.port, config.limits.header_timeout_s, started=lambda: print(
            message + _metering_lines(app[METER], metering, created_prices) + _attestation_line(identity)
            + _served_lines(identity, hashing.waited_s),
            flush=True), ssl_context=node_tls.context if node_tls else None)
    except (LedgerError, PricingError, OSError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _reserve_line(service: ModelService) -> str:
    sealing = service.sealing_state()
    if not sealing["on"]:
        return ""
    return f"Sealed state: {sealing['reserve_bytes'] / 2**20:.0f} MiB of memory reserved (cache.reserve_bytes)\n"


def _device_line(service: ModelService) -> str:
    plan = service.device
    if plan.copy_mode == "none":
        return ""
    return (f"Device: {plan.device_type}, {plan.hot_bytes / 2**20:.0f} MiB of stored state kept in device memory "
            f"(cache.device_bytes); host copies {plan.copy_mode}: {plan.reason}\n")


def _lanes_line(service: ModelService, lanes: int) -> str:
    rows, owner = service.runner.reuse.lane_rows, service.runner.reuse.lanes
    if not rows or owner is None:
        return "Working memory: lanes are allocated when first used (limits.lane_bytes)\n"
    held = lanes * rows * owner.row_bytes(0)
    return f"Working memory: {lanes} lanes of {rows} token rows reserved, {held / 2**20:.0f} MiB (limits.lane_bytes)\n"


def _keys_add(args: argparse.Namespace) -> int:
    path = Path(args.config) if args.config else default_config_path()
    try:
        key = add_key(path, args.name, args.role, args.retention, args.ttl_s)
    except ConfigError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    print(f"API key for {args.role} '{args.name}' (shown once; {path} stores only its hash):")
    print(key)
    return 0


def _keys_remove(args: argparse.Namespace) -> int:
    path = Path(args.config) if args.config else default_config_path()
    try:
        remove_key(path, args.name)
    except ConfigError as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    print(f"removed caller '{args.name}' from {path}; a running node destroys its stored state and keys "
          "within a second")
    return 0


def _models_init(args: argparse.Namespace) -> int:
    from node.engine.synthetic import UnknownArchitectureError, init_model

    try:
        init_model(args.arch, Path(args.dir), args.size)
    except (UnknownArchitectureError, FileExistsError) as exc:
        print(f"tenzro: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a {args.size} '{args.arch}' model to {args.dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tenzro", description=__doc__)
    groups = parser.add_subparsers(dest="group", required=True)

    node = groups.add_parser("node", help="run the provider node").add_subparsers(dest="command", required=True)
    serve = node.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    serve.add_argument("--model", default="default", help="'default' (the embedded model) or a local model dir")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--config", help="node config YAML (default: $TENZRO_HOME/node.yaml)")
    serve.add_argument("--ledger", help="directory of usage ledger segments (default: $TENZRO_HOME/ledger)")
    serve.add_argument("--pricing", help="price file, re-read when it changes (default: "
                       "$TENZRO_HOME/pricing.yaml, created from policies/pricing.yaml when missing)")
    serve.add_argument("--no-reuse", action="store_true", help="compute every prompt from scratch")
    serve.add_argument("--no-seal", action="store_true",
                       help="keep stored state in plaintext between requests (for measurements; a policy that "
                            "requires sealing refuses it)")
    serve.add_argument("--reuse-policy", default="ours", choices=["ours", "interval", "exact"],
                       help="where snapshots are taken: message boundaries, branch points and ends (ours), "
                            "a fixed interval only, or the ends of stored sequences only (exact extension)")
    serve.add_argument("--snapshot-interval", type=int, default=128,
                       help="the resume grid's spacing near a prompt's start, inside long messages and prompts "
                            "without structure; past 4 intervals it widens to a quarter of the position "
                            "(default %(default)s; 0: no grid)")
    serve.add_argument("--eviction", choices=["value", "lru"],
                       help="under a tight budget, evict by compute saved per byte and recency (value, the "
                            "default) or by recency alone (lru)")
    serve.add_argument("--threads", type=int, default=default_threads(),
                       help="torch CPU threads (default: one less than the cores this process may use, "
                            "%(default)s here)")
    serve.add_argument("--policy", default="standard",
                       help="node policy: confidential, standard (the default) or a policy YAML file: the node's "
                            "jurisdiction and trust tier, and what it refuses to start without (locked memory, no "
                            "swap, sealing, confidential hardware)")
    serve.add_argument("--tls", action=argparse.BooleanOptionalAction,
                       help="serve HTTPS (TLS 1.3) with a key made at start in memory, never written, and a "
                            "self-signed certificate for this boot, which clients pin (default: on when the policy "
                            "requires tls, as confidential does; --no-tls: plain HTTP, for local development, "
                            "refused by such a policy)")
    serve.add_argument("--jurisdiction", metavar="CC",
                       help="the ISO 3166-1 alpha-2 country the node runs in, over the policy's `jurisdiction`")
    serve.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="weights dtype (default: float32 on CPU, bfloat16 on CUDA)")
    add_experts_serve_flags(serve)
    serve.set_defaults(func=_serve)

    keys = groups.add_parser("keys", help="API keys").add_subparsers(dest="command", required=True)
    add = keys.add_parser("add", help="create a caller key; prints it once, stores only its hash")
    add.add_argument("name")
    add.add_argument("--config", help="node config YAML (default: $TENZRO_HOME/node.yaml)")
    add.add_argument("--role", default="caller", choices=list(ROLES))
    add.add_argument("--retention", choices=list(RETENTIONS),
                     help="keep (default): the caller's state is kept for its reuse, sealed between requests; "
                          "none: nothing is kept after a reply")
    add.add_argument("--ttl", type=int, dest="ttl_s", help="seconds the caller's state lives unused before it is "
                     "destroyed (default: until evicted)")
    add.set_defaults(func=_keys_add)
    remove = keys.add_parser("remove", help="remove a caller: its key stops working and a running node destroys "
                             "its stored state and keys")
    remove.add_argument("name")
    remove.add_argument("--config", help="node config YAML (default: $TENZRO_HOME/node.yaml)")
    remove.set_defaults(func=_keys_remove)

    models = groups.add_parser("models", help="models").add_subparsers(dest="command", required=True)
    init = models.add_parser("init", help="write a deterministic randomly initialised model directory")
    init.add_argument("--arch", default="dense", choices=[*ARCHITECTURE_CLASSES, *MODEL_FAMILIES,
                                                          *VISION_LANGUAGE_FAMILIES, *AUDIO_LANGUAGE_FAMILIES,
                                                          *MEDIA_FAMILIES], metavar="ARCH",
                      help=f"an architecture class: {', '.join(ARCHITECTURE_CLASSES)} (default: dense); or a model "
                           f"family: {', '.join(MODEL_FAMILIES)}; or a vision-language model with its processor: "
                           f"{', '.join(VISION_LANGUAGE_FAMILIES)} (sizes default and small); or an audio-language "
                           f"model with its processor: {', '.join(AUDIO_LANGUAGE_FAMILIES)} (sizes default and small); "
                           "or an image "
                           f"pipeline (diffusers, 64x64): {', '.join(MEDIA_FAMILIES)}")
    init.add_argument("--size", default="default", choices=["default", "small", "1b"])
    init.add_argument("dir")
    init.set_defaults(func=_models_init)

    add_metering_commands(groups)
    add_experts_commands(groups)

    bench = groups.add_parser("bench", help="benchmarks").add_subparsers(dest="command", required=True)
    add_reuse_bench(bench)
    add_seal_bench(bench)
    add_experts_bench(bench)
    add_agent_bench(bench)
    add_scenarios_bench(bench)
    add_route_bench(bench)
    add_load_bench(bench)
    add_hostile_bench(bench)
    add_media_bench(bench)
    add_audit_commands(groups)
    add_router_commands(groups)
    add_client_commands(groups)
    attest = groups.add_parser("attest", help="attestation evidence").add_subparsers(dest="command", required=True)
    add_verify_parser(attest)
    add_fetch_parser(attest)
    return parser


_ARGV: list[str] = []


def main(argv: list[str] | None = None) -> None:
    _ARGV[:] = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_privacy_filter()
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
