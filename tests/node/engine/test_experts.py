"""The expert split in one process: rank 0's dispatching forward against two holder threads, each holding half of
the routed experts of a small Mixtral, gives the logits of the whole model."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from node.engine.expert_holder import serve_holder
from node.engine.experts import ExpertPlacement, ExpertsError, ExpertSplit, ExpertsTopology, ExpertsUnavailable
from tests.node.conftest import free_port

TOLERANCE = 1e-5
"""Of the largest logit: the holders sum each token's expert outputs in the library's order; only the GEMMs' row
blocking differs."""


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from node.engine.synthetic import init_model

    return init_model("mixtral", tmp_path_factory.mktemp("experts") / "mixtral", size="small")


@pytest.fixture(scope="module")
def split_model(mixtral_dir: Path) -> Iterator[tuple[torch.nn.Module, ExpertSplit]]:
    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    port = free_port()
    holders = [threading.Thread(target=serve_holder, args=(mixtral_dir, rank, "127.0.0.1", port), daemon=True)
               for rank in (1, 2)]
    topology = ExpertsTopology(3, "127.0.0.1", port, answer_timeout_s=10, join_timeout_s=60)
    started: list[ExpertSplit] = []
    starter = threading.Thread(target=lambda: started.append(ExpertSplit.start(model, torch.float32, topology)))
    starter.start()
    for holder in holders:
        holder.start()
    starter.join()
    yield model, started[0]
    started[0].close()
    for holder in holders:
        holder.join(timeout=10)


def test_placement_splits_experts_among_holders_only() -> None:
    placement = ExpertPlacement(experts=8, world=4)
    assert [list(placement.experts_of(rank)) for rank in placement.holders] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(ExpertsError, match="--experts-world from 2 to 5"):
        ExpertPlacement(experts=4, world=6)


def test_topology_refuses_a_master_without_port() -> None:
    with pytest.raises(ExpertsError, match="not ADDR:PORT"):
        ExpertsTopology.parse(3, "localhost")


def test_split_logits_equal_the_whole_model(mixtral_dir: Path, split_model: tuple[torch.nn.Module, ExpertSplit]
                                            ) -> None:
    whole = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    model, split = split_model
    ids = torch.arange(100, 140).unsqueeze(0)
    before = {rank: traffic.pairs for rank, traffic in split.traffic.items()}
    with torch.inference_mode():
        expected, got = whole(ids).logits, model(ids).logits
    assert (got - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()
    pairs = sum(traffic.pairs - before[rank] for rank, traffic in split.traffic.items())
    config = whole.config
    assert pairs == 40 * config.num_experts_per_tok * config.num_hidden_layers
    assert all(p.numel() == 0 for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj")))


def test_no_holder_refuses_with_unavailable(split_model: tuple[torch.nn.Module, ExpertSplit]) -> None:
    _, split = split_model
    group, split._group = split._group, None
    try:
        with pytest.raises(ExpertsUnavailable, match="not connected"):
            split.dispatch(0, torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2))
    finally:
        split._group = group


def test_start_refuses_without_its_holders(mixtral_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    topology = ExpertsTopology(3, "127.0.0.1", free_port(), join_timeout_s=0.3)
    with pytest.raises(ExpertsError, match=r"expert holders \[1, 2\] did not join"):
        ExpertSplit.start(model, torch.float32, topology)


def test_start_refuses_a_model_without_routed_experts(small_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).eval()
    with pytest.raises(ExpertsError, match="needs a mixture-of-experts model"):
        ExpertSplit.start(model, torch.float32, ExpertsTopology(3, "127.0.0.1", free_port()))
