"""Reuse against the model itself: resumed logits equal one full pass; greedy output is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cache.arena import Scope
from node.engine.forward import Forward
from node.engine.kernel_operands import NativeLayer
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from tests.node.engine.runners import prompt_logits, sealed_runner
from tests.numeric import relative_error

TOLERANCE = 1e-4  # of the largest |logit| (tests/numeric.py); float32 logits are of order 1 to 10
SCOPE = Scope("alice", "small")


@pytest.fixture(scope="module")
def loaded(small_model_dir: Path) -> LoadedModel:
    return load_model("small", small_model_dir)


def full_pass_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = loaded.model(input_ids=ids, position_ids=torch.arange(len(prompt)).unsqueeze(0), use_cache=False)
    return out.logits[0, -1].float()


def tokens(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n,), generator=generator).tolist()


def fresh_runner(loaded: LoadedModel) -> ModelRunner:
    return sealed_runner(loaded, prefill_chunk=64)


def test_resume_at_the_end_of_a_cached_prompt(loaded: LoadedModel) -> None:
    runner = fresh_runner(loaded)
    a, b = tokens(1, 300), tokens(2, 40)
    _, restored = prompt_logits(runner, SCOPE, a)
    assert restored == 0
    logits, restored = prompt_logits(runner, SCOPE, a + b)
    assert restored == 300
    assert relative_error(logits, full_pass_logits(loaded, a + b)) <= TOLERANCE


def test_resume_in_the_middle_of_a_cached_prompt(loaded: LoadedModel) -> None:
    runner = fresh_runner(loaded)
    a, c, b = tokens(3, 200), tokens(4, 150), tokens(5, 30)
    prompt_logits(runner, SCOPE, a + c)
    logits, restored = prompt_logits(runner, SCOPE, a + b)  # diverges 200 tokens into a 350-token span
    assert restored == 200
    assert relative_error(logits, full_pass_logits(loaded, a + b)) <= TOLERANCE
    # The split left both branches usable: the first prompt resumes whole (all but its last token).
    logits, restored = prompt_logits(runner, SCOPE, a + c)
    assert restored == 349
    assert relative_error(logits, full_pass_logits(loaded, a + c)) <= TOLERANCE


def test_chunked_prefill_equals_one_pass(loaded: LoadedModel) -> None:
    prompt = tokens(6, 333)
    logits, _ = prompt_logits(ModelRunner(loaded, None, prefill_chunk=50), SCOPE, prompt)
    assert relative_error(logits, full_pass_logits(loaded, prompt)) <= TOLERANCE


def generate(runner: ModelRunner, prompt: list[int], max_tokens: int = 20, scope: Scope = SCOPE) -> list[int]:
    request = GenerationRequest(scope, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return runner.generate(request, emit=lambda _: None, cancelled=lambda: False).output_ids


def test_greedy_output_is_identical_with_reuse_on_and_off(loaded: LoadedModel) -> None:
    reuse, plain = fresh_runner(loaded), ModelRunner(loaded, None)
    history = tokens(7, 120)
    for turn in range(4):
        history = history + tokens(10 + turn, 25)
        got, expected = generate(reuse, history), generate(plain, history)
        assert got == expected
        history = history + got


def test_generation_reports_cached_reads_and_writes(loaded: LoadedModel) -> None:
    runner = fresh_runner(loaded)
    prompt = tokens(8, 64)
    first = runner.generate(GenerationRequest(SCOPE, prompt, SamplingParams(5, 0.0)), lambda _: None,
                            lambda: False)
    assert (first.cached_read_tokens, first.cached_write_tokens) == (0, 64)
    follow = prompt + first.output_ids + tokens(9, 10)
    second = runner.generate(GenerationRequest(SCOPE, follow, SamplingParams(5, 0.0)), lambda _: None,
                             lambda: False)
    assert (second.cached_read_tokens, second.cached_write_tokens) == (69, 10)
    assert runner.reuse.prefix_cache is not None
    assert runner.reuse.prefix_cache.cached_tokens(SCOPE) == 64 + 5 + 10 + 5


def test_cancellation_stops_decoding_and_keeps_the_prompt_state(loaded: LoadedModel) -> None:
    runner = fresh_runner(loaded)
    prompt = tokens(11, 50)
    result = runner.generate(GenerationRequest(SCOPE, prompt, SamplingParams(50, 0.0)), lambda _: None,
                             cancelled=lambda: True)
    assert result.finish_reason == "cancelled" and len(result.output_ids) == 1
    assert runner.generate(GenerationRequest(SCOPE, prompt + [5], SamplingParams(1, 0.0)), lambda _: None,
                           lambda: False).cached_read_tokens == 50


def test_another_scope_never_continues_from_the_working_buffers(loaded: LoadedModel) -> None:
    runner = fresh_runner(loaded)
    prompt = tokens(12, 80)
    prompt_logits(runner, SCOPE, prompt)
    logits, restored = prompt_logits(runner, Scope("bob", "small"), prompt + [7])
    assert restored == 0
    assert relative_error(logits, full_pass_logits(loaded, prompt + [7])) <= TOLERANCE


def test_a_prefix_restored_after_another_callers_request_is_read_where_it_is_stored(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bob's request takes the working buffers, so Alice's prefix comes back from the store: the resumed
    forward reads the stored pieces in place (no copy before the first token), decoding then joins them."""
    if loaded.forward.decoder is None:
        pytest.skip(f"the native forward is not loaded: {loaded.forward.reason}")
    assert loaded.state is not None
    reuse, plain = fresh_runner(loaded), ModelRunner(loaded, None)
    history = tokens(21, 150)
    generate(reuse, history)
    generate(reuse, tokens(22, 90), scope=Scope("bob", "small"))
    pieces_seen: list[int] = []
    original = NativeLayer.set_cache

    def counting(layer: NativeLayer, keys: torch.Tensor, values: torch.Tensor, segments: list[Any]) -> None:
        pieces_seen.append(len(segments))
        original(layer, keys, values, segments)

    monkeypatch.setattr(NativeLayer, "set_cache", counting)
    follow = history + tokens(23, 30)
    got = generate(reuse, follow)
    assert got == generate(plain, follow)
    assert max(pieces_seen) > 1  # the first forward attended over stored pieces and new tokens
    logits, restored = prompt_logits(reuse, SCOPE, follow + got + tokens(24, 20))
    assert restored > len(follow)
    assert relative_error(logits, full_pass_logits(loaded, follow + got + tokens(24, 20))) <= TOLERANCE


