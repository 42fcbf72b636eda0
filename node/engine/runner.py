"""The node's own prefill/decode loop on the transformers cache API: the sequences running in lanes.

Each request is a `Running` sequence in a lane: the reuse manager restores its prefix state (`reuse.py`), the
runner prefills the rest of its prompt in chunks, decodes, feeds the last token so that the reply's state is
complete, and hands it back to the manager to store; what outlives a request is the manager's. Per scheduler
step, prefill chunks of some sequences (`prefill`) and one decode step of every decoding one (`decode`, batched
where the model allows: `batch_forward.py`, BATCHING.md). Within one scope, never across scopes, a request copies
rows another running request computes (`follow`), and decoding sequences holding the same first rows attend them
once per step (`kinship.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cache.arena import Scope, SealCost
from cache.prefix_cache import PrefixCache
from cache.snapshot_policy import SnapshotPolicy
from node.engine.batch_forward import batch_blocker, batchable
from node.engine.detokenizer import Detokenizer
from node.engine.kinship import Kinship
from node.engine.loader import LoadedModel
from node.engine.reuse import ReuseManager
from node.engine.sampling import Sampler, SamplingParams
from node.engine.sequence import NO_FORMS, GenerationRequest, GenerationResult, PrefixForms, Running

__all__ = ["NO_FORMS", "GenerationRequest", "GenerationResult", "PrefixForms", "Runner", "Running"]


class Runner:
    """Runs sequences in lanes, one model's, on the engine's worker thread; state between requests is `reuse`'s."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None, prefill_chunk: int = 1024,
                 policy: SnapshotPolicy | None = None, seal_cost: SealCost | None = None) -> None:
        """`prefix_cache` None: reuse off. `policy`, `seal_cost`: the reuse manager's (`reuse.py`)."""
        self.loaded = loaded
        self._live: dict[int, Running] = {}
        """Running sequences by lane."""
        self.reuse = ReuseManager(loaded, prefix_cache, self._live, policy, seal_cost)
        self.prefill_chunk = prefill_chunk
        self._kinship = Kinship()
        self._batched = loaded.forward.batched_decode()
        self.batching = batch_blocker(loaded.model)
        """Why decode steps of several sequences cannot run as one forward on this model (None: they do)."""
        self.decode_steps = 0
        self.batched_steps = 0
        """Decode steps that ran several sequences in one forward."""
        self.largest_batch = 0
        self.fed_together = 0
        """Ended requests whose last token ran in one forward with others' (`feed_last`)."""

    def reserve_lanes(self, lanes: int, budget: int) -> int:
        """At start: `ReuseManager.reserve_lanes`; returns the token rows each lane holds."""
        return self.reuse.reserve_lanes(lanes, budget)

    @property
    def lane_rows(self) -> int:
        """Token rows each lane's buffers were given at start (`reserve_lanes`)."""
        return self.reuse.lane_rows

    def engine_config(self) -> dict[str, Any]:
        """For anyone (`GET /v1/node`): whether decode steps are batched (and why not) and how; fixed at start,
        so that it says nothing of other callers' traffic."""
        return {"batched_decode": self.batching is None,
                "reason": self.batching or "every layer is attention or recurrent",
                "prefill_chunk": self.prefill_chunk, "decode_attention": self.loaded.forward.decode_attention,
                "reserved_lane_rows": self.lane_rows}

    def engine_state(self) -> dict[str, Any]:
        """For operators (`GET /v1/node/state`): `engine_config` and how decode steps ran so far, which counts
        every caller's tokens."""
        return {**self.engine_config(), "decode_steps": self.decode_steps, "batched_steps": self.batched_steps,
                "largest_batch": self.largest_batch, "shared_rows": self._batched.shared_rows,
                "fed_together": self.fed_together}

    @torch.inference_mode()
    def prompt_logits(self, scope: Scope, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """(Last-position logits `[vocab]`, tokens restored) of `prompt` with reuse as configured, then store its
        state; for tests."""
        seq = self.start(GenerationRequest(scope, prompt, SamplingParams(max_tokens=1)), lambda _: None,
                         lambda: False, lane=0, sample=False)
        while seq.prefilling:
            self.prefill(seq)
        assert seq.prediction is not None
        logits = seq.prediction.logits()
        self.reuse.snapshot_end(seq, len(prompt))
        self.release(seq)
        self.reuse.store(seq.lane, scope, prompt, seq.cache, seq.snapshots)
        return logits, seq.restored

    def pick_lane(self, scope: Scope, lanes: int) -> int:
        """`ReuseManager.pick_lane`: the lane whose buffers may still hold `scope`'s last state."""
        return self.reuse.pick_lane(scope, lanes)

    def settle(self, stop: Callable[[], bool] = lambda: False, waiting: Callable[[], bool] | None = None) -> None:
        """Between steps and after replies: `ReuseManager.settle` (seal cold state, wipe idle lanes), then zero
        the forwards' scratch, which held some request's plaintext."""
        self.reuse.settle(stop, waiting)
        self.loaded.forward.wipe_scratch()
        self._batched.wipe_scratch()

    def drop_caller(self, caller: str) -> None:
        """The caller's key was removed (`ReuseManager.drop_caller`); its hot working cache is wiped now."""
        if self.reuse.drop_caller(caller):
            self.settle()

    def expire(self, ttl_of: Callable[[str], float | None]) -> None:
        """`ReuseManager.expire`; a hot working cache among the expired state is wiped now."""
        if self.reuse.expire(ttl_of):
            self.settle()

    # -- one sequence, step by step ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, request: GenerationRequest, emit: Callable[[str], Any], cancelled: Callable[[], bool],
              queue_wait_s: float = 0.0, lane: int = 0, sample: bool = True) -> Running:
        """Begin `request` in `lane` (free): restore its prefix state and plan its prefill."""
        assert lane not in self._live, "a lane runs one sequence at a time"
        started = time.perf_counter()
        params, prompt = request.params, request.prompt
        got = self.reuse.begin(request, lane)
        stops = sorted(set(got.wanted) | set(range(got.length + self.prefill_chunk, len(prompt), self.prefill_chunk))
                       | {len(prompt)})
        seq = Running(request=request, emit=emit, cancelled=cancelled, queue_wait_s=queue_wait_s, lane=lane,
                       started=started, cache=got.cache, restored=got.length, matched=got.matched,
                       stops=[stop for stop in stops if stop > got.length], wanted=frozenset(got.wanted),
                       sampler=Sampler(params), detok=Detokenizer(self.loaded.tokenizer, params.stop),
                       scratch=got.scratch, position=got.length, opening=got.opening, donor=got.donor)
        self._live[lane] = seq
        if not sample:
            seq.finish_reason = "length"  # prompt_logits: the prompt's logits, no reply
        return seq

    @torch.inference_mode()
    def follow(self, seq: Running) -> bool:
        """Copy into `seq` the state its donor has computed of their common prompt (rows up to the donor's
        position; for a model that resumes only at snapshots, up to where the donor holds one, or its live
        state); True while the donor is still computing more of it (`seq` then waits rather than computes
        them), False when `seq` goes on alone."""
        if seq.donor is None:
            return False
        donor, common = seq.donor
        if self._live.get(donor.lane) is not donor:  # it ended
            seq.donor = None
            return False
        if donor.opening is not None:
            return True  # it restarted, and its rows are still opening
        if self.reuse.copy_from_donor(seq, donor, common):
            seq.stops = [stop for stop in seq.stops if stop > seq.position]
        if seq.position >= common or not donor.prefilling:
            seq.donor = None
            return False
        return True

    @torch.inference_mode()
    def prefill(self, seq: Running) -> None:
        """Run the next chunk of `seq`'s prompt; after the last, choose its first token."""
        stop = seq.stops.pop(0)
        seq.prediction = self.loaded.forward.prefill(seq.request.prompt[seq.position:stop], seq.position, seq.cache)
        if not self._opened_all(seq, restart=True):
            return
        seq.position = stop
        if stop in seq.wanted and self.loaded.state is not None:
            seq.snapshots[stop] = self.loaded.state.snapshot(seq.cache)
        if not seq.prefilling and not seq.done:
            self._choose(seq)

    @torch.inference_mode()
    def decode(self, seqs: Sequence[Running]) -> None:
        """One decode step of every sequence in `seqs` (each has chosen a token not yet run): one batched
        forward where every cache allows it, else one forward each; then each chooses its next token."""
        self.decode_steps += 1
        if len(seqs) > 1 and self.batching is None and all(batchable(seq.cache) for seq in seqs):
            self.batched_steps += 1
            self.largest_batch = max(self.largest_batch, len(seqs))
            tokens = [seq.output[-1] for seq in seqs]
            positions = [len(seq.request.prompt) + len(seq.output) - 1 for seq in seqs]
            groups, greedy = self._kinship.groups(seqs, self._live), [seq.sampler.params.argmax_only for seq in seqs]
            caches = [seq.cache for seq in seqs]
            predictions = self.loaded.forward.step(self._batched, tokens, positions, caches, groups, greedy)
            for seq, prediction in zip(seqs, predictions, strict=True):
                seq.prediction = prediction
        else:
            for seq in seqs:
                position = len(seq.request.prompt) + len(seq.output) - 1
                seq.prediction = self.loaded.forward.prefill([seq.output[-1]], position, seq.cache)
        for seq in seqs:
            self._choose(seq)

    def _choose(self, seq: Running) -> None:
        """Sample the next token from `seq.prediction`, hand out its text, and see whether the reply ends."""
        params = seq.request.params
        if len(seq.output) >= params.max_tokens:
            seq.finish_reason = "length"
            return
        assert seq.prediction is not None
        token = seq.sampler.next_token(seq.prediction, seq.output)
        seq.output.append(token)
        delta = seq.detok.push(token)
        if len(seq.output) == 1:
            seq.ttft = time.perf_counter() - seq.started
        if delta:
            seq.emit(delta)
        if len(seq.output) == 1 and self.loaded.state is not None:
            # The first token is out: now join the restored prefix to the working buffers, which decode steps
            # read as one tensor.
            self.loaded.state.materialize(seq.cache)
        if token in self.loaded.eos_token_ids or seq.detok.stopped:
            seq.finish_reason = "stop"
        elif seq.cancelled():
            seq.finish_reason = "cancelled"
        elif len(seq.output) >= params.max_tokens:
            seq.finish_reason = "length"

    def release(self, seq: Running) -> None:
        """`seq` leaves its lane (ended, or failed: then nothing of it is stored): the state it opened elsewhere
        is zeroed, the rows it wrote are counted."""
        if not self._opened_all(seq, restart=False):
            seq.discard, seq.restored = True, 0  # its rows did not open: nothing of it is stored or billed read
        self._live.pop(seq.lane, None)
        seq.donor = None
        self._kinship.leave(seq.lane)
        self.reuse.vacate(seq)

    def _opened_all(self, seq: Running, restart: bool) -> bool:
        """`ReuseManager.finish_opening`. False when an entry failed to open; with `restart` the request then
        starts over in its lane without it, as after a failed restore."""
        if self.reuse.finish_opening(seq):
            return True
        if restart:
            del self._live[seq.lane]
            again = self.start(seq.request, seq.emit, seq.cancelled, seq.queue_wait_s, seq.lane)
            for name in ("cache", "restored", "matched", "stops", "wanted", "scratch", "position", "opening",
                         "donor", "snapshots", "prediction"):
                setattr(seq, name, getattr(again, name))
            self._live[seq.lane] = seq
        return False

    @torch.inference_mode()
    def feed_last(self, seqs: Sequence[Running]) -> None:
        """Run the last sampled token of ended sequences that store their state, as one batched forward without
        the head where their caches allow it (`finish` then stores them as they are); else leave it to `finish`,
        one forward each. Requests of a wave end in the same step."""
        feed = [seq for seq in seqs if self.reuse.awaits_last_token(seq)]
        if len(feed) < 2 or self.batching is not None or not all(batchable(seq.cache) for seq in feed):
            return
        try:
            self._batched.step([seq.output[-1] for seq in feed],
                               [len(seq.request.prompt) + len(seq.output) - 1 for seq in feed],
                               [seq.cache for seq in feed], self.loaded.device,
                               self._kinship.groups(feed, self._live), logits=False)
        except BaseException:
            for seq in feed:
                seq.discard = True  # their caches may be part written: nothing of them is stored
            raise
        self.fed_together += len(feed)
        for seq in feed:
            seq.fed = True

    @torch.inference_mode()
    def finish(self, seq: Running) -> GenerationResult:
        """`seq` has ended: remember its reply, run its last token where its state is stored with it, store its
        state for the caller (`ReuseManager.end`), and account for it."""
        prompt, output = seq.request.prompt, seq.output
        tail = seq.detok.flush()
        if tail:
            seq.emit(tail)
        self.release(seq)
        matched = min(max(seq.matched, seq.restored), len(prompt) - 1)
        self.reuse.remember_reply(seq)
        if self.reuse.awaits_last_token(seq):
            # The last token was sampled but not yet run: run it so the stored state ends with the reply.
            self.loaded.forward.extend([output[-1]], len(prompt) + len(output) - 1, seq.cache)
        stored = self.reuse.end(seq)
        # Prompt tokens among those newly stored and still held.
        written = 0 if stored is None else max(0, min(len(prompt), stored.start + stored.stored) - stored.start)
        return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=seq.restored,
                                cached_write_tokens=written, output_ids=output, text=seq.detok.text,
                                finish_reason=seq.finish_reason or "length", queue_wait_s=seq.queue_wait_s,
                                ttft_s=seq.ttft, retained=stored is not None, matched_tokens=matched)

    def generate(self, request: GenerationRequest, emit: Callable[[str], Any],
                 cancelled: Callable[[], bool], queue_wait_s: float = 0.0, lane: int = 0) -> GenerationResult:
        """Run one request alone; `emit` gets each text delta as soon as it is safe to send."""
        seq = self.start(request, emit, cancelled, queue_wait_s, lane)
        try:
            while not seq.done:
                if seq.prefilling:
                    self.prefill(seq)
                else:
                    self.decode([seq])
        except BaseException:
            self.release(seq)
            raise
        return self.finish(seq)
