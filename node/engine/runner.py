"""The node's own prefill/decode loop on the transformers cache API, with prefix-state reuse.

Each request is a `Running` sequence in a lane of working buffers: restore the leased prefix state, prefill the rest
of the prompt in chunks, decode, feed the last generated token so the reply's state is complete, and store
the new state for the caller. The scheduler runs many sequences together: per step, prefill chunks of some
(`prefill`) and one decode step of every decoding sequence (`decode`, batched where the model allows: see
`batch_forward.py` and BATCHING.md); `generate` runs one sequence alone. Within one scope, and never across
scopes, a request copies prompt rows another running request holds (`follow`), and decoding sequences that
hold the same first rows attend them once per step (`kinship.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from cache.adapters import Snapshot
from cache.arena import Borrowed, Scope, SealCost, SealedEntryError, StateArena
from cache.opening import Opening
from cache.prefix_cache import PrefixCache, StoreResult, belongs_to
from cache.radix_tree import common_prefix_length
from cache.replies import ReplyBook
from cache.snapshot_policy import SnapshotPolicy
from cache.token_digest import DigestRun
from cache.working_cache import ROWS_GRAIN
from node.engine.batch_forward import batch_blocker, batchable
from node.engine.detokenizer import Detokenizer
from node.engine.kinship import FOLLOW_MIN, Kinship, best_donor, copied_snapshots, copy_rows, held_state
from node.engine.loader import LoadedModel
from node.engine.sampling import Sampler, SamplingParams
from node.engine.seal_cost import measure_seal_cost
from node.engine.sequence import NO_FORMS, GenerationRequest, GenerationResult, PrefixForms, Running

__all__ = ["NO_FORMS", "GenerationRequest", "GenerationResult", "PrefixForms", "Runner", "Running"]


class Runner:
    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None, prefill_chunk: int = 1024,
                 policy: SnapshotPolicy | None = None, seal_cost: SealCost | None = None) -> None:
        """`seal_cost` None: measured now when stored state is sealed (`seal_cost.py`)."""
        self.loaded = loaded
        self.policy = policy or SnapshotPolicy()
        self.prefix_cache = prefix_cache if loaded.state is not None else None
        self.arena: StateArena | None = None
        if self.prefix_cache is not None and loaded.state is not None:
            assert isinstance(self.prefix_cache.arena, StateArena)
            self.arena = self.prefix_cache.arena
            if seal_cost is None and self.arena.sealer is not None:
                seal_cost = measure_seal_cost(loaded, self.arena.sealer)
            self.arena.register_model(loaded.model_id, loaded.state, seal_cost)
            self.prefix_cache.register_model(loaded.model_id, loaded.state.needs_snapshots)
        self.seal_cost = seal_cost
        self.keeps_state = (self.arena is not None and (seal_cost is None or seal_cost.model_worth_sealing
                                                         or self.arena.plaintext_bytes > 0))
        """False: the model computes its state faster than the node opens it, and no hot tier would hold it
        plaintext; requests store nothing (billed without cached writes, `retained` false), as under retention
        none."""
        self.prefill_chunk = prefill_chunk
        self.replies = ReplyBook()
        """The replies generated for callers whose state is kept, sealed (`cache/replies.py`): kept with reuse off
        too, so that a conversation's prompts, and so its outputs, are the same with reuse on and off."""
        self._hot: tuple[int, Scope, DigestRun] | None = None
        """(lane, scope, the digests of the tokens whose rows the lane still holds) after a request was stored."""
        """The lane, scope and tokens whose state the lane's buffers hold from the last finished request: the
        hot working cache."""
        self._dirty: dict[int, int] = {}
        """Per lane, rows of its working buffers written since they were last wiped."""
        self._live: dict[int, Running] = {}
        """Running sequences by lane."""
        self._kinship = Kinship()
        self._batched = loaded.forward.batched_decode()
        self.batching = batch_blocker(loaded.model)
        """Why decode steps of several sequences cannot run as one forward on this model (None: they do)."""
        self.decode_steps = 0
        self.batched_steps = 0
        """Decode steps that ran several sequences in one forward."""
        self.largest_batch = 0
        self.fed_together = 0
        self.lane_rows = 0
        """Token rows each lane's buffers were given at start (`reserve_lanes`)."""
        """Ended requests whose last token ran in one forward with others' (`feed_last`)."""

    def reserve_lanes(self, lanes: int, budget: int) -> int:
        """At start: give `lanes` lanes working buffers of as many token rows as `budget` bytes allow in all (whole
        grains of `ROWS_GRAIN`, at most the model's context), written with zeros. A lane's first request would
        otherwise fault its buffers' pages in on its time to first token: 15 to 90 ms per 31 MiB on a VM
        (BATCHING.md, "Memory: lanes"). Returns the rows each lane holds (0: nothing reserved; lanes then
        allocate when first used). Lanes still grow past it when a request needs more."""
        state = self.loaded.state
        if state is None or lanes <= 0 or budget <= 0:
            return 0
        if not state.lane_row_bytes(0):
            # Learn the buffers' shapes (heads, head dim, dtype per layer) from one token run in lane 0.
            with torch.inference_mode():
                cache, _ = state.new_cache(1, lane=0)
                self.loaded.forward.prefill([0], 0, cache)
                state.wipe_pool(0, 1, lane=0)
        row_bytes = state.lane_row_bytes(0)
        if not row_bytes:
            return 0  # no layer keeps K/V rows in lane buffers (recurrent models)
        rows = min(budget // (lanes * row_bytes), self.loaded.context_length) // ROWS_GRAIN * ROWS_GRAIN
        if rows:
            state.reserve_lanes(lanes, rows)
        self.lane_rows = rows
        return rows

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

    def sealing_config(self) -> dict[str, Any]:
        """For anyone (`GET /v1/node`): whether stored state is sealed and how; fixed at start, so that it says
        nothing of other callers' traffic."""
        arena = self.arena
        if arena is None or arena.sealer is None:
            return {"on": False, "reason": "reuse is off: nothing is stored" if arena is None else
                    "started with --no-seal"}
        return {"on": True, "cipher": "AES-256-GCM",
                "keys": "one per scope (caller, model): HKDF-SHA256 of a boot master key held in memory only",
                "master_key_locked": arena.sealer.master_locked, "open_threads": arena.sealer.threads,
                "hot_tier_bytes": arena.plaintext_bytes, "reserve_bytes": arena.memory.reserved_bytes,
                **self._seal_cost_state()}

    def sealing_state(self) -> dict[str, Any]:
        """For operators (`GET /v1/node/state`): `sealing_config` and what the tiers hold now (entries, bytes
        sealed and in the clear, failures), which grows with every caller's stored tokens."""
        return {**self.sealing_config(), **(self.arena.describe() if self.arena is not None else {})}

    def _seal_cost_state(self) -> dict[str, Any]:
        cost = self.seal_cost
        if cost is None:
            return {}
        # Measured at load; an entry whose bytes open slower than its tokens compute is dropped, not sealed.
        return {"open_ms_per_mib": round(cost.open_s_per_byte * 2**20 * 1e3, 4),
                "recompute_ms_per_token": round(cost.recompute_s_per_token * 1e3, 4), "keeps_state": self.keeps_state}

    @property
    def reuse_enabled(self) -> bool:
        return self.prefix_cache is not None

    @property
    def resumes_anywhere(self) -> bool:
        """Every position the stored spans cover is a resume point (`PrefixCache.acquire`'s `anywhere`)."""
        return not self._takes_snapshots

    @property
    def _takes_snapshots(self) -> bool:
        state = self.loaded.state
        return (self.prefix_cache is not None and state is not None
                and (state.needs_snapshots or not self.policy.anywhere))

    @torch.inference_mode()
    def prompt_logits(self, scope: Scope, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Last-position logits of `prompt` with reuse as configured, then store its state; for tests.

        Returns (logits `[vocab]`, tokens restored).
        """
        seq = self.start(GenerationRequest(scope, prompt, SamplingParams(max_tokens=1)), lambda _: None,
                         lambda: False, lane=0, sample=False)
        while seq.prefilling:
            self.prefill(seq)
        assert seq.prediction is not None
        logits = seq.prediction.logits()
        self._snapshot_stored_end(seq, len(prompt))
        self.release(seq)
        self._store(seq.lane, scope, prompt, seq.cache, seq.snapshots)
        return logits, seq.restored

    def _snapshot_plan(self, prompt: list[int], boundaries: tuple[int, ...], start: int, matched: int) -> list[int]:
        if not self._takes_snapshots:
            return []
        return self.policy.prompt_positions(start, len(prompt), boundaries, branch=matched if matched > start else 0)

    def _restore(self, scope: Scope, prompt: list[int], capacity: int, lane: int,
                 donor: tuple[Running, int] | None = None
                 ) -> tuple[DynamicCache, int, int, list[torch.Tensor], Opening | None]:
        """A working cache in `lane` resumed at the deepest resume point; (cache, its length, tokens matched,
        state opened outside the lane's buffers, sealed rows still opening). Rows that `donor` (a running
        request of the scope whose prompt agrees with `prompt` for `donor[1]` tokens) holds are copied from it
        rather than opened."""
        state = self.loaded.state
        hot = self._hot[1:] if self._hot is not None and self._hot[0] == lane else None
        if hot is not None:
            self._hot = None  # the lane's buffers are about to be overwritten
        if state is None:
            return DynamicCache(config=self.loaded.model.config), 0, 0, [], None
        if self.prefix_cache is None:  # reuse off: still the working cache, which the CPU decoder writes in place
            return state.new_cache(capacity, lane=lane)[0], 0, 0, [], None
        assert self.arena is not None
        self.arena.own_borrowed()  # no-op after `settle`; the new working cache overwrites the buffers
        # At least one prompt token is always computed: its logits choose the first output token.
        run = self.prefix_cache.digest(scope, prompt)
        for _ in range(2):
            lease = self.prefix_cache.acquire(scope, run, limit=len(prompt) - 1, anywhere=self.resumes_anywhere)
            opening: Opening | None = None
            try:
                # The same scope's last request left its state in this lane's buffers: the part of the lease
                # it covers needs no copy.
                warm = min(common_prefix_length(hot[1], run), lease.length) if hot and hot[0] == scope else 0
                cache, adopted = state.new_cache(capacity, adopt=warm, lane=lane)
                held = min(donor[1], donor[0].position, lease.length) if donor is not None else 0
                if donor is not None and held > adopted:
                    # Another request of this caller holds these rows in plaintext: a copy, not an opening.
                    adopted = self._copy_rows(donor[0], cache, adopted, held, lane)
                opening = self.arena.restore(state, cache, lease.spans, skip=adopted, snapshot=lease.snapshot,
                                             position=lease.length, later=True)
                if opening is not None:
                    opening.lease = lease  # released once its rows are open
                return cache, lease.length, lease.matched, self._opened(lane), opening
            except SealedEntryError as exc:
                # Altered, moved or opened under the wrong scope: dropped and counted; this request recomputes.
                failed, opening = exc.handles, None
            finally:
                if opening is None:
                    self.prefix_cache.release(lease)
            for tensor in self._opened(lane):
                tensor.zero_()
            self.prefix_cache.discard(scope, failed)
            hot = None
        return state.new_cache(capacity, lane=lane)[0], 0, 0, [], None

    def _opened(self, lane: int) -> list[torch.Tensor]:
        """Count the rows an opening wrote in `lane`'s buffers as written; the state it opened elsewhere."""
        assert self.arena is not None
        self._dirty[lane] = max(self._dirty.get(lane, 0), self.arena.written)
        self.arena.written = 0
        return self.arena.take_scratch()

    def _store(self, lane: int, scope: Scope, tokens: Sequence[int] | DigestRun, cache: DynamicCache,
               snapshots: dict[int, Snapshot]) -> StoreResult:
        if self.prefix_cache is None or self.loaded.state is None:
            return StoreResult(len(tokens), 0)
        state = self.loaded.state
        state.materialize(cache)  # stored spans are cut from the buffers, which must hold every row
        run = self.prefix_cache.digest(scope, tokens)
        # Views of the lane's buffers: `settle` seals them from there (or copies them) before they are reused.
        result = self.prefix_cache.store(
            scope, run, lambda start, end: Borrowed(state.extract(cache, start, end, borrow=True)), snapshots)
        self._hot = (lane, scope, run)
        return result

    def pick_lane(self, scope: Scope, lanes: int) -> int:
        """A free lane among `lanes` for a request of `scope`: the one holding its hot working cache if free,
        else the lowest free lane that does not hold another scope's hot working cache."""
        hot = self._hot[0] if self._hot is not None else None
        if self._hot is not None and self._hot[1] == scope and hot not in self._live:
            return self._hot[0]
        free = [lane for lane in range(lanes) if lane not in self._live]
        assert free, "the scheduler admits no more requests than there are lanes"
        return min(free, key=lambda lane: (lane == hot, lane))

    def settle(self, stop: Callable[[], bool] = lambda: False, waiting: Callable[[], bool] | None = None) -> None:
        """Between steps and after replies: seal cold state, yielding to other work (`stop`), then zero plaintext
        that is no longer hot (rows of idle lanes beyond the hot working cache, state opened outside the lanes,
        the native forward's scratch), yielding only to requests waiting to start (`waiting`, default `stop`):
        rows a wipe leaves are zeroed by the next `settle` no request waits on, or written over by the lane's
        next request. Sealing comes first: spans stored from a lane borrow its rows until they are sealed or
        copied, which `seal_cold` does to every one of them."""
        if self.prefix_cache is not None:
            self.prefix_cache.seal_cold(stop)
        state = self.loaded.state
        if state is not None:
            for lane, dirty in list(self._dirty.items()):
                if lane not in self._live:
                    keep = len(self._hot[2]) if self._hot is not None and self._hot[0] == lane else 0
                    self._dirty[lane] = max(keep, state.wipe_pool(keep, dirty, lane, waiting or stop))
        if self.arena is not None:
            self.arena.wipe_scratch()
        self.loaded.forward.wipe_scratch()
        self._batched.wipe_scratch()

    def drop_caller(self, caller: str) -> None:
        """The caller's key was removed: its stored state (and that of the callers it acts for as a router) is
        zeroed, its keys destroyed, its hot working cache wiped, its replies forgotten."""
        self.replies.drop(lambda scope: belongs_to(scope, caller))
        for seq in self._live.values():
            if belongs_to(seq.request.scope, caller):
                seq.discard = True  # nothing of it is stored when it ends
        if self.prefix_cache is None:
            return
        dropped = self.prefix_cache.drop_caller(caller)
        if self._hot is not None and (self._hot[1] in dropped or belongs_to(self._hot[1], caller)):
            self._hot = None
            self.settle()

    def expire(self, ttl_of: Callable[[str], float | None]) -> None:
        """Destroy the state and replies of scopes unused for longer than their caller's time to live."""
        self.replies.expire(ttl_of)
        if self.prefix_cache is None:
            return
        expired = self.prefix_cache.expire(ttl_of)
        if self._hot is not None and self._hot[1] in expired:
            self._hot = None
            self.settle()

    # -- one sequence, step by step ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, request: GenerationRequest, emit: Callable[[str], Any], cancelled: Callable[[], bool],
              queue_wait_s: float = 0.0, lane: int = 0, sample: bool = True) -> Running:
        """Begin `request` in `lane` (free): restore its prefix state and plan its prefill."""
        assert lane not in self._live, "a lane runs one sequence at a time"
        started = time.perf_counter()
        params, prompt = request.params, request.prompt
        donor = self._donor(request)
        cache, restored, matched, scratch, opening = self._restore(
            request.scope, prompt, len(prompt) + params.max_tokens, lane, donor)
        snapshot_at = self._snapshot_plan(prompt, request.boundaries, restored, matched)
        stops = sorted(set(snapshot_at) | set(range(restored + self.prefill_chunk, len(prompt), self.prefill_chunk))
                       | {len(prompt)})
        seq = Running(request=request, emit=emit, cancelled=cancelled, queue_wait_s=queue_wait_s, lane=lane,
                       started=started, cache=cache, restored=restored, matched=matched,
                       stops=[stop for stop in stops if stop > restored], wanted=frozenset(snapshot_at),
                       sampler=Sampler(params), detok=Detokenizer(self.loaded.tokenizer, params.stop),
                       scratch=scratch, position=restored, opening=opening)
        if donor is not None and donor[1] >= restored + FOLLOW_MIN:
            seq.donor = donor  # it computes more of this prompt than was stored: `follow` copies it
        self._live[lane] = seq
        if not sample:
            seq.finish_reason = "length"  # prompt_logits: the prompt's logits, no reply
        return seq

    def _donor(self, request: GenerationRequest) -> tuple[Running, int] | None:
        """`kinship.best_donor` of the running requests, where state can be copied between requests (not with
        reuse off or retention none)."""
        if self.prefix_cache is None or not request.retain:
            return None
        return best_donor(request, [seq for seq in self._live.values() if seq.opening is None])

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
        end, snapshot, state = min(common, donor.position), None, self.loaded.state
        assert state is not None
        if state.needs_snapshots:
            end, snapshot = held_state(donor, seq.position, common, state)
        if end > seq.position:
            start = seq.position
            seq.position = seq.restored = self._copy_rows(donor, seq.cache, start, end, seq.lane)
            seq.stops = [stop for stop in seq.stops if stop > end]
            if snapshot is not None:
                state.restore_snapshot(seq.cache, snapshot, end)
            seq.snapshots.update(copied_snapshots(donor, seq, start, end, state))
        if seq.position >= common or not donor.prefilling:
            seq.donor = None
            return False
        return True

    def _copy_rows(self, donor: Running, cache: DynamicCache, start: int, end: int, lane: int) -> int:
        """`kinship.copy_rows` into `lane`, whose written rows it counts; returns `end`."""
        assert self.loaded.state is not None
        copy_rows(donor, cache, start, end, self.loaded.state.specs)
        self._dirty[lane] = max(self._dirty.get(lane, 0), end)
        return end

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
        for tensor in seq.scratch:
            tensor.zero_()
        seq.scratch.clear()
        written = seq.position + len(seq.output)
        self._dirty[seq.lane] = max(self._dirty.get(seq.lane, 0), written)

    def _opened_all(self, seq: Running, restart: bool) -> bool:
        """Finish the opening of `seq`'s sealed rows (its first chunk has read them as they opened) and release
        their lease. False when an entry failed to open: it is dropped and counted, and with `restart` the
        request starts over in its lane without it, as after a failed restore."""
        opening, seq.opening = seq.opening, None
        if opening is None:
            return True
        try:
            opening.finish()
            return True
        except SealedEntryError as exc:
            failed = exc.handles
        finally:
            assert self.prefix_cache is not None
            self.prefix_cache.release(opening.lease)
        for tensor in seq.scratch:
            tensor.zero_()
        self.prefix_cache.discard(seq.request.scope, failed)
        if restart:
            del self._live[seq.lane]
            again = self.start(seq.request, seq.emit, seq.cancelled, seq.queue_wait_s, seq.lane)
            for name in ("cache", "restored", "matched", "stops", "wanted", "scratch", "position", "opening",
                         "donor", "snapshots", "prediction"):
                setattr(seq, name, getattr(again, name))
            self._live[seq.lane] = seq
        return False

    def _stores_reply(self, seq: Running) -> bool:
        """Whether `finish` stores `seq`'s state with its last sampled token, which has not run yet."""
        return (seq.request.retain and self.keeps_state and not seq.discard and not seq.prefilling
                and bool(seq.output) and not seq.fed and self.prefix_cache is not None)

    @torch.inference_mode()
    def feed_last(self, seqs: Sequence[Running]) -> None:
        """Run the last sampled token of ended sequences that store their state, as one batched forward without
        the head where their caches allow it (`finish` then stores them as they are); else leave it to `finish`,
        one forward each. Requests of a wave end in the same step."""
        feed = [seq for seq in seqs if self._stores_reply(seq)]
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
        """`seq` has ended: feed its last token, store its state for the caller, and account for it."""
        request, prompt, output = seq.request, seq.request.prompt, seq.output
        tail = seq.detok.flush()
        if tail:
            seq.emit(tail)
        self.release(seq)
        fed = prompt + output
        matched = min(max(seq.matched, seq.restored), len(prompt) - 1)
        if request.retain and not seq.discard and not seq.prefilling:
            self._record_reply(seq)
        if not (request.retain and self.keeps_state) or seq.discard:
            return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=seq.restored,
                                    cached_write_tokens=0, output_ids=output, text=seq.detok.text,
                                    finish_reason=seq.finish_reason or "length", queue_wait_s=seq.queue_wait_s,
                                    ttft_s=seq.ttft, retained=False, matched_tokens=matched)
        if seq.prefilling:
            fed = prompt[:seq.position]  # cancelled before its prompt was computed: what was computed is kept
        elif output and self.prefix_cache is not None:
            if not seq.fed:
                # The last token was sampled but not yet run: run it so the stored state ends with the reply.
                self.loaded.forward.extend([output[-1]], len(fed) - 1, seq.cache)
            self._snapshot_stored_end(seq, len(fed))
        # One run of digests for the index, the hot working cache and the remembered forms.
        held = self.prefix_cache.digest(request.scope, fed) if self.prefix_cache is not None else fed
        stored = self._store(seq.lane, request.scope, held, seq.cache, seq.snapshots)
        forms = request.forms
        if self.prefix_cache is not None and not seq.prefilling and (forms.at or forms.reply is not None):
            reply_end = () if forms.reply is None else ((len(held), forms.reply(seq.detok.text)),)
            self.prefix_cache.record_forms(request.scope, held, forms.at + reply_end)
        # Prompt tokens among those newly stored and still held.
        written = max(0, min(len(prompt), stored.start + stored.stored) - stored.start)
        return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=seq.restored,
                                cached_write_tokens=written, output_ids=output, text=seq.detok.text,
                                finish_reason=seq.finish_reason or "length", queue_wait_s=seq.queue_wait_s,
                                ttft_s=seq.ttft, matched_tokens=matched)

    def _snapshot_stored_end(self, seq: Running, end: int) -> None:
        """The end of everything `seq` stores (its reply's, or a bare prompt's) is a resume point."""
        if self._takes_snapshots and self.policy.reply_end and self.loaded.state is not None:
            seq.snapshots[end] = self.loaded.state.snapshot(seq.cache)

    def _record_reply(self, seq: Running) -> None:
        """Remember `seq`'s reply for its scope when its text is exactly its ids decoded (with no stop string cut
        from it, no special token inside it): a conversation that sends the text back is then given the ids."""
        ids = seq.output
        while ids and ids[-1] in self.loaded.eos_token_ids:
            ids = ids[:-1]
        if ids and self.loaded.tokenizer.decode(ids, skip_special_tokens=False) == seq.detok.text:
            self.replies.record(seq.request.scope, seq.detok.text, ids)

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