def test_without_reuse_the_prefill_is_not_cut_for_snapshots(small_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from node.engine.synthetic import init_model

    hybrid = load_model("h", init_model("bamba", tmp_path / "h", size="small"))
    plain = ModelRunner(hybrid, None, prefill_chunk=1024)
    lengths: list[int] = []
    prefill = Forward.prefill
    monkeypatch.setattr(Forward, "prefill", lambda self, ids, start, cache, media=None: lengths.append(len(ids))
                        or prefill(self, ids, start, cache))
    plain.generate(GenerationRequest(Scope("c", "h"), tokens(14, 300), SamplingParams(1, 0.0), boundaries=(90, 200)),
                   emit=lambda _: None, cancelled=lambda: False)
    assert lengths == [300]


def test_cached_writes_count_the_whole_new_span_when_snapshots_cut_it(tmp_path: Path) -> None:
    from node.engine.synthetic import init_model

    hybrid = load_model("h", init_model("bamba", tmp_path / "h", size="small"))
    run = sealed_runner(hybrid)
    prompt = tokens(15, 120)
    first = run.generate(GenerationRequest(Scope("c", "h"), prompt, SamplingParams(4, 0.0), boundaries=(40, 90)),
                         emit=lambda _: None, cancelled=lambda: False)
    assert (first.cached_read_tokens, first.cached_write_tokens) == (0, 120)
    second = run.generate(GenerationRequest(Scope("c", "h"), prompt[:90] + tokens(16, 30), SamplingParams(4, 0.0),
                                            boundaries=(40, 90)), emit=lambda _: None, cancelled=lambda: False)
    assert (second.cached_read_tokens, second.cached_write_tokens) == (90, 30)


def test_a_reply_is_remembered_only_where_its_text_is_exactly_its_ids(loaded: LoadedModel) -> None:
    for runner in (fresh_runner(loaded), ModelRunner(loaded, None)):  # with reuse off too: the same prompts
        prompt = tokens(31, 24)
        plain = runner.generate(GenerationRequest(SCOPE, prompt, SamplingParams(8, 0.0)), emit=lambda _: None,
                                cancelled=lambda: False)
        assert runner.reuse.replies.recall(SCOPE, plain.text) == plain.output_ids
        # A stop string cut the text short of the ids; retention none keeps nothing.
        stop = plain.text[len(plain.text) // 2:][:3]
        assert stop
        other = Scope("stopped", loaded.model_id)
        cut = runner.generate(GenerationRequest(other, prompt, SamplingParams(8, 0.0, stop=(stop,))),
                              emit=lambda _: None, cancelled=lambda: False)
        assert cut.text != plain.text and runner.reuse.replies.replies(other) == 0
        kept_none = Scope("none", loaded.model_id)
        runner.generate(GenerationRequest(kept_none, prompt, SamplingParams(8, 0.0), retain=False),
                        emit=lambda _: None, cancelled=lambda: False)
        assert runner.reuse.replies.replies(kept_none) == 0
        runner.drop_caller(SCOPE.caller)
        assert runner.reuse.replies.recall(SCOPE, plain.text) is None
