"""The bench's own node, run through the `tenzro` command line: models, keys, and a start that fails."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from bench.client import BenchError
from bench.local_node import LocalNode, model_dir


def test_an_existing_directory_is_the_model(small_model_dir: Path, tmp_path: Path) -> None:
    assert model_dir(str(small_model_dir), tmp_path) == small_model_dir.resolve()
    assert list(tmp_path.iterdir()) == []  # nothing built


def test_an_architecture_name_is_built_by_models_init(tmp_path: Path) -> None:
    built = model_dir("default", tmp_path / "models")
    assert built == tmp_path / "models" / "default"
    assert json.loads((built / "config.json").read_text())["model_type"] == "llama"
    assert (built / "tokenizer.json").is_file()


def test_an_unknown_model_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match=r"(?s)^--model 'no-such-arch' is neither a model directory nor an "
                                         r"architecture name: 'tenzro models init --arch no-such-arch .*' failed: "
                                         r".*argument --arch: invalid choice: 'no-such-arch'"):
        model_dir("no-such-arch", tmp_path)


def test_a_node_that_exits_at_start_fails_with_its_log(tmp_path: Path) -> None:
    async def wait(node: LocalNode) -> None:
        async with aiohttp.ClientSession() as session:
            await node.wait_healthy(session)

    with pytest.raises(BenchError) as raised, LocalNode(tmp_path, str(tmp_path / "missing"), 1, None) as node:
        asyncio.run(wait(node))
    message = str(raised.value)
    assert message.startswith(f"the local node exited (2)\nnode log ({tmp_path / 'node.log'}):\n")
    assert "is not a directory; pass --model default or a local model directory" in message
    assert node.process is not None and node.process.returncode == 2
    callers = yaml.safe_load((tmp_path / "node.yaml").read_text())["callers"]
    assert list(callers) == ["bench"] and callers["bench"]["role"] == "caller"
