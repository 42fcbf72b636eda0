"""The prefix cache: per-scope radix trees over one state arena, resume points, budgets and eviction.

A request acquires a lease on the deepest resume point of its tokens in its own scope, restores the
leased state, computes the rest, and stores what it computed plus the snapshots it took. Lookups take
the scope from the authenticated caller; there is no lookup by anything else.

A resume point is a position where every layer's need is met: for models whose layers all keep spans
(full attention), any position the stored spans cover; otherwise the end of a node holding a snapshot.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cache.adapters import ModelStateAdapter, Snapshot, SpanState, state_bytes
from cache.arena import Scope, SpanHandle, StateArena
from cache.budget import CacheBudget
from cache.radix_tree import RadixTree, TreeNode


@dataclass(frozen=True, slots=True)
class ReuseLease:
    """Stored state to resume `tokens` at `length`, locked against eviction until released."""

    scope: Scope
    length: int
    spans: tuple[tuple[SpanHandle, int], ...]
    """(handle, tokens to take from the start of that span), covering `[0, length)` in prompt order."""
    snapshot: Snapshot | None
    node: TreeNode[SpanHandle] | None
    matched: int
    """How far the stored tokens agree with the request (at least `length`)."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    start: int
    """Where the newly stored span begins: tokens before it were already held."""
    stored: int
    """Tokens newly stored and still held after eviction (0 when all were held, or evicted at once)."""


