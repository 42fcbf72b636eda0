"""Every resume point kind, on every state kind: resumed logits equal one full pass of the model.

Resume points: anywhere in a span (full attention only), the end of a stored prompt, a message boundary,
a branch point, an interval snapshot and the end of a generated reply.
"""

from __future__ import annotations

import pytest
import torch

from cache.arena import Scope
from cache.snapshot_policy import SnapshotPolicy
from node.engine.loader import LoadedModel, load_model
from node.engine.runner import GenerationRequest, ModelRunner
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model
from tests.node.engine.runners import prompt_logits, sealed_runner
from tests.numeric import relative_error

TOLERANCE = 1e-4  # of the largest |logit| (tests/numeric.py); float32 logits are of order 1 to 10
FAMILIES = ["llama", "mistral", "gemma2", "mamba", "mamba2", "jamba", "bamba", "falcon-h1", "lfm2", "qwen3-next"]


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    family = request.param
    return load_model(family, init_model(family, tmp_path_factory.mktemp("zoo") / family, size="small"))


def full_pass_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    return prompt_logits(ModelRunner(loaded, None), Scope("reference", loaded.model_id), prompt)[0]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner(loaded: LoadedModel, interval: int = 0) -> ModelRunner:
    return sealed_runner(loaded, 1 << 32, prefill_chunk=48, policy=SnapshotPolicy(interval=interval))


def check(loaded: LoadedModel, run: ModelRunner, prompt: list[int], resumed_at: int) -> None:
    logits, restored = prompt_logits(run, Scope("alice", loaded.model_id), prompt)
    assert restored == resumed_at
    assert relative_error(logits, full_pass_logits(loaded, prompt)) <= TOLERANCE


def is_dense(loaded: LoadedModel) -> bool:
    return loaded.state is not None and not loaded.state.needs_snapshots


def test_end_of_a_stored_prompt(loaded: LoadedModel) -> None:
    run, a = runner(loaded), tokens(1, 120)
    check(loaded, run, a, 0)
    check(loaded, run, a + tokens(2, 30), 120)


def test_branch_point_then_inside_a_span(loaded: LoadedModel) -> None:
    run, a = runner(loaded), tokens(3, 100)
    check(loaded, run, a + tokens(4, 60), 0)
    # Diverging inside the stored span: dense layers resume right there; others from the last snapshot
    # (none yet), and the branch point becomes one.
    check(loaded, run, a + tokens(5, 40), 100 if is_dense(loaded) else 0)
    check(loaded, run, a + tokens(6, 40), 100)


def test_interval_snapshot(loaded: LoadedModel) -> None:
    run, a = runner(loaded, interval=32), tokens(7, 150)
    check(loaded, run, a, 0)
    check(loaded, run, a[:110] + tokens(8, 20), 110 if is_dense(loaded) else 96)


def test_message_boundary_and_end_of_reply(loaded: LoadedModel) -> None:
    run, scope = runner(loaded), Scope("alice", loaded.model_id)
    system, user, edited = tokens(9, 90), tokens(10, 30), tokens(11, 25)
    first = run.generate(GenerationRequest(scope, system + user, SamplingParams(6, 0.0), boundaries=(90,)),
                         emit=lambda _: None, cancelled=lambda: False)
    # Only the message after the system prompt changed: resume at the boundary.
    check(loaded, run, system + edited, 90)
    # The conversation goes on after the reply: resume at the end of the reply.
    follow = system + user + first.output_ids + tokens(12, 15)
    check(loaded, run, follow, 90 + 30 + 6)


def test_greedy_decoding_after_a_resume_matches(loaded: LoadedModel) -> None:
    run, plain, scope = runner(loaded, interval=32), ModelRunner(loaded, None), Scope("alice", loaded.model_id)
    history = tokens(13, 70)
    for turn in range(3):
        history = history + tokens(20 + turn, 12)
        request = GenerationRequest(scope, history, SamplingParams(10, 0.0))
        got = run.generate(request, emit=lambda _: None, cancelled=lambda: False)
        assert got.output_ids == plain.generate(request, emit=lambda _: None, cancelled=lambda: False).output_ids
        assert turn == 0 or got.cached_read_tokens == len(history) - 12
        history = history + got.output_ids


def test_an_identical_prompt_sent_again_recomputes_only_its_last_token(loaded: LoadedModel) -> None:
    # Issue 34: a hybrid's retry of a prompt whose last message is long recomputed that whole message.
    run, plain, scope = runner(loaded), ModelRunner(loaded, None), Scope("alice", loaded.model_id)
    system, document = tokens(40, 30), tokens(41, 400)
    request = GenerationRequest(scope, system + document, SamplingParams(6, 0.0), boundaries=(30, 425))
    first = run.generate(request, emit=lambda _: None, cancelled=lambda: False)
    again = run.generate(request, emit=lambda _: None, cancelled=lambda: False)
    assert (first.cached_read_tokens, again.cached_read_tokens) == (0, 429)
    assert again.output_ids == first.output_ids == plain.generate(request, emit=lambda _: None,
                                                                  cancelled=lambda: False).output_ids


def test_an_edit_late_in_a_long_message_resumes_on_the_grid_before_it(loaded: LoadedModel) -> None:
    # The default grid: 128 apart up to 512, then at most a quarter of the position (896 before 950).
    run = sealed_runner(loaded, 1 << 32, prefill_chunk=48, policy=SnapshotPolicy())
    system, question = tokens(42, 1000), tokens(43, 40)
    check(loaded, run, system + question, 0)
    edited = system[:950] + [system[950] + 1] + system[951:]
    check(loaded, run, edited + question, 950 if is_dense(loaded) else 896)
