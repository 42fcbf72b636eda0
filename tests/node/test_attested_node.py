"""A node on this machine (no TEE) end to end: `none` evidence bound to its key, callers' requirements refused
before any compute, JSON-RPC beside the HTTP routes, and a ledger whose keys verify against the evidence."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from attestation.binding import report_data_for
from attestation.evidence import Evidence, evidence_digest
from metering.ledger import Ledger
from metering.signer import NodeSigner
from node.identity import boot_nonce
from tests.node.conftest import Node, stop_node, tenzro

PROMPT = list(range(300, 340))
NONCE = bytes(range(32))


def get(node: Node, path: str) -> Any:
    with urllib.request.urlopen(node.url + path, timeout=10) as response:
        return json.load(response)


def rpc(node: Node, body: Any, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(node.url + "/rpc", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        raw = response.read()
        return response.status, json.loads(raw) if raw else None


def require(node: Node, caller: str, requirements: dict[str, Any]) -> None:
    config = yaml.safe_load(node.config.read_text())
    config["callers"][caller]["requirements"] = requirements
    node.config.write_text(yaml.safe_dump(config))


def complete(client: openai.OpenAI, model: str, headers: dict[str, str] | None = None) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_headers=headers)


def test_a_node_without_a_tee_attests_none_and_refuses_what_its_callers_require(node_factory,
                                                                                small_model_dir: Path) -> None:
    node = node_factory(small_model_dir, "--jurisdiction", "DE")
    model = small_model_dir.name
    about = get(node, "/v1/node")
    assert about["evidence"]["type"] == "none" and about["evidence"]["trusted"] is False
    assert about["policy"]["jurisdiction"] == "DE"
    boot = Evidence.from_document(get(node, "/v1/attestation"))
    assert boot.public_key.hex() == about["public_key"] and boot.boot_id == about["boot_id"]
    assert boot.nonce == boot_nonce(about["boot_id"]) and boot.digest() == about["evidence"]["digest"]
    fresh = get(node, f"/v1/attestation?nonce={NONCE.hex()}")
    assert fresh["nonce"] == NONCE.hex() and fresh["type"] == "none" and fresh["report"] is None
    assert len(report_data_for(boot.public_key, NONCE)) == 64

    alice, bob = node.add_key("alice"), node.add_key("bob")
    client = openai.OpenAI(base_url=node.base, api_key=alice, max_retries=0)
    served = complete(client, model, {"Tenzro-Jurisdictions": "DE,FR"})
    assert served.usage.prompt_tokens == len(PROMPT)
    refusals = [
        ({"Tenzro-Require-Confidential": "true"}, "confidential_hardware"),
        ({"Tenzro-Jurisdictions": "FR,NL"}, "jurisdiction"),
        ({"Tenzro-Max-Price-Wei": "output=1"}, "max_price_wei.output"),
    ]
    for headers, requirement in refusals:
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client, model, headers)
        assert refused.value.status_code == 412
        assert refused.value.body["param"] == requirement and refused.value.body["code"] == "requirement_not_met"
    with pytest.raises(openai.BadRequestError) as malformed:
        complete(client, model, {"Tenzro-Jurisdictions": "de"})
    assert malformed.value.body["param"] == "Tenzro-Jurisdictions"

    require(node, "bob", {"max_price_wei": {"input": 10}})  # the node's input price is 10^9 wei
    bobs = openai.OpenAI(base_url=node.base, api_key=bob, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        complete(bobs, model)
    assert refused.value.status_code == 412 and refused.value.body["param"] == "max_price_wei.input"
    metrics = get_text(node, "/metrics", node.add_key("ops", role="operator"))
    assert 'tenzro_requests_total{endpoint="/v1/completions",status="412"} 4.0' in metrics
    assert 'tenzro_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics  # nothing computed

    # JSON-RPC: the same record under the same access rule, evidence, and errors for bad calls.
    status, answer = rpc(node, {"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": {"id": served.id},
                                "id": 1}, alice)
    assert status == 200 and answer["id"] == 1 and answer["result"]["record_id"] == served.id
    assert rpc(node, {"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": [served.id], "id": 2},
               bob)[1]["error"]["code"] == -32004  # another caller's id answers as an unknown one
    assert rpc(node, {"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": [served.id], "id": 3}
               )[1]["error"]["code"] == -32001
    _, attested = rpc(node, {"jsonrpc": "2.0", "method": "tenzro_getAttestation", "params": [NONCE.hex()], "id": "a"})
    assert attested["result"]["nonce"] == NONCE.hex() and attested["id"] == "a"
    _, batch = rpc(node, [{"jsonrpc": "2.0", "method": "tenzro_nope", "id": 4},
                          {"jsonrpc": "2.0", "method": "tenzro_getAttestation", "params": {"nonce": "ab"}, "id": 5},
                          {"jsonrpc": "1.0", "method": "tenzro_getAttestation", "id": 6},
                          {"jsonrpc": "2.0", "method": "tenzro_getAttestation"}])  # a notification: no answer
    assert [(item["id"], item["error"]["code"]) for item in batch] == [(4, -32601), (5, -32602), (6, -32600)]
    request = urllib.request.Request(node.url + "/rpc", data=b"{not json", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["error"]["code"] == -32700

    # The ledger: each segment's key is the one its evidence binds.
    stop_node(node)
    ledger = node.config.parent / "home" / "ledger"
    verified = tenzro("metering", "verify", str(ledger), "--allow-none", env=node.env)
    assert verified.returncode == 0, verified.stdout
    assert "UNATTESTED" in verified.stdout and "which no TEE vouches for" in verified.stdout
    refused_none = tenzro("metering", "verify", str(ledger), "--trust-root", str(ledger), env=node.env)
    assert refused_none.returncode == 1 and "none-evidence" in refused_none.stdout

    # A segment signed by another key that names this boot's evidence: the binding check catches it.
    document = json.loads(next(ledger.glob("*.evidence.json")).read_text())
    forged_dir = node.config.parent / "forged"
    Ledger(forged_dir, NodeSigner.generate(), document["boot_id"], evidence_digest=evidence_digest(document))
    (forged_dir / f"{document['boot_id']}.evidence.json").write_text(json.dumps(document))
    forged = tenzro("metering", "verify", str(forged_dir), "--allow-none", env=node.env)
    assert forged.returncode == 1 and "but its evidence binds key " + document["public_key"] in forged.stdout
    (empty := node.config.parent / "no-evidence").mkdir()
    missing = tenzro("metering", "verify", str(ledger), "--allow-none", "--evidence", str(empty), env=node.env)
    assert missing.returncode == 1 and "no evidence document with digest" in missing.stdout


def get_text(node: Node, path: str, key: str) -> str:
    request = urllib.request.Request(node.url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def test_a_policy_that_requires_confidential_hardware_refuses_to_start_here(tmp_path: Path,
                                                                             small_model_dir: Path) -> None:
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    started = tenzro("node", "serve", "--model", str(small_model_dir), "--port", "1", "--policy", "confidential",
                     "--config", str(tmp_path / "node.yaml"), env=env)
    assert started.returncode == 2
    assert "the node policy 'confidential' is not met" in started.stderr
    assert "confidential hardware" in started.stderr and "none" in started.stderr
    bad = tenzro("node", "serve", "--model", str(small_model_dir), "--jurisdiction", "Germany", env=env)
    assert bad.returncode == 2 and "Germany" in bad.stderr
