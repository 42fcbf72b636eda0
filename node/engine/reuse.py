"""Model state between requests: what a request resumes from, and what it leaves for its caller's next one.

vLLM's KV cache manager in spirit. The runner runs sequences; this manager decides what of them outlives them:
`begin` restores the deepest stored prefix of a request's prompt into its lane (copying the rows a running request
of the same caller holds rather than opening them, where `kinship.py` finds one; `follow` goes on copying
while that request computes), `end` stores what the request computed (with snapshots where the snapshot policy
asks), `settle` seals cold state and wipes what idle lanes still hold, and `shred`, `drop_caller` and `expire`
destroy a scope's or a caller's state (a request accepted before a shred stores nothing in the shredded scope,
`shredded`). It also keeps the reply book and the lanes (`cache/lanes.py`), which outlive requests, and tells
them which rows of a lane are the last stored request's (the hot working cache, which the next request of that
caller starts from without a copy) and which may be wiped. Plaintext of one caller is never handed to another:
every copy between running requests, and every adoption of a lane's rows, is within one scope. The one state
read across callers is a trust group's shared prefix (`GenerationRequest.shared`): stored in the group's own
scope, and looked up there only for a request its member sent asking for it (membership checked per request).
"""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from cache.adapters import Snapshot
from cache.arena import Borrowed, Scope, SealCost, SealedEntryError, StateArena
from cache.encodings import EncodingCache
from cache.lanes import Lanes
from cache.opening import Opening
from cache.prefix_cache import Hold, PrefixCache, ReuseLease, StoreResult, belongs_to
from cache.radix_tree import common_prefix_length
from cache.replies import ReplyBook
from cache.scope import SharedPrefix
from cache.sealing import Sealer
from cache.shred_clock import ShredClock
from cache.snapshot_policy import SnapshotPolicy
from cache.token_digest import DigestRun
from node.engine.kinship import FOLLOW_MIN, best_donor, copied_snapshots, copy_rows, held_state
from node.engine.loader import LoadedModel
from node.engine.media import PromptMedia, SequenceMedia
from node.engine.seal_cost import measure_seal_cost
from node.engine.sequence import GenerationRequest, Sequence


@dataclass(frozen=True, slots=True)
class Restored:
    """What `begin` hands a request starting in a lane; the runner's `Sequence` is built from it."""

    cache: DynamicCache
    """The lane's working cache, holding the prompt's state up to `length`."""
    length: int
    """Prompt tokens restored (opened from stored state, adopted from the lane's hot rows, copied from a running
    request of the caller) instead of computed: at most all but the last, whose logits choose the first token."""
    matched: int
    """Prompt tokens that agreed with the scope's stored tokens; beyond `length` only between snapshots."""
    scratch: list[torch.Tensor]
    """State opened outside the lane's buffers; zeroed when the request leaves its lane (`vacate`)."""
    opening: Opening | None
    """Sealed rows still opening: the first prefill chunk reads them as they open (`finish_opening`)."""
    donor: tuple[Sequence, int] | None
    """A running request of the caller that computes at least FOLLOW_MIN more of this prompt than was restored,
    and how far they agree: `ReuseManager.follow` copies its rows rather than computing them."""
    wanted: list[int]
    """Prompt positions to snapshot the state at (the snapshot policy's), so that what is stored resumes there."""
    media: SequenceMedia | None = None
    """The prompt's attachments, with the encodings of those its prefill reads."""
    encoded: int = 0
    """Attachments encoded for it (`ReuseManager._media`)."""
    encode_s: float = 0.0
    """Seconds its attachments' encoding (and encoding cache lookups) took, when any was encoded."""


@dataclass(frozen=True, slots=True)
class HotLane:
    """The last stored request's state, still in its lane's buffers: the scope's next request there adopts it."""

    lane: int
    scope: Scope
    run: DigestRun
    """The digests of the tokens whose rows the lane holds."""


