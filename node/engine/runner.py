"""The node's own prefill/decode loop on the transformers cache API, with prefix-state reuse.

One request at a time: restore the leased prefix state, prefill the rest of the prompt in chunks, decode,
feed the last generated token so the reply's state is complete, and store the new state for the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from cache.adapters import Snapshot
from cache.arena import Borrowed, Scope, SealCost, SealedEntryError, StateArena
from cache.prefix_cache import PrefixCache, StoreResult
from cache.radix_tree import common_prefix_length
from cache.snapshot_policy import SnapshotPolicy
from node.engine.detokenizer import Detokenizer
from node.engine.loader import LoadedModel
from node.engine.prediction import Prediction
from node.engine.sampling import Sampler, SamplingParams
from node.engine.seal_cost import measure_seal_cost


@dataclass(frozen=True, slots=True)
class PrefixForms:
    """What a routing summary may say of a request (`cache/summary.py`): the forms of its prompt's prefixes that
    end on a message boundary (or its whole text prompt), each at its token position, and how to form the chat
    continued by the reply (None for a text completion). SHA-256 digests of prompt content: memory only."""

    at: tuple[tuple[int, bytes], ...] = ()
    reply: Callable[[str], bytes] | None = None


NO_FORMS = PrefixForms()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    scope: Scope
    prompt: list[int]
    params: SamplingParams
    boundaries: tuple[int, ...] = ()
    """Token positions where messages of the rendered chat template start (snapshot candidates)."""
    retain: bool = True
    """Keep this request's state for reuse; False: nothing of it is stored or left hot after the reply."""
    forms: PrefixForms = NO_FORMS
    """Remembered with the stored state (when it is kept), for the caller's router's summaries."""


