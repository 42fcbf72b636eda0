"""The prefix cache: per-scope radix trees over one state arena, with byte budgets and LRU eviction.

A request acquires a lease on the longest stored prefix of its tokens in its own scope, restores the
leased spans, computes the rest, and stores what it computed. Lookups take the scope from the
authenticated caller; there is no lookup by anything else.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.adapters import ModelStateAdapter, SpanState
from cache.arena import Scope, SpanHandle, StateArena
from cache.radix_tree import RadixTree, TreeNode


class BudgetError(ValueError):
    """A cache budget that cannot work (negative, or a caller budget above the node's)."""


@dataclass(frozen=True, slots=True)
class CacheBudget:
    node_bytes: int
    caller_bytes: int

    def __post_init__(self) -> None:
        if self.node_bytes < 0 or self.caller_bytes < 0:
            raise BudgetError("cache budgets must be zero or positive byte counts")


@dataclass(frozen=True, slots=True)
class ReuseLease:
    """Stored spans covering `tokens[:length]` of a request, locked against eviction until released."""

    scope: Scope
    length: int
    spans: tuple[tuple[SpanHandle, int], ...]
    """(handle, tokens to take from the start of that span), in prompt order."""
    node: TreeNode[SpanHandle] | None


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

    def register_model(self, model: str, adapter: ModelStateAdapter) -> None:
        self._adapters[model] = adapter

    def _tree(self, scope: Scope) -> RadixTree[SpanHandle]:
        tree = self._trees.get(scope)
        if tree is None:
            adapter = self._adapters[scope.model]
            arena = self.arena

            def split(handle: SpanHandle, offset: int) -> tuple[SpanHandle, SpanHandle]:
                return arena.replace(handle, adapter.split(arena.get(handle), offset))

            tree = self._trees[scope] = RadixTree(split, self._clock)
        return tree

    def acquire(self, scope: Scope, tokens: Sequence[int], limit: int) -> ReuseLease:
        """Lease the longest stored prefix of `tokens`, at most `limit` tokens long."""
        tree = self._trees.get(scope)
        if tree is None or limit <= 0:
            return ReuseLease(scope, 0, (), None)
        match = tree.match(tokens)
        length = min(match.length, limit)
        spans: list[tuple[SpanHandle, int]] = []
        last: TreeNode[SpanHandle] | None = None
        for node in match.nodes:
            if node.start >= length:
                break
            assert node.handle is not None
            spans.append((node.handle, min(node.end, length) - node.start))
            last = node
        if last is not None:
            tree.lock(last)
        return ReuseLease(scope, length, tuple(spans), last)

    def restore_list(self, lease: ReuseLease) -> list[tuple[SpanState, int]]:
        return [(self.arena.get(handle), take) for handle, take in lease.spans]

    def release(self, lease: ReuseLease) -> None:
        if lease.node is not None:
            self._trees[lease.scope].unlock(lease.node)

    def store(self, scope: Scope, tokens: Sequence[int], extract: Callable[[int, int], SpanState]) -> StoreResult:
        """Store the state of `tokens`; `extract(start, end)` cuts the not-yet-held span from the work cache."""
        tree = self._tree(scope)
        leaf = tree.insert(tokens, lambda start, end: self.arena.put(scope, extract(start, end)))
        if leaf is None:
            return StoreResult(len(tokens), 0)
        self.enforce_budget(scope.caller)
        return StoreResult(leaf.start, len(leaf.tokens) if leaf.parent is not None else 0)

    def enforce_budget(self, caller: str) -> None:
        """Evict least recently used unheld spans until the caller's and the node's budgets hold."""
        arena, budget = self.arena, self.budget
        self._evict([tree for scope, tree in self._trees.items() if scope.caller == caller],
                    lambda: arena.bytes_of_caller(caller) > budget.caller_bytes)
        self._evict(list(self._trees.values()), lambda: arena.bytes_total > budget.node_bytes)

    def _evict(self, trees: list[RadixTree[SpanHandle]], over_budget: Callable[[], bool]) -> None:
        if not over_budget():
            return
        order = itertools.count()
        heap = [(leaf.last_access, next(order), tree, leaf) for tree in trees for leaf in tree.evictable_leaves()]
        heapq.heapify(heap)
        while heap and over_budget():
            _, _, tree, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self.arena.free(tree.remove_leaf(leaf))
            self.evicted_spans += 1
            if parent is not None and parent is not tree.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_access, next(order), tree, parent))

    def drop_scope(self, scope: Scope) -> None:
        tree = self._trees.pop(scope, None)
        if tree is not None:
            for node in tree.nodes():
                assert node.handle is not None
                self.arena.free(node.handle)

    def cached_tokens(self, scope: Scope) -> int:
        tree = self._trees.get(scope)
        return 0 if tree is None else sum(len(node.tokens) for node in tree.nodes())