class ReuseManager:
    """Restores, stores, seals and wipes the state of one model's requests; the runner calls it on the engine's
    worker thread, which alone touches the prefix index, the arena and the lanes' buffers."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None, live: Mapping[int, Sequence],
                 policy: SnapshotPolicy | None = None, seal_cost: SealCost | None = None) -> None:
        """`live`: the runner's running sequences by lane (read here, never changed). `seal_cost` None: measured
        now when stored state is sealed (`seal_cost.py`)."""
        self.loaded = loaded
        self.lanes = Lanes(loaded.state.working_cache) if loaded.state is not None else None
        """The working memory of the running sequences, one lane each; None without a state adapter."""
        self.policy = policy or SnapshotPolicy()
        self.prefix_cache = prefix_cache if loaded.state is not None else None
        self.arena: StateArena | None = None
        if self.prefix_cache is not None and loaded.state is not None:
            assert isinstance(self.prefix_cache.arena, StateArena)
            self.arena = self.prefix_cache.arena
            if seal_cost is None and self.arena.sealer is not None:
                assert self.lanes is not None
                seal_cost = measure_seal_cost(loaded, self.arena.sealer, self.lanes, self.arena.host_copies)
            self.arena.register_model(loaded.model_id, loaded.state, seal_cost)
            self.prefix_cache.register_model(loaded.model_id, loaded.state.needs_snapshots)
        self.seal_cost = seal_cost
        self.keeps_state = (self.arena is not None and (seal_cost is None or seal_cost.model_worth_sealing
                                                         or self.arena.plaintext_bytes > 0))
        """False: the model computes its state faster than the node opens it, and no hot tier would hold it
        plaintext; requests store nothing (billed without cached writes, `retained` false), as under retention
        none."""
        self.replies = ReplyBook()
        """The replies generated for callers whose state is kept, sealed (`cache/replies.py`): kept with reuse off
        too, so that a conversation's prompts, and so its outputs, are the same with reuse on and off."""
        self.shreds = ShredClock()
        """When each scope was last shredded: a request accepted before stores nothing in it (`shredded`)."""
        self._live = live
        self._hot: HotLane | None = None
        self.encodings: EncodingCache | None = None
        """The scopes' attachment encodings (`cache/encodings.py`), for a model that takes attachments and keeps
        state: sealed under their own sealer's keys where stored state is sealed."""
        if loaded.media is not None and self.arena is not None and self.keeps_state:
            sealer = Sealer(self.arena.sealer.threads) if self.arena.sealer is not None else None
            self.encodings = EncodingCache(sealer, host_copies=self.arena.host_copies)
        self._encoder = loaded.media.encoder if loaded.media is not None else ""

    def reserve_lanes(self, lanes: int, budget: int, contiguous: bool = False) -> int:
        """At start: give `lanes` lanes working buffers of as many token rows as `budget` bytes allow in all (whole
        grains of `ROWS_GRAIN`, at most the model's context), written with zeros (`Lanes.reserve`). The buffers
        outlive requests, as the hot working cache in them does; a lane's first request would otherwise fault
        their pages in on its time to first token (BATCHING.md, "Memory: lanes"). Returns the rows each lane
        holds (0: nothing reserved; lanes then allocate when first used). Lanes still grow past it when a
        request needs more. `contiguous`: as one slab per layer (`Lanes.slabs`), which static decode steps read."""
        if self.lanes is None:
            return 0
        forward = self.loaded.forward
        return self.lanes.reserve(lanes, budget, self.loaded.context_length,
                                  lambda cache: forward.prefill([0], 0, cache), contiguous=contiguous)

    @property
    def lane_rows(self) -> int:
        """Token rows each lane's buffers were given at start (`reserve_lanes`)."""
        return 0 if self.lanes is None else self.lanes.rows

    # -- what anyone may read -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
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

    def warm_forms(self, select: Callable[[Scope], bool]) -> list[tuple[Scope, bytes]]:
        """The remembered prefix forms of the scopes `select` takes that the node can still resume
        (`PrefixCache.warm_forms`); none with reuse off."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.warm_forms(select, self.resumes_anywhere)

    # -- a request starts -----------------------------------------------------------------------------------

    def pick_lane(self, scope: Scope, lanes: int) -> int:
        """A free lane among `lanes` for a request of `scope`: the one holding its hot working cache if free,
        else the lowest free lane that does not hold another scope's hot working cache."""
        hot = self._hot.lane if self._hot is not None else None
        if self._hot is not None and self._hot.scope == scope and hot not in self._live:
            return self._hot.lane
        free = [lane for lane in range(lanes) if lane not in self._live]
        assert free, "the scheduler admits no more requests than there are lanes"
        return min(free, key=lambda lane: (lane == hot, lane))

    def begin(self, request: GenerationRequest, lane: int) -> Restored:
        """Restore the deepest resume point of `request`'s prompt into `lane` (free), and plan its snapshots.

        Takes the request and its lane rather than its `Sequence`, which holds the working cache made here."""
        prompt = request.prompt
        donor = self._donor(request)
        if donor is not None and request.media is not None:
            donor = (donor[0], request.media.resume_limit(donor[1]))
        cache, length, matched, scratch, opening = self._restore(
            request.scope, request.keys, len(prompt) + request.params.max_tokens, lane, donor, request.media,
            request.shared)
        wanted = self._snapshot_plan(prompt, request.boundaries, length, matched)
        if request.media is not None:
            wanted = [position for position in wanted if request.media.inside(position) is None]
        if donor is not None and donor[1] < length + FOLLOW_MIN:
            donor = None  # it computes too little of this prompt beyond what was restored to be followed
        started = time.perf_counter()
        media, encoded = self._media(request, length)
        return Restored(cache, length, matched, scratch, opening, donor, wanted, media, encoded,
                        time.perf_counter() - started if encoded else 0.0)

    def _media(self, request: GenerationRequest, restored: int) -> tuple[SequenceMedia | None, int]:
        """The encodings of `request`'s attachments that its prefill reads (those not wholly restored): found in the
        scope's encoding cache, else encoded now (and kept there); and how many were encoded."""
        if request.media is None:
            return None, 0
        forward, media = self.loaded.forward, request.media
        held = SequenceMedia(media)
        encoded = 0
        kept = self.encodings if request.retain and not self.shredded(request, request.scope) else None
        for index, item in enumerate(media.items):
            if item.end <= restored:
                continue
            found = None
            if kept is not None:
                found = kept.get(request.scope, item.digest, self._encoder)
            if found is None:
                found = forward.encode(item.inputs)
                encoded += 1
                if kept is not None:
                    kept.put(request.scope, item.digest, self._encoder, found)
            held.encodings[index] = found
        return held, encoded

    def _donor(self, request: GenerationRequest) -> tuple[Sequence, int] | None:
        """`kinship.best_donor` of the running requests, where state can be copied between requests (not with
        reuse off or retention none), never from one accepted before its scope was shredded: a caller's first
        request after its `DELETE /v1/cache` reads nothing of what it sent before."""
        if self.prefix_cache is None or not request.retain:
            return None
        return best_donor(request, [seq for seq in self._live.values()
                                    if seq.opening is None and not self.shredded(seq.request, seq.request.scope)])

    def _snapshot_plan(self, prompt: list[int], boundaries: tuple[int, ...], start: int, matched: int) -> list[int]:
        if not self._takes_snapshots:
            return []
        return self.policy.prompt_positions(start, len(prompt), boundaries, branch=matched if matched > start else 0)

    def _restore(self, scope: Scope, prompt: list[int], capacity: int, lane: int,
                 donor: tuple[Sequence, int] | None = None, media: PromptMedia | None = None,
                 shared: SharedPrefix | None = None
                 ) -> tuple[DynamicCache, int, int, list[torch.Tensor], Opening | None]:
        """A working cache in `lane` resumed at the deepest resume point; (cache, its length, tokens matched,
        state opened outside the lane's buffers, sealed rows still opening). Rows that `donor` (a running
        request of the scope whose prompt agrees with `prompt` for `donor[1]` tokens) holds are copied from it
        rather than opened. `prompt` is what the index matches (`GenerationRequest.keys`); `media`'s attachments
        that attend both ways hold no resume point. `shared`: the prompt's prefix its trust group shares, resumed
        from the group's scope where that holds more of it than the caller's own."""
        state = self.loaded.state
        hot = self._hot if self._hot is not None and self._hot.lane == lane else None
        if hot is not None:
            self._hot = None  # the lane's buffers are about to be overwritten
        if state is None:
            return DynamicCache(config=self.loaded.model.config), 0, 0, [], None
        lanes = self.lanes
        assert lanes is not None
        if self.prefix_cache is None:  # reuse off: still the working cache, which the CPU decoder writes in place
            return lanes.new_cache(lane, capacity)[0], 0, 0, [], None
        assert self.arena is not None
        self.arena.own_borrowed()  # no-op after `settle`; the new working cache overwrites the buffers
        # At least one prompt token is always computed: its logits choose the first output token.
        run = self.prefix_cache.digest(scope, prompt)
        for _ in range(2):
            lease = self._acquire(scope, run, len(prompt) - 1, media)
            if shared is not None and lease.length < shared.length:
                group = self._acquire(shared.scope, self.prefix_cache.digest(shared.scope, prompt),
                                      min(shared.length, len(prompt) - 1), media)
                lease, other = (group, lease) if group.length > lease.length else (lease, group)
                self.prefix_cache.release(other)
            opening: Opening | None = None
            try:
                # The same scope's last request left its state in this lane's buffers: the part of the lease
                # it covers needs no copy.
                warm = (min(common_prefix_length(hot.run, run), lease.length)
                        if hot and hot.scope == scope == lease.scope else 0)
                cache, adopted = lanes.new_cache(lane, capacity, adopt=warm)
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
            self.prefix_cache.discard(lease.scope, failed)
            hot = None
        return lanes.new_cache(lane, capacity)[0], 0, 0, [], None

    def _acquire(self, scope: Scope, run: DigestRun, limit: int, media: PromptMedia | None) -> ReuseLease:
        """`PrefixCache.acquire` in `scope`, at most `limit` tokens in, never ending inside an attachment."""
        assert self.prefix_cache is not None
        lease = self.prefix_cache.acquire(scope, run, limit=limit, anywhere=self.resumes_anywhere)
        if media is not None and media.inside(lease.length) is not None:
            self.prefix_cache.release(lease)  # it ends inside an image: resume before the image instead
            lease = self.prefix_cache.acquire(scope, run, limit=media.resume_limit(lease.length),
                                              anywhere=self.resumes_anywhere)
        return lease

    def _opened(self, lane: int) -> list[torch.Tensor]:
        """Count the rows an opening wrote in `lane`'s buffers as written; the state it opened elsewhere."""
        assert self.arena is not None and self.lanes is not None
        self.lanes.mark_written(lane, self.arena.written)
        self.arena.written = 0
        return self.arena.take_scratch()

    def follow(self, seq: Sequence) -> bool:
        """Copy into `seq` the state its donor (a running request of its scope, agreeing with its prompt for some
        tokens, `Restored.donor`) has computed of their common prompt since `seq.position`: rows up to the donor's
        position, or for a model that resumes only at snapshots, up to where the donor holds one, or its live
        state; `seq.position`, `restored`, `stops` and `snapshots` move on with it. True while the donor is still
        computing more of it (`seq` then waits rather than computes them), False when `seq` goes on alone."""
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
            if snapshot is not None:
                state.restore_snapshot(seq.cache, snapshot, end)
            seq.snapshots.update(copied_snapshots(donor, seq, start, end, state))
            seq.stops = [stop for stop in seq.stops if stop > seq.position]
        if seq.position >= common or not donor.prefilling:
            seq.donor = None
            return False
        return True

    def _copy_rows(self, donor: Sequence, cache: DynamicCache, start: int, end: int, lane: int) -> int:
        """`kinship.copy_rows` into `lane`, whose written rows it counts; returns `end`."""
        assert self.loaded.state is not None and self.lanes is not None
        copy_rows(donor, cache, start, end, self.loaded.state.specs)
        self.lanes.mark_written(lane, end)
        return end

    def finish_opening(self, seq: Sequence) -> bool:
        """Finish the opening of `seq`'s sealed rows (its first chunk has read them as they opened) and release
        their lease. False when an entry failed to open: it is dropped and counted, and the state opened for
        `seq` is zeroed; the request then has no restored state to stand on."""
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
        self.prefix_cache.discard(opening.lease.scope, failed)
        return False

    # -- a request ends -------------------------------------------------------------------------------------

    def vacate(self, seq: Sequence) -> None:
        """`seq` has left its lane: the state opened for it elsewhere is zeroed, the rows it wrote are counted
        for `settle` to wipe."""
        for tensor in seq.scratch:
            tensor.zero_()
        seq.scratch.clear()
        if self.lanes is not None:
            self.lanes.mark_written(seq.lane, seq.position + len(seq.output))

    def remember_reply(self, seq: Sequence) -> None:
        """Remember `seq`'s reply for its scope when it keeps its state and its text is exactly its ids decoded
        (with no stop string cut from it, no special token inside it): a conversation that sends the text back
        is then given the ids. Done with reuse off too (`replies`)."""
        if not seq.request.retain or self._discards(seq) or seq.prefilling or seq.request.write.limit is not None:
            return  # with breakpoints, the reply is not stored
        ids = seq.output
        while ids and ids[-1] in self.loaded.eos_token_ids:
            ids = ids[:-1]
        if ids and self.loaded.tokenizer.decode(ids, skip_special_tokens=False) == seq.detok.text:
            self.replies.record(seq.request.scope, seq.detok.text, ids)

    def awaits_last_token(self, seq: Sequence) -> bool:
        """Whether `end` stores `seq`'s state with its last sampled token, which has not run yet: the runner runs
        it first (`Runner.feed_last` for several at once, else `Runner.finish`)."""
        return (seq.request.retain and self.keeps_state and not self._discards(seq) and not seq.prefilling
                and bool(seq.output) and not seq.fed and self.prefix_cache is not None)

    def end(self, seq: Sequence) -> int | None:
        """Store the state of `seq`, ended and out of its lane, for its caller, with its remembered prefix forms;
        returns the prompt tokens it newly stored, billed as cached writes. None when nothing of it is kept
        (retention none, its scope shredded or its caller removed since it was accepted, reuse off, or a model whose
        state is not worth keeping).
        A request cancelled while prefilling keeps what it computed.

        A request sharing a prefix with its trust group (`GenerationRequest.shared`) stores that prefix in the
        group's scope too, billed to it when the group did not hold it yet. Its own scope keeps the whole of what
        it computed, its copy of the prefix included, sealed under its own key: its next turns resume from its
        own state alone, whatever the group's holds by then, and nothing in one scope's index ever names another
        scope's entries (a reference would let one tree split or evict what another leans on). Its copy of the
        prefix is not billed as a write: the group's was. A group removed since the request was accepted gets
        nothing, and the whole is the caller's own."""
        request, prompt, output = seq.request, seq.request.keys, seq.output
        if not (request.retain and self.keeps_state) or self._discards(seq):
            return None
        assert self.prefix_cache is not None
        fed = prompt + output
        limit = request.write.limit
        if seq.prefilling:
            fed = prompt[:seq.position]
        if limit is not None:
            fed = fed[:limit]  # Anthropic's breakpoints: the prompt up to the last one, no further
        elif output and not seq.prefilling:
            self.snapshot_end(seq, len(fed))
        own, written = 0, 0
        shared = request.shared
        if shared is not None and self.shredded(request, shared.scope):
            shared = None
        if shared is not None:
            own = shared.length
            if len(fed) >= shared.length:
                group = self.prefix_cache.digest(shared.scope, fed[:shared.length])
                written = _written(self.store(seq.lane, shared.scope, group, seq.cache, seq.snapshots,
                                              request.write.holds(shared.length)), 0, shared.length, seq)
                # The group's prefixes, for the summaries of the routers of its members (under the group's id).
                at = tuple((position, form) for position, form in request.forms.at if position <= shared.length)
                if at:
                    self.prefix_cache.record_forms(shared.scope, group, at)
        # One run of digests for the index, the hot working cache and the remembered forms.
        held = self.prefix_cache.digest(request.scope, fed)
        stored = self.store(seq.lane, request.scope, held, seq.cache, seq.snapshots, request.write.holds(len(held)))
        forms = request.forms
        if not seq.prefilling and (forms.at or forms.reply is not None):
            reply_end = () if forms.reply is None else ((len(held), forms.reply(seq.detok.text)),)
            self.prefix_cache.record_forms(request.scope, held, forms.at + reply_end)
        return written + _written(stored, own, len(prompt), seq)

    def snapshot_end(self, seq: Sequence, end: int) -> None:
        """The end of everything `seq` stores (its reply's, or a bare prompt's) is a resume point."""
        if self._takes_snapshots and self.policy.reply_end and self.loaded.state is not None:
            seq.snapshots[end] = self.loaded.state.snapshot(seq.cache)

    def store(self, lane: int, scope: Scope, tokens: abc.Sequence[int] | DigestRun, cache: DynamicCache,
              snapshots: dict[int, Snapshot], holds: abc.Sequence[Hold] | None = None) -> StoreResult:
        """Store the state `cache` holds of `tokens` for `scope`, held as `holds` say (`PrefixCache.store`),
        borrowing `lane`'s buffers until `settle`; the lane becomes the scope's hot working cache."""
        if self.prefix_cache is None or self.loaded.state is None:
            return StoreResult(len(tokens), 0)
        state = self.loaded.state
        state.materialize(cache)  # stored spans are cut from the buffers, which must hold every row
        run = self.prefix_cache.digest(scope, tokens)
        # Views of the lane's buffers: `settle` seals them from there (or copies them) before they are reused.
        result = self.prefix_cache.store(
            scope, run, lambda start, end: Borrowed(state.extract(cache, start, end, borrow=True)), snapshots, holds)
        self._hot = HotLane(lane, scope, run)
        return result

    # -- between requests -----------------------------------------------------------------------------------

    def settle(self, stop: Callable[[], bool] = lambda: False, waiting: Callable[[], bool] | None = None) -> None:
        """Seal cold state, yielding to other work (`stop`), then zero plaintext that is no longer hot (rows of
        idle lanes beyond the hot working cache, state opened outside the lanes), yielding only to requests
        waiting to start (`waiting`, default `stop`): rows a wipe leaves are zeroed by the next `settle` no
        request waits on, or written over by the lane's next request. Sealing comes first: spans stored from a
        lane borrow its rows until they are sealed or copied, which `seal_cold` does to every one of them."""
        if self.prefix_cache is not None:
            self.prefix_cache.seal_cold(stop)
        if self.lanes is not None:
            hot = {self._hot.lane: len(self._hot.run)} if self._hot is not None else {}
            self.lanes.wipe_idle(self._live, hot, waiting or stop)
        if self.arena is not None:
            self.arena.wipe_scratch()

    def drop_caller(self, caller: str) -> bool:
        """The caller's key (or a trust group) was removed: `_drop` of its scopes (and of the callers it acts for as
        a router), its lookup counts forgotten; its requests accepted before store nothing (`shredded`)."""
        self.shreds.shred_caller(caller)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_caller(caller)
        return self._drop(lambda scope: belongs_to(scope, caller))

    def shred(self, scope: Scope) -> bool:
        """A caller shreds its own state (`DELETE /v1/cache`): `_drop` of `scope`; its requests accepted before,
        queued or running, store nothing in it (`shredded`), those accepted after store as usual."""
        self.shreds.shred(scope)
        return self._drop(lambda other: other == scope)

    def shredded(self, request: GenerationRequest, scope: Scope) -> bool:
        """Whether `scope` was shredded since `request` was accepted (`cache/shred_clock.py`). The one rule every
        store of a request asks, for the scope it writes: its state and snapshots, prefix forms, reply and
        attachment encodings. A request running at the shred and one still queued are judged alike, by when they
        were accepted."""
        assert request.stamp is not None, "stamped when accepted, or when it starts (ModelRunner.start)"
        return self.shreds.shredded_since(scope, request.stamp)

    def _discards(self, seq: Sequence) -> bool:
        """Nothing of `seq` is stored: its state may be part written, or its scope was shredded since it came."""
        return seq.discard or self.shredded(seq.request, seq.request.scope)

    def _drop(self, select: Callable[[Scope], bool]) -> bool:
        """The selected scopes' stored state is zeroed, their keys destroyed, their replies and encodings
        forgotten. True when the hot working cache is among them: the caller then settles, which wipes it."""
        self.replies.drop(select)
        if self.encodings is not None:
            self.encodings.drop(select)
        if self.prefix_cache is None:
            return False
        self.prefix_cache.drop(select)
        return self._cool(select)

    def expire(self, ttl_of: Callable[[str], float | None]) -> bool:
        """Destroy the stored entries unused for longer than their time to live (`PrefixCache.expire`; `ttl_of`:
        a caller's default), and the replies and encodings of scopes unused for longer than the longest time any
        of their caller's entries is held: a conversation held for a day is given its replies' ids for a day. True
        when the hot working cache lost state: the caller then settles, which wipes it."""
        prefix_cache = self.prefix_cache
        if prefix_cache is None:
            self.replies.expire(ttl_of)
            return False

        def held_for(caller: str) -> float | None:
            default = ttl_of(caller)
            return None if default is None else max(default, prefix_cache.longest_ttl(caller))

        self.replies.expire(held_for)
        if self.encodings is not None:
            self.encodings.expire(held_for)
        expired = prefix_cache.expire(ttl_of)
        return self._cool(lambda scope: scope in expired)

    def _cool(self, gone: Callable[[Scope], bool]) -> bool:
        """Forget the hot working cache if its scope is `gone`; whether it was."""
        if self._hot is None or not gone(self._hot.scope):
            return False
        self._hot = None
        return True


def _written(stored: StoreResult, start: int, end: int, seq: Sequence) -> int:
    """Tokens of `[start, end)` among those `stored` newly holds, added by class to `seq.written`."""
    low, high = max(start, stored.start), min(end, stored.start + stored.stored)
    for ttl, count in seq.request.write.written(low, high).items():
        seq.written[ttl] = seq.written.get(ttl, 0) + count
    return max(0, high - low)
