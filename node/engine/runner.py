"""The model runner: executes each step the scheduler plans, on the model's one `Forward`.

Each request is a `Sequence` in a lane: the reuse manager restores its prefix state (`reuse.py`), the
runner prefills the rest of its prompt in chunks, decodes, feeds the last token so that the reply's state is
complete, and hands it back to the manager to store; what outlives a request is the manager's. A step
(`StepPlan`, `run`) has four parts, in order: `follow` (within one scope, never across scopes, a request copies
rows another running request computes), `prefill` (chunks of some sequences' prompts), `decode` (one step of
every decoding sequence, one forward where the model allows: `Forward.decode`, BATCHING.md; decoding sequences
holding the same first rows attend them once, `kinship.py`) and `retire` (ended sequences leave their lanes and
their state is stored). Which forward runs a chunk or a step is the `Forward`'s choice, never the runner's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from cache.arena import Scope, SealCost
from cache.prefix_cache import PrefixCache
from cache.snapshot_policy import SnapshotPolicy
from cache.working_cache import GrowableKVLayer
from node.engine.detokenizer import Detokenizer
from node.engine.kinship import Kinship
from node.engine.loader import LoadedModel
from node.engine.reuse import ReuseManager
from node.engine.sampling import Sampler
from node.engine.sequence import (
    NO_FORMS,
    GenerationRequest,
    GenerationResult,
    PrefixForms,
    Sequence,
    StepOutcome,
    StepPlan,
)

__all__ = ["NO_FORMS", "GenerationRequest", "GenerationResult", "ModelRunner", "PrefixForms", "Sequence", "StepOutcome",
           "StepPlan"]


class ModelRunner:
    """Runs one model's sequences in lanes, a planned step at a time, on the engine's worker thread; the state
    between requests is `reuse`'s."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None, prefill_chunk: int = 1024,
                 policy: SnapshotPolicy | None = None, seal_cost: SealCost | None = None) -> None:
        """`prefix_cache` None: reuse off. `policy`, `seal_cost`: the reuse manager's (`reuse.py`)."""
        self.loaded = loaded
        self._live: dict[int, Sequence] = {}  # the running sequences by lane
        self.reuse = ReuseManager(loaded, prefix_cache, self._live, policy, seal_cost)
        self.prefill_chunk = prefill_chunk
        self._kinship = Kinship()
        self.forward = loaded.forward
        self._batched = loaded.forward.batched_decode()
        self.decode_steps = 0
        self.batched_steps = 0
        """Decode steps that ran several sequences in one forward."""
        self.largest_batch = 0
        self.fed_together = 0
        """Ended requests whose last token ran in one forward with others' (`feed_last`)."""

    def reserve_lanes(self, lanes: int, budget: int, static: bool | None = None) -> int:
        """At start: reserve the lanes' working buffers (`ReuseManager.reserve_lanes`); returns their rows. Where
        decode steps run static (`static`; None: where the forward says, `Forward.static`), the lanes are laid out
        as one slab per layer and steps whose rows are all there run over it (`static_decode.py`), captured as CUDA
        graphs on a GPU."""
        static = self.forward.static is None if static is None else static
        rows = self.reuse.reserve_lanes(lanes, budget, contiguous=static)
        owner = self.reuse.lanes
        if not static or owner is None or lanes <= 0:
            return rows
        with torch.inference_mode():
            template, _ = owner.new_cache(0, 1)
            self.forward.prefill([0], 0, template)  # one token: the shapes of the recurrent layers' states
            owner.wipe(0, 0, 1)
        if owner.slabs or not any(isinstance(layer, GrowableKVLayer) for layer in template.layers):
            self._batched.go_static(owner.slabs, template, lanes, capture=self.forward.device.type == "cuda").prepare()
        return rows

    def engine_config(self) -> dict[str, Any]:
        """For anyone (`GET /v1/node`): whether decode steps are batched (and why not) and how; fixed at start,
        so that it says nothing of other callers' traffic."""
        return {"batched_decode": self.forward.batching is None,
                "reason": self.forward.batching or "every layer is attention or recurrent",
                "prefill_chunk": self.prefill_chunk, "decode_attention": self.forward.decode_attention,
                "reserved_lane_rows": self.reuse.lane_rows, "static_decode": self._static_config()}

    def _static_config(self) -> dict[str, Any]:
        static = self._batched.static
        if static is not None:
            return static.describe()
        return {"graphs": False, "reason": self.forward.static or "no lane rows were reserved to lay out as slabs"}

    def engine_state(self) -> dict[str, Any]:
        """For operators (`GET /v1/node/state`): `engine_config` and how decode steps ran so far, which counts
        every caller's tokens."""
        return {**self.engine_config(), "decode_steps": self.decode_steps, "batched_steps": self.batched_steps,
                "largest_batch": self.largest_batch, "shared_rows": self._batched.shared_rows,
                "static_steps": self._batched.static.steps if self._batched.static is not None else 0,
                "fed_together": self.fed_together}

    def pick_lane(self, scope: Scope, lanes: int) -> int:
        """`ReuseManager.pick_lane`: the lane whose buffers may still hold `scope`'s last state."""
        return self.reuse.pick_lane(scope, lanes)

    def settle(self, stop: Callable[[], bool] = lambda: False, waiting: Callable[[], bool] | None = None) -> None:
        """Between steps and after replies: `ReuseManager.settle` (seal cold state, wipe idle lanes), then zero
        the forwards' scratch, which held some request's plaintext."""
        self.reuse.settle(stop, waiting)
        self.forward.wipe_scratch()
        self._batched.wipe_scratch()

    def drop_caller(self, caller: str) -> None:
        """The caller's key was removed (`ReuseManager.drop_caller`); its hot working cache is wiped now."""
        if self.reuse.drop_caller(caller):
            self.settle()

    def shred(self, scope: Scope) -> None:
        """The caller shreds `scope` (`ReuseManager.shred`); its hot working cache is wiped now."""
        if self.reuse.shred(scope):
            self.settle()

    def expire(self, ttl_of: Callable[[str], float | None]) -> None:
        """`ReuseManager.expire`; a hot working cache among the expired state is wiped now."""
        if self.reuse.expire(ttl_of):
            self.settle()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutcome:
        """Execute one step as `plan` orders it: followers copy their donors' rows, the chunks run, the decoding
        sequences step; then every planned sequence that ended leaves (its last token fed, its state stored, its
        result made), in the order the sequences started. A sequence whose work raises leaves at once with its
        error, nothing of it stored (a failed decode step fails each of its rows); the others go on."""
        failed: dict[Sequence, Exception] = {}

        def fail(seqs: list[Sequence], exc: Exception) -> None:
            for seq in seqs:
                self.release(seq)
                failed[seq] = exc

        waiting = set()
        for seq in plan.follow:
            try:
                if self.reuse.follow(seq):
                    waiting.add(seq)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                fail([seq], exc)
        for seq in plan.prefill:
            if seq in failed or seq in waiting or seq.done or not seq.prefilling:
                continue
            try:
                self.prefill(seq)
            except Exception as exc:  # noqa: BLE001
                fail([seq], exc)
        decoding = [seq for seq in plan.decode if seq not in failed and not seq.done and not seq.prefilling]
        if decoding:
            try:
                self.decode(decoding)
            except Exception as exc:  # noqa: BLE001 - the step's rows fail, the others go on
                fail(decoding, exc)
        planned = {*plan.retire, *plan.follow, *plan.prefill, *plan.decode}
        ended = [seq for seq in self._live.values() if seq.done and seq in planned]
        trouble = None
        try:
            self.feed_last(ended)
        except Exception as exc:  # noqa: BLE001 - they are stored without it, or not at all
            trouble = exc
        finished = []
        for seq in ended:
            try:
                finished.append((seq, self.finish(seq)))
            except Exception as exc:  # noqa: BLE001
                fail([seq], exc)
        return StepOutcome(tuple(finished), tuple(failed.items()), trouble)

    # -- one sequence, step by step ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, request: GenerationRequest, emit: Callable[[str], Any], cancelled: Callable[[], bool],
              queue_wait_s: float = 0.0, lane: int = 0) -> Sequence:
        """Begin `request` in `lane` (free): restore its prefix state and plan its prefill. A request not stamped
        when it was accepted (`GenerationRequest.stamp`) is stamped now."""
        assert lane not in self._live, "a lane runs one sequence at a time"
        started = time.perf_counter()
        if request.stamp is None:
            request = replace(request, stamp=self.reuse.shreds.now)
        params, prompt = request.params, request.prompt
        got = self.reuse.begin(request, lane)
        stops = sorted(set(got.wanted) | set(range(got.length + self.prefill_chunk, len(prompt), self.prefill_chunk))
                       | {len(prompt)})
        if request.media is not None:
            stops = request.media.chunk_stops(stops)  # no chunk ends inside an image that attends both ways
        seq = Sequence(request=request, emit=emit, cancelled=cancelled, queue_wait_s=queue_wait_s, lane=lane,
                       started=started, cache=got.cache, restored=got.length, matched=got.matched,
                       stops=[stop for stop in stops if stop > got.length], wanted=frozenset(got.wanted),
                       sampler=Sampler(params), detok=Detokenizer(self.loaded.tokenizer, params.stop),
                       scratch=got.scratch, position=got.length, opening=got.opening, donor=got.donor,
                       media=got.media, encoded=got.encoded, encode_s=got.encode_s)
        self._live[lane] = seq
        return seq

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> None:
        """Run the next chunk of `seq`'s prompt; after the last, choose its first token."""
        stop = seq.stops.pop(0)
        seq.prediction = self.forward.prefill(seq.request.prompt[seq.position:stop], seq.position, seq.cache,
                                              seq.media)
        if not self._opened_all(seq, restart=True):
            return
        seq.position = stop
        if stop in seq.wanted and self.loaded.state is not None:
            seq.snapshots[stop] = self.loaded.state.snapshot(seq.cache)
        if not seq.prefilling and not seq.done:
            self._choose(seq)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> None:
        """One decode step of every sequence in `seqs` (each has chosen a token not yet run), as the forward runs
        it (`Forward.decode`: one batched forward where it can); then each chooses its next token."""
        self.decode_steps += 1
        predictions, together = self.forward.decode(
            self._batched, [seq.output[-1] for seq in seqs],
            [_position(seq) for seq in seqs], [seq.cache for seq in seqs],
            lambda: self._kinship.groups(seqs, self._live), [seq.sampler.params.argmax_only for seq in seqs])
        if together:
            self.batched_steps += 1
            self.largest_batch = max(self.largest_batch, len(seqs))
        for seq, prediction in zip(seqs, predictions, strict=True):
            seq.prediction = prediction
            self._choose(seq)

    def _choose(self, seq: Sequence) -> None:
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

    def release(self, seq: Sequence) -> None:
        """`seq` leaves its lane (ended, or failed: then nothing of it is stored): the state it opened elsewhere
        is zeroed, the rows it wrote are counted."""
        if not self._opened_all(seq, restart=False):
            seq.discard, seq.restored = True, 0  # its rows did not open: nothing of it is stored or billed read
        self._live.pop(seq.lane, None)
        seq.donor = None
        self._kinship.leave(seq.lane)
        self.reuse.vacate(seq)
        if seq.media is not None:
            seq.media.wipe()

    def _opened_all(self, seq: Sequence, restart: bool) -> bool:
        """`ReuseManager.finish_opening`. False when an entry failed to open; with `restart` the request then
        starts over in its lane without it, as after a failed restore."""
        if self.reuse.finish_opening(seq):
            return True
        if restart:
            del self._live[seq.lane]
            again = self.start(seq.request, seq.emit, seq.cancelled, seq.queue_wait_s, seq.lane)
            if seq.media is not None:
                seq.media.wipe()
            for name in ("cache", "restored", "matched", "stops", "wanted", "scratch", "position", "opening",
                         "donor", "snapshots", "prediction", "media"):
                setattr(seq, name, getattr(again, name))
            seq.encoded += again.encoded
            seq.encode_s += again.encode_s
            self._live[seq.lane] = seq
        return False

    @torch.inference_mode()
    def feed_last(self, seqs: list[Sequence]) -> None:
        """Run the last sampled token of ended sequences that store their state, together where the forward can
        (`Forward.feed`; `finish` then stores them as they are), else leave it to `finish`, one forward each.
        Requests of a wave end in the same step."""
        feed = [seq for seq in seqs if self.reuse.awaits_last_token(seq)]
        if len(feed) < 2:
            return
        try:
            fed = self.forward.feed(self._batched, [seq.output[-1] for seq in feed],
                                    [_position(seq) for seq in feed],
                                    [seq.cache for seq in feed], lambda: self._kinship.groups(feed, self._live))
        except BaseException:
            for seq in feed:
                seq.discard = True  # their caches may be part written: nothing of them is stored
            raise
        if fed:
            self.fed_together += len(feed)
            for seq in feed:
                seq.fed = True

    @torch.inference_mode()
    def finish(self, seq: Sequence) -> GenerationResult:
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
            self.forward.extend([output[-1]], _position(seq), seq.cache)
        written = self.reuse.end(seq)  # prompt tokens newly stored and still held
        return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=seq.restored,
                                cached_write_tokens=written or 0, cached_write_1h_tokens=seq.written.get("1h", 0),
                                cached_write_24h_tokens=seq.written.get("24h", 0), output_ids=output,
                                text=seq.detok.text,
                                finish_reason=seq.finish_reason or "length", queue_wait_s=seq.queue_wait_s,
                                ttft_s=seq.ttft, retained=written is not None, matched_tokens=matched,
                                attachments_encoded=seq.encoded, encode_s=seq.encode_s,
                                stop_sequence=seq.detok.matched if seq.finish_reason == "stop" else None,
                                attachments_reused=0 if seq.media is None else len(seq.media.media.items) - seq.encoded)

    def generate(self, request: GenerationRequest, emit: Callable[[str], Any],
                 cancelled: Callable[[], bool], queue_wait_s: float = 0.0, lane: int = 0) -> GenerationResult:
        """Run one request alone, a step at a time; `emit` gets each text delta as soon as it is safe to send."""
        seq = self.start(request, emit, cancelled, queue_wait_s, lane)
        while True:
            outcome = self.run(StepPlan(prefill=(seq,), decode=(seq,)))
            for _, exc in outcome.failed:
                raise exc
            for _, result in outcome.finished:
                return result


def _position(seq: Sequence) -> int:
    """The position id of `seq`'s last sampled token: its index, shifted where the prompt's attachments take
    other positions than their indices (`GenerationRequest.shift`)."""
    return len(seq.request.prompt) + len(seq.output) - 1 + seq.request.shift