@dataclass(frozen=True, slots=True)
class GenerationResult:
    prompt_tokens: int
    cached_read_tokens: int
    """Prompt tokens restored from stored state instead of computed."""
    cached_write_tokens: int
    """Prompt tokens computed by this request and now held for reuse."""
    output_ids: list[int]
    text: str
    finish_reason: str
    """"stop" (end of sequence or a stop string), "length" (max_tokens) or "cancelled"."""
    queue_wait_s: float
    ttft_s: float
    retained: bool = True
    """The request's state was kept for reuse (False: retention none, nothing stored)."""
    matched_tokens: int = 0
    """Prompt tokens that agreed with this scope's stored tokens (at most all but one): what a node able to
    resume at any token would have reused. `cached_read_tokens` falls short of it only between snapshots."""


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
        # The scope and tokens whose state the working buffers hold from the last request: the hot working cache.
        self._hot: tuple[Scope, tuple[int, ...]] | None = None
        self._dirty = 0
        """Rows of the working buffers written since they were last wiped."""

    def sealing_state(self) -> dict[str, Any]:
        """For `GET /v1/node`: whether stored state is sealed, how, and what the tiers hold now."""
        arena = self.arena
        if arena is None or arena.sealer is None:
            return {"on": False, "reason": "reuse is off: nothing is stored" if arena is None else
                    "started with --no-seal"}
        return {"on": True, "cipher": "AES-256-GCM",
                "keys": "one per scope (caller, model): HKDF-SHA256 of a boot master key held in memory only",
                "master_key_locked": arena.sealer.master_locked, "open_threads": arena.sealer.threads,
                **arena.describe(), **self._seal_cost_state()}

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

    def _prefill(self, prompt: list[int], start: int, cache: DynamicCache, snapshot_at: list[int]
                 ) -> tuple[Prediction, dict[int, Snapshot]]:
        """Run `prompt[start:]` in chunks ending on every snapshot position; returns the last position's
        prediction and the snapshots taken."""
        stops = sorted(set(snapshot_at) | set(range(start + self.prefill_chunk, len(prompt), self.prefill_chunk))
                       | {len(prompt)})
        wanted = set(snapshot_at)
        snapshots: dict[int, Snapshot] = {}
        prediction: Prediction | None = None
        position = start
        for stop in stops:
            if stop <= position:
                continue
            prediction = self.loaded.forward(prompt[position:stop], position, cache)
            position = stop
            if stop in wanted and self.loaded.state is not None:
                snapshots[stop] = self.loaded.state.snapshot(cache)
        assert prediction is not None
        return prediction, snapshots


    @torch.inference_mode()
    def prompt_logits(self, scope: Scope, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Last-position logits of `prompt` with reuse as configured, then store its state; for tests.

        Returns (logits `[vocab]`, tokens restored).
        """
        cache, restored, matched = self._restore(scope, prompt, capacity=len(prompt))
        prediction, snapshots = self._prefill(prompt, restored, cache,
                                              self._snapshot_plan(prompt, (), restored, matched))
        self._dirty = max(self._dirty, len(prompt))
        self._store(scope, prompt, cache, snapshots)
        return prediction.logits(), restored

    def _snapshot_plan(self, prompt: list[int], boundaries: tuple[int, ...], start: int, matched: int) -> list[int]:
        if not self._takes_snapshots:
            return []
        return self.policy.prompt_positions(start, len(prompt), boundaries, branch=matched if matched > start else 0)

    def _restore(self, scope: Scope, prompt: list[int], capacity: int) -> tuple[DynamicCache, int, int]:
        """A working cache resumed at the deepest resume point; (cache, its length, tokens matched)."""
        state, hot = self.loaded.state, self._hot
        self._hot = None  # the working buffers are about to be overwritten
        if state is None:
            return DynamicCache(config=self.loaded.model.config), 0, 0
        if self.prefix_cache is None:  # reuse off: still the working cache, which the CPU decoder writes in place
            return state.new_cache(capacity)[0], 0, 0
        assert self.arena is not None
        self.arena.own_borrowed()  # no-op after `settle`; the new working cache overwrites the buffers
        # At least one prompt token is always computed: its logits choose the first output token.
        for _ in range(2):
            lease = self.prefix_cache.acquire(scope, prompt, limit=len(prompt) - 1,
                                              anywhere=self.resumes_anywhere)
            try:
                # The same scope's last request left its state in the working buffers: the part of the lease
                # it covers needs no copy.
                warm = min(common_prefix_length(hot[1], tuple(prompt)), lease.length) if hot and hot[0] == scope else 0
                cache, adopted = state.new_cache(capacity, adopt=warm)
                assert self.arena is not None
                self.arena.restore(state, cache, lease.spans, skip=adopted, snapshot=lease.snapshot,
                                   position=lease.length)
                return cache, lease.length, lease.matched
            except SealedEntryError as exc:
                # Altered, moved or opened under the wrong scope: dropped and counted; this request recomputes.
                failed = exc.handles
            finally:
                self.prefix_cache.release(lease)
            self.prefix_cache.discard(scope, failed)
            hot = None
        return state.new_cache(capacity)[0], 0, 0

    def _store(self, scope: Scope, tokens: Sequence[int], cache: DynamicCache, snapshots: dict[int, Snapshot]
               ) -> StoreResult:
        if self.prefix_cache is None or self.loaded.state is None:
            return StoreResult(len(tokens), 0)
        state = self.loaded.state
        state.materialize(cache)  # stored spans are cut from the buffers, which must hold every row
        # Views of the working buffers: `settle` seals them from there (or copies them) before they are reused.
        result = self.prefix_cache.store(
            scope, tokens, lambda start, end: Borrowed(state.extract(cache, start, end, borrow=True)), snapshots)
        self._hot = (scope, tuple(tokens))
        return result

    def settle(self, stop: Callable[[], bool] = lambda: False) -> None:
        """After a reply: zero plaintext that is no longer hot (working-buffer rows beyond the hot working
        cache, state opened for the request), then seal cold state, yielding to a waiting request (`stop`)."""
        state = self.loaded.state
        if self.arena is not None:
            self._dirty, self.arena.written = max(self._dirty, self.arena.written), 0
        if state is not None:
            keep = len(self._hot[1]) if self._hot is not None else 0
            state.wipe_pool(keep, self._dirty)
            self._dirty = keep
        if self.arena is not None:
            self.arena.wipe_scratch()
        if self.prefix_cache is not None:
            self.prefix_cache.seal_cold(stop)

    def drop_caller(self, caller: str) -> None:
        """The caller's key was removed: its stored state (and that of the callers it acts for as a router) is
        zeroed, its keys destroyed, its hot working cache wiped."""
        if self.prefix_cache is None:
            return
        dropped = self.prefix_cache.drop_caller(caller)
        if self._hot is not None and self._hot[0] in dropped:
            self._hot = None
            self.settle()

    def expire(self, ttl_of: Callable[[str], float | None]) -> None:
        """Destroy the state of scopes unused for longer than their caller's time to live."""
        if self.prefix_cache is None:
            return
        expired = self.prefix_cache.expire(ttl_of)
        if self._hot is not None and self._hot[0] in expired:
            self._hot = None
            self.settle()

    @torch.inference_mode()
    def generate(self, request: GenerationRequest, emit: Callable[[str], Any],
                 cancelled: Callable[[], bool], queue_wait_s: float = 0.0) -> GenerationResult:
        """Run one request; `emit` gets each text delta as soon as it is safe to send."""
        started = time.perf_counter()
        params, prompt = request.params, request.prompt
        cache, restored, matched = self._restore(request.scope, prompt, capacity=len(prompt) + params.max_tokens)
        prediction, snapshots = self._prefill(prompt, restored, cache,
                                              self._snapshot_plan(prompt, request.boundaries, restored, matched))
        sampler = Sampler(params)
        detok = Detokenizer(self.loaded.tokenizer, params.stop)
        output: list[int] = []
        finish_reason = "length"
        ttft = 0.0
        while len(output) < params.max_tokens:
            token = sampler.next_token(prediction, output)
            output.append(token)
            delta = detok.push(token)
            if len(output) == 1:
                ttft = time.perf_counter() - started
            if delta:
                emit(delta)
            if len(output) == 1 and self.loaded.state is not None:
                # The first token is out: now join the restored prefix to the working buffers, which
                # decode steps read as one tensor.
                self.loaded.state.materialize(cache)
            if token in self.loaded.eos_token_ids or detok.stopped:
                finish_reason = "stop"
                break
            if cancelled():
                finish_reason = "cancelled"
                break
            if len(output) < params.max_tokens:
                prediction = self.loaded.forward([token], len(prompt) + len(output) - 1, cache)
        tail = detok.flush()
        if tail:
            emit(tail)
        fed = prompt + output
        self._dirty = max(self._dirty, len(fed))
        if not (request.retain and self.keeps_state):
            return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=restored, cached_write_tokens=0,
                                    output_ids=output, text=detok.text, finish_reason=finish_reason,
                                    queue_wait_s=queue_wait_s, ttft_s=ttft, retained=False,
                                    matched_tokens=min(max(matched, restored), len(prompt) - 1))
        if output and self.prefix_cache is not None:
            # The last token was sampled but not yet run: run it so the stored state ends with the reply.
            self.loaded.extend([output[-1]], len(fed) - 1, cache)
            if self._takes_snapshots and self.policy.reply_end and self.loaded.state is not None:
                snapshots[len(fed)] = self.loaded.state.snapshot(cache)
        held = tuple(fed)  # one tuple for the hot working cache and the remembered forms
        stored = self._store(request.scope, held, cache, snapshots)
        forms = request.forms
        if self.prefix_cache is not None and (forms.at or forms.reply is not None):
            reply_end = () if forms.reply is None else ((len(held), forms.reply(detok.text)),)
            self.prefix_cache.record_forms(request.scope, held, forms.at + reply_end)
        # Prompt tokens among those newly stored and still held.
        written = max(0, min(len(prompt), stored.start + stored.stored) - stored.start)
        return GenerationResult(prompt_tokens=len(prompt), cached_read_tokens=restored,
                                cached_write_tokens=written, output_ids=output, text=detok.text,
                                finish_reason=finish_reason, queue_wait_s=queue_wait_s, ttft_s=ttft,
                                matched_tokens=min(max(matched, restored), len(prompt) - 1))
