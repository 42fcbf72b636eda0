"""A node start names the code and the model it runs: in `GET /v1/node`, in its start-up lines, and in its ledger
segment's signed header, which `tenzro metering verify` shows."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from metering.segment import read_header
from node.code_identity import compute_code_identity, compute_model_identity
from tests.node.conftest import NodeFactory, tenzro


def test_a_node_names_its_code_and_model_digests_everywhere(node_factory: NodeFactory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5) as response:  # loopback only
        about = json.load(response)
    model = compute_model_identity(small_model_dir.name, small_model_dir)
    assert about["models"] == [model.describe()]
    code = about["code"]
    # This tree is an editable install: the packages' directories are what runs.
    assert code == compute_code_identity().describe() and code["source"] == "tree"

    segment = Path(node.env["TENZRO_HOME"]) / "ledger" / about["ledger_segment"]
    header = read_header(segment)
    assert (header.code_digest, header.model_digests) == (code["digest"], ((small_model_dir.name, model.digest),))
    verified = tenzro("metering", "verify", str(segment), "--node-key", about["public_key"], env=node.env)
    assert verified.returncode == 0, verified.stdout
    assert f"; code {code['digest']}; model {small_model_dir.name} {model.digest}); Merkle root" in verified.stdout

    log = (node.config.parent / "node.log").read_text()
    assert f"code {code['digest']} (tree: {code['files']} files, {code['python']})" in log
    assert f"  model {small_model_dir.name}: {model.digest} (6 files)" in log