class PrefixCache:
    def __init__(self, budget: CacheBudget) -> None:
        self.budget = budget
        self.arena = StateArena()
        self._trees: dict[Scope, RadixTree[SpanHandle]] = {}
        self._adapters: dict[str, ModelStateAdapter] = {}
        self._clock = itertools.count(1).__next__
        self.evicted_spans = 0
        self.evicted_snapshots = 0

    def register_model(self, model: str, adapter: ModelStateAdapter) -> None:
        self._adapters[model] = adapter

    def _tree(self, scope: Scope) -> RadixTree[SpanHandle]:
        tree = self._trees.get(scope)
        if tree is None:
            adapter = self._adapters[scope.model]
            arena = self.arena

            def split(handle: SpanHandle, offset: int) -> tuple[SpanHandle, SpanHandle]:
                return arena.split(handle, adapter.split(arena.span(handle), offset))

            tree = self._trees[scope] = RadixTree(split, self._clock)
        return tree

    def acquire(self, scope: Scope, tokens: Sequence[int], limit: int, anywhere: bool) -> ReuseLease:
        """Lease the deepest resume point of `tokens`, at most `limit` tokens in.

        `anywhere`: every position the spans cover is a resume point (all layers keep spans); otherwise
        only the ends of nodes holding a snapshot are.
        """
        tree = self._trees.get(scope)
        if tree is None or limit <= 0:
            return ReuseLease(scope, 0, (), None, None, 0)
        match = tree.match(tokens)
        cap = min(match.length, limit)
        length, snapshot, last = 0, None, None
        if anywhere:
            length = cap
        for node in match.nodes:
            if node.end > cap:
                break
            assert node.handle is not None
            node_snapshot = self.arena.snapshot(node.handle)
            if not anywhere and node_snapshot is not None:
                length, snapshot = node.end, node_snapshot
        spans: list[tuple[SpanHandle, int]] = []
        for node in match.nodes:
            if node.start >= length:
                break
            assert node.handle is not None
            spans.append((node.handle, min(node.end, length) - node.start))
            last = node
        if last is not None:
            tree.lock(last)
        return ReuseLease(scope, length, tuple(spans), snapshot, last, match.length)

    def restore_list(self, lease: ReuseLease) -> list[tuple[SpanState, int]]:
        return [(self.arena.span(handle), take) for handle, take in lease.spans]

    def release(self, lease: ReuseLease) -> None:
        if lease.node is not None:
            self._trees[lease.scope].unlock(lease.node)

    def store(self, scope: Scope, tokens: Sequence[int], extract: Callable[[int, int], SpanState],
              snapshots: Mapping[int, Snapshot] | None = None) -> StoreResult:
        """Store the state of `tokens`; `extract(start, end)` cuts a not-yet-held span from the work cache.

        `snapshots` maps positions to the state taken there; each becomes a node boundary.
        """
        tree = self._tree(scope)
        leaf = tree.insert(tokens, lambda start, end: self.arena.put(scope, extract(start, end)))
        start = len(tokens) if leaf is None else leaf.start  # read now: snapshot boundaries may cut the leaf
        for position in sorted(snapshots or {}):
            if 0 < position <= len(tokens):
                node = tree.boundary(tokens, position)
                assert node.handle is not None and snapshots is not None
                self.arena.attach_snapshot(node.handle, snapshots[position])
        self.enforce_budget(scope.caller)
        held = tree.match(tokens).length if start < len(tokens) else start
        return StoreResult(start, max(0, held - start))

    def enforce_budget(self, caller: str) -> None:
        """Evict unheld state until the caller's and the node's budgets hold."""
        arena, budget = self.arena, self.budget
        self._evict([(scope, tree) for scope, tree in self._trees.items() if scope.caller == caller],
                    lambda: arena.bytes_of_caller(caller) > budget.caller_bytes)
        self._evict(list(self._trees.items()), lambda: arena.bytes_total > budget.node_bytes)

    def _score(self, scope: Scope, node: TreeNode[SpanHandle], whole: bool, now: int) -> float:
        """Lower goes first. LRU: age alone. Value: compute saved per byte held, discounted by age.

        The compute a unit saves is the tokens a request would recompute without it: from the deepest
        resume point that would remain above it to the node's end.
        """
        if self.budget.eviction == "lru":
            return float(node.last_access)
        assert node.handle is not None
        if whole:
            held = self.arena.nbytes(node.handle)
            resumable = (self.arena.snapshot(node.handle) is not None
                         or not self._adapters[scope.model].needs_snapshots)
        else:
            held, resumable = state_bytes(self.arena.snapshot(node.handle)), True
        if not resumable:
            return 0.0
        above = node.parent
        while (above is not None and above.handle is not None and self._adapters[scope.model].needs_snapshots
               and self.arena.snapshot(above.handle) is None):
            above = above.parent
        base = above.end if above is not None and above.handle is not None else 0
        return (node.end - base) / max(held, 1) / (1 + now - node.last_access)

    def _evict(self, trees: list[tuple[Scope, RadixTree[SpanHandle]]], over_budget: Callable[[], bool]) -> None:
        if not over_budget():
            return
        now, order = self._clock(), itertools.count()
        heap: list[tuple[float, int, Scope, RadixTree[SpanHandle], TreeNode[SpanHandle], bool]] = []
        for scope, tree in trees:
            for leaf in tree.evictable_leaves():
                heap.append((self._score(scope, leaf, True, now), next(order), scope, tree, leaf, True))
            if self.budget.eviction == "value":
                for node in tree.nodes():
                    if (node.children and node.refs == 0 and node.handle is not None
                            and self.arena.snapshot(node.handle) is not None):
                        heap.append((self._score(scope, node, False, now), next(order), scope, tree, node, False))
        heapq.heapify(heap)
        while heap and over_budget():
            _, _, scope, tree, node, whole = heapq.heappop(heap)
            if node.handle is None:
                continue  # evicted whole after this entry was made
            if not whole:
                if self.arena.snapshot(node.handle) is not None:
                    self.arena.drop_snapshot(node.handle)
                    self.evicted_snapshots += 1
                continue
            parent = node.parent
            assert parent is not None
            self.arena.free(tree.remove_leaf(node))
            self.evicted_spans += 1
            if parent is not tree.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (self._score(scope, parent, True, now), next(order), scope, tree, parent, True))

    def drop_scope(self, scope: Scope) -> None:
        tree = self._trees.pop(scope, None)
        if tree is not None:
            for node in tree.nodes():
                assert node.handle is not None
                self.arena.free(node.handle)

    def cached_tokens(self, scope: Scope) -> int:
        tree = self._trees.get(scope)
        return 0 if tree is None else sum(len(node.tokens) for node in tree.nodes())

    def snapshot_positions(self, scope: Scope) -> list[int]:
        tree = self._trees.get(scope)
        if tree is None:
            return []
        return sorted(node.end for node in tree.nodes()
                      if node.handle is not None and self.arena.snapshot(node.handle) is not None)
