"""scripts/native_ab.py: it refuses to time arms that disagree, and a quick run on the small model reports every op
at every batch size with arms that agreed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from node.engine.cpu_kernels import load_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "native_ab.py"


@pytest.fixture(scope="module")
def native_ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("native_ab", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["native_ab"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("off", [1e-3, float("nan")])
def test_arms_that_disagree_are_not_timed(native_ab: ModuleType, off: float) -> None:
    runs = {"native": 0, "torch": 0}

    def arm(name: str, value: float) -> object:
        def run() -> list[torch.Tensor]:
            runs[name] += 1
            return [torch.full((2, 3), value)]
        return native_ab.Arm(name, run)

    case = native_ab.Case("op", 2, 1, (arm("native", 1.0), arm("torch", 1.0 + off)))
    with pytest.raises(native_ab.Disagreement, match="op at 2 rows: torch differs from native by"):
        native_ab.measure(case, runs=5)
    assert runs == {"native": 1, "torch": 1}  # the check's run only


def test_arms_within_the_tolerance_are_timed_in_turn(native_ab: ModuleType) -> None:
    order: list[str] = []

    def arm(name: str, value: float) -> object:
        def run() -> list[torch.Tensor]:
            order.append(name)
            return [torch.full((2, 3), value)]
        return native_ab.Arm(name, run)

    case = native_ab.Case("op", 2, 1, (arm("n", 10.0), arm("a", 10.0 + 2 ** -14), arm("b", 10.0)))
    result = native_ab.measure(case, runs=3)
    assert result.difference == {"a": 2 ** -14 / 10, "b": 0.0}  # exact in float32; under TOLERANCE
    # check, warm-up, then each repetition starting one arm further on
    assert order == ["n", "a", "b"] * 2 + ["n", "a", "b", "a", "b", "n", "b", "n", "a"]
    assert list(result.times) == ["n", "a", "b"]


def test_spread_and_verdict(native_ab: ModuleType) -> None:
    spread = native_ab.Spread.of([5e-6, 1e-6, 4e-6, 2e-6, 3e-6])
    assert (spread.least, spread.q1, spread.median, spread.q3, spread.most) == pytest.approx((1, 2, 3, 4, 5))
    fast, slow, overlapping = (native_ab.Spread(m, m - 1, m + 1, m - 2, m + 2) for m in (10.0, 13.0, 11.5))
    assert native_ab.verdict(fast, slow) == "native wins"
    assert native_ab.verdict(slow, fast) == "torch wins"
    assert native_ab.verdict(fast, overlapping) == "within spread"


@pytest.mark.skipif(load_kernels().kernels is None, reason=f"no native kernels: {load_kernels().reason}")
def test_quick_run_on_the_small_model(native_ab: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "native_ab.json"
    native_ab.main(["--quick", "--size", "small", "--rows", "1,3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["runs"] == 5 and report["threads"] == 1 and report["size"] == "small"
    results = report["results"]
    assert [(r["op"], r["rows"], r["calls"]) for r in results] == [
        ("gemm", 1, 8), ("gemm", 3, 8), ("rmsnorm", 1, 5), ("rmsnorm", 3, 5), ("rope", 1, 2), ("rope", 3, 2),
        ("silu_mul", 1, 2), ("silu_mul", 3, 2)]  # the small model: 2 layers
    arms = {r["op"]: list(r["times"]) for r in results}
    assert arms == {
        "gemm": ["native tz_gemm (panels)", "F.linear [out,in]", "x @ weight_t [in,out]", "oneDNN packed"],
        "rmsnorm": ["native tz_rmsnorm", "transformers LlamaRMSNorm", "F.rms_norm"],
        "rope": ["native tz_rope (in place)", "transformers apply_rotary_pos_emb"],
        "silu_mul": ["native tz_silu_mul", "transformers act_fn(gate) * up"]}
    for result in results:
        assert list(result["difference"]) == list(result["times"])[1:]
        assert all(difference <= native_ab.TOLERANCE for difference in result["difference"].values())
        assert result["verdict"] in ("native wins", "torch wins", "within spread")
        for spread in result["times"].values():
            assert 0 < spread["least"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["most"]
