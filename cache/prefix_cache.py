"""The prefix cache: per-scope radix trees over one state arena, resume points, budgets and eviction.

It decides on metadata only: scopes, handles, bytes, whether a handle holds a snapshot. Payloads (tensors,
sealed or not) live in the arena, which this module reaches through `StateStore` and never imports: no
torch here, so nothing in the index can read state.

A request acquires a lease on the deepest resume point of its tokens in its own scope, restores the
leased state, computes the rest, and stores what it computed plus the snapshots it took. Lookups take
the scope from the authenticated caller; there is no lookup by anything else.

A resume point is a position where every layer's need is met: for models whose layers all keep spans
(full attention), any position the stored spans cover; otherwise the end of a node holding a snapshot.

The index holds no token id: each scope's tree is built over keyed digests of its tokens
(`cache/token_digest.py`) under a key of the scope's own, drawn when the scope is first used. Callers pass token
ids, or the `DigestRun` that `digest` made for the same scope; a run of another scope is refused. Dropping a
scope (key removed, time to live over) zeroes its key and digests and unlinks its tree at once.

Every entry (tree node) has a time to live, refreshed when it is stored or read: the longest any store over it
asked for (`Hold`), so a request asking for less never shortens what another asked for, or its caller's default,
known when it expires (`expire`'s `ttl_of`). A node's parent is refreshed with it and holds at least its time to
live, so expiry takes whole subtrees. Expired entries are zeroed and forgotten; a scope left with none goes whole
(keys destroyed). The clock is the constructor's `now`, so that tests can move time.

For routing summaries (`cache/summary.py`) a scope also remembers prefix forms: the SHA-256 of the canonical
form of a prompt prefix, with its token position and the digests of the tokens stored with it. They are digests
of prompt content: memory only, dropped with the scope, and read only to be keyed for the router that owns the
scope.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cache.budget import CacheBudget
from cache.radix_tree import PrefixMatch, RadixTree, TreeNode
from cache.scope import Scope, SpanHandle, past_ttl
from cache.token_digest import DigestRun, TokenDigester

ROUTED = "/"
"""Joins a router's name and the id of a caller it acts for into that caller's name (`router/id`). Caller names
never hold it, so a router's callers are told apart from every other caller, and go with the router."""

Hold = tuple[int, float | None]
"""(position, seconds): the stored tokens before `position` are held for that long after their last use at
least; None: their caller's default time to live."""

MAX_FORMS = 4096
"""Prefix forms a scope remembers (the most recently stored): at most this many summary entries per scope. The
forms of one request share one run of its digests."""


def belongs_to(scope: Scope, caller: str) -> bool:
    """The scope is `caller`'s, or one of a caller `caller` acts for as a router."""
    return scope.caller == caller or scope.caller.startswith(caller + ROUTED)


@dataclass(frozen=True, slots=True)
class ColdPass:
    """What a pass over the cold plaintext did: bytes sealed, and the entries not worth sealing (opening them
    would cost more than computing them again), which the index drops."""

    sealed_bytes: int
    unkept: tuple[tuple[Scope, SpanHandle], ...]


class StateStore(Protocol):
    """What the index needs of the arena: metadata by handle, and moving payloads it never looks into."""

    bytes_total: int

    def put(self, scope: Scope, start: int, end: int, span: Any) -> SpanHandle: ...
    def attach_snapshot(self, handle: SpanHandle, snapshot: Any) -> None: ...
    def has_snapshot(self, handle: SpanHandle) -> bool: ...
    def nbytes(self, handle: SpanHandle) -> int: ...
    def snapshot_nbytes(self, handle: SpanHandle) -> int: ...
    def drop_snapshot(self, handle: SpanHandle) -> int: ...
    def free(self, handle: SpanHandle) -> int: ...
    def split(self, handle: SpanHandle, offset: int) -> tuple[SpanHandle, SpanHandle]: ...
    def held_bytes(self, handle: SpanHandle) -> tuple[int, int]: ...
    def bytes_of_caller(self, caller: str) -> int: ...
    def forget(self, scope: Scope) -> None: ...
    def seal_cold(self, stop: Callable[[], bool]) -> ColdPass: ...


@dataclass(frozen=True, slots=True)
class ReuseLease:
    """Stored state to resume `tokens` at `length`, locked against eviction until released."""

    scope: Scope
    length: int
    spans: tuple[tuple[SpanHandle, int], ...]
    """(handle, tokens to take from the start of that span), covering `[0, length)` in prompt order."""
    snapshot: SpanHandle | None
    """The handle whose snapshot is the state at `length`, for models that need one."""
    node: TreeNode[SpanHandle] | None
    matched: int
    """How far the stored tokens agree with the request (at least `length`)."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    start: int
    """Where the newly stored span begins: tokens before it were already held."""
    stored: int
    """Tokens newly stored and still held after eviction (0 when all were held, or evicted at once)."""


@dataclass(slots=True)
class Lookups:
    """A scope's lookups since the node started: a hit resumed at least one stored token, a miss none. Counts
    only, which its caller may read (`GET /v1/cache`); they outlive the scope's state being shredded, not its
    caller's removal."""

    hits: int = 0
    misses: int = 0


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the prefix index holds for one scope: its caller's own view (`GET /v1/cache`), and what shredding it
    destroyed."""

    entries: int
    """Spans stored (nodes of the scope's tree)."""
    tokens: int
    hot_bytes: int
    """Held in plaintext, in the hot tier."""
    sealed_bytes: int


NOTHING_HELD = Holdings(0, 0, 0, 0)


class PrefixCache:
    def __init__(self, budget: CacheBudget, arena: StateStore, now: Callable[[], float] = time.monotonic) -> None:
        """`now`: the clock of times to live, in seconds."""
        self.budget = budget
        self.now = now
        self.arena = arena
        self._trees: dict[Scope, RadixTree[SpanHandle]] = {}
        self._digesters: dict[Scope, TokenDigester] = {}
        self._needs_snapshots: dict[str, bool] = {}
        self._clock = itertools.count(1).__next__
        self._used: dict[Scope, float] = {}
        """When each scope was last used (monotonic seconds), for time-to-live expiry."""
        self._forms: dict[Scope, OrderedDict[bytes, tuple[int, DigestRun]]] = {}
        """Per scope: prefix form -> (its token position, the digests of the tokens stored with it), oldest
        first."""
        self.lookups: dict[Scope, Lookups] = {}
        self.evicted_spans = 0
        self.evicted_snapshots = 0
        self.expired_scopes = 0
        self.expired_entries = 0

    def register_model(self, model: str, needs_snapshots: bool) -> None:
        self._needs_snapshots[model] = needs_snapshots

    def digest(self, scope: Scope, tokens: Sequence[int] | DigestRun) -> DigestRun:
        """`tokens` (ids from position 0) as the scope's index holds them; a run already made for the scope as
        it is. The scope's key is drawn on first use."""
        digester = self._digesters.get(scope)
        if digester is None:
            digester = self._digesters[scope] = TokenDigester()
            self._used.setdefault(scope, self.now())  # expires like a scope that stored something
        if isinstance(tokens, DigestRun):
            if tokens.owner is not digester:  # a bug of ours: runs never cross scopes
                raise ValueError("a digest run made for another scope (or before this one was dropped)")
            return tokens
        return digester.run(tokens)

    def _tree(self, scope: Scope) -> RadixTree[SpanHandle]:
        tree = self._trees.get(scope)
        if tree is None:
            tree = self._trees[scope] = RadixTree(self.arena.split, self._clock)
        return tree

    def acquire(self, scope: Scope, tokens: Sequence[int] | DigestRun, limit: int, anywhere: bool) -> ReuseLease:
        """Lease the deepest resume point of `tokens`, at most `limit` tokens in.

        `anywhere`: every position the spans cover is a resume point (all layers keep spans); otherwise
        only the ends of nodes holding a snapshot are.
        """
        run = self.digest(scope, tokens)
        tree = self._trees.get(scope)
        lookups = self.lookups.setdefault(scope, Lookups())
        if tree is None or limit <= 0:
            lookups.misses += 1
            return ReuseLease(scope, 0, (), None, None, 0)
        now = self._used[scope] = self.now()
        match = tree.match(run)
        length, snapshot = self._resume_point(match, min(match.length, limit), anywhere)
        if length:
            lookups.hits += 1
        else:
            lookups.misses += 1
        last = None
        spans: list[tuple[SpanHandle, int]] = []
        for node in match.nodes:
            if node.start >= length:
                break
            assert node.handle is not None
            spans.append((node.handle, min(node.end, length) - node.start))
            node.used_s = now  # read: its time to live starts again
            last = node
        if last is not None:
            tree.lock(last)
        return ReuseLease(scope, length, tuple(spans), snapshot, last, match.length)

    def _resume_point(self, match: PrefixMatch[SpanHandle], cap: int, anywhere: bool
                      ) -> tuple[int, SpanHandle | None]:
        """The deepest resume point of `match` at most `cap` tokens in, and the handle holding its snapshot."""
        if anywhere:
            return cap, None
        length, snapshot = 0, None
        for node in match.nodes:
            if node.end > cap:
                break
            assert node.handle is not None
            if self.arena.has_snapshot(node.handle):
                length, snapshot = node.end, node.handle
        return length, snapshot

    def resume_depth(self, scope: Scope, tokens: Sequence[int] | DigestRun, anywhere: bool) -> int:
        """How deep along `tokens` the scope holds a resume point: `acquire`'s length without a lease and without
        touching anything (eviction order stays as requests left it)."""
        tree = self._trees.get(scope)
        if tree is None:
            return 0
        match = tree.peek(self.digest(scope, tokens))
        return self._resume_point(match, match.length, anywhere)[0]

    def record_forms(self, scope: Scope, tokens: Sequence[int] | DigestRun, forms: Sequence[tuple[int, bytes]]
                     ) -> None:
        """Remember, for each (position, form), that `tokens[:position]` is the prefix whose form is `form`;
        called after `tokens` were stored. The MAX_FORMS most recent forms are kept."""
        tokens = self.digest(scope, tokens)
        log = self._forms.setdefault(scope, OrderedDict())
        for position, form in forms:
            log[form] = (position, tokens)
            log.move_to_end(form)
        while len(log) > MAX_FORMS:
            log.popitem(last=False)

    def warm_forms(self, select: Callable[[Scope], bool], anywhere: bool) -> list[tuple[Scope, bytes]]:
        """The remembered forms of the selected scopes whose prefix the scope can still resume: a resume point
        held at or beyond the form's position along its tokens. Touches nothing."""
        warm = []
        for scope, log in self._forms.items():
            if not select(scope):
                continue
            depths: dict[int, int] = {}  # by the identity of a digest run: one walk per stored request
            for form, (position, tokens) in log.items():
                depth = depths.get(id(tokens))
                if depth is None:
                    depth = depths[id(tokens)] = self.resume_depth(scope, tokens, anywhere)
                if depth >= position:
                    warm.append((scope, form))
        return warm

    def release(self, lease: ReuseLease) -> None:
        if lease.node is not None:
            self._trees[lease.scope].unlock(lease.node)

    def store(self, scope: Scope, tokens: Sequence[int] | DigestRun, extract: Callable[[int, int], Any],
              snapshots: Mapping[int, Any] | None = None, holds: Sequence[Hold] | None = None) -> StoreResult:
        """Store the state of `tokens`; `extract(start, end)` cuts a not-yet-held span from the work cache.

        `snapshots` maps positions to the state taken there; each becomes a node boundary. `holds`: how long
        the tokens are held (each position a node boundary too); None: all of them for the caller's default.
        """
        tokens = self.digest(scope, tokens)
        tree = self._tree(scope)
        now = self._used[scope] = self.now()
        holds = [(len(tokens), None)] if holds is None else holds
        leaf = tree.insert(tokens, lambda start, end: self.arena.put(scope, start, end, extract(start, end)))
        start = len(tokens) if leaf is None else leaf.start  # read now: snapshot boundaries may cut the leaf
        for position in sorted(snapshots or {}):
            if 0 < position <= len(tokens):
                node = tree.boundary(tokens, position)
                assert node.handle is not None and snapshots is not None
                self.arena.attach_snapshot(node.handle, snapshots[position])
        for position, _ in holds:
            if 0 < position < len(tokens):
                tree.boundary(tokens, position)
        for node in tree.peek(tokens).nodes:
            node.used_s = now
            for position, ttl in holds:
                if position >= node.end:
                    node.ttl_s = max(node.ttl_s, ttl or 0.0)
                    node.default_ttl = node.default_ttl or ttl is None
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
        needs_snapshots = self._needs_snapshots[scope.model]
        if whole:
            held = self.arena.nbytes(node.handle)
            resumable = self.arena.has_snapshot(node.handle) or not needs_snapshots
        else:
            held, resumable = self.arena.snapshot_nbytes(node.handle), True
        if not resumable:
            return 0.0
        above = node.parent
        while (above is not None and above.handle is not None and needs_snapshots
               and not self.arena.has_snapshot(above.handle)):
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
                            and self.arena.has_snapshot(node.handle)):
                        heap.append((self._score(scope, node, False, now), next(order), scope, tree, node, False))
        heapq.heapify(heap)
        while heap and over_budget():
            _, _, scope, tree, node, whole = heapq.heappop(heap)
            if node.handle is None:
                continue  # evicted whole after this entry was made
            if not whole:
                if self.arena.has_snapshot(node.handle):
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
        """Free the scope's state, zeroed, and destroy its keys: what was sealed under it never opens again, and
        its digests (zeroed too) name no token even to a memory image holding them."""
        tree = self._trees.pop(scope, None)
        digester = self._digesters.pop(scope, None)
        self._used.pop(scope, None)
        for _, run in (self._forms.pop(scope, None) or {}).values():
            run.wipe()
        if tree is not None:
            for handle in tree.clear(_wipe_run):
                self.arena.free(handle)
        if digester is not None:
            digester.destroy()
        self.arena.forget(scope)

    def drop_caller(self, caller: str) -> list[Scope]:
        """Drop every scope of `caller` and of the callers it acts for as a router (its key was removed), their
        lookup counts too; returns them."""
        for scope in [scope for scope in self.lookups if belongs_to(scope, caller)]:
            del self.lookups[scope]
        return self.drop(lambda scope: belongs_to(scope, caller))

    def drop(self, select: Callable[[Scope], bool]) -> list[Scope]:
        """Drop every scope `select` takes (`drop_scope`); returns them."""
        scopes = [scope for scope in dict.fromkeys([*self._trees, *self._digesters]) if select(scope)]
        for scope in scopes:
            self.drop_scope(scope)
        return scopes

    def holdings(self, scope: Scope) -> Holdings:
        tree = self._trees.get(scope)
        if tree is None:
            return NOTHING_HELD
        entries = tokens = hot = sealed = 0
        for node in tree.nodes():
            if node.handle is None:
                continue
            span_hot, span_sealed = self.arena.held_bytes(node.handle)
            entries, tokens, hot, sealed = entries + 1, tokens + len(node.tokens), hot + span_hot, sealed + span_sealed
        return Holdings(entries, tokens, hot, sealed)

    def expire(self, ttl_of: Callable[[str], float | None], now: float | None = None) -> list[Scope]:
        """Zero and forget the entries unused for longer than their time to live (`ttl_of`: a caller's default;
        None: no limit), and drop the scopes left holding none: those that just lost their last entry, and those
        that stored nothing and were unused for longer than their caller's default. Returns the scopes that lost
        anything."""
        now = self.now() if now is None else now
        touched, dropped = [], []
        for scope, used in list(self._used.items()):
            tree, default = self._trees.get(scope), ttl_of(scope.caller)
            pruned = [] if tree is None else tree.prune(functools.partial(_expired, default=default, now=now))
            for handle in pruned:
                self.arena.free(handle)
            self.expired_entries += len(pruned)
            if tree is not None and tree.root.children:
                if pruned:
                    touched.append(scope)
            elif pruned or past_ttl(scope, used, ttl_of, now):
                self.drop_scope(scope)
                dropped.append(scope)
        self.expired_scopes += len(dropped)
        return touched + dropped

    def longest_ttl(self, caller: str) -> float:
        """The longest time to live a store asked for of any entry `caller`'s scopes hold (0: none asked)."""
        return max((node.ttl_s for scope, tree in self._trees.items() if scope.caller == caller
                    for node in tree.nodes()), default=0.0)

    def discard(self, scope: Scope, handles: Sequence[SpanHandle]) -> int:
        """Drop the nodes holding `handles` and everything below them (entries that failed to open: what lies
        below cannot be resumed without them); returns the entries freed."""
        tree = self._trees.get(scope)
        if tree is None:
            return 0
        doomed = set(handles)
        freed = 0
        for node in list(tree.nodes()):
            if node.handle in doomed:
                for below in tree.remove_subtree(node):
                    self.arena.free(below)
                    freed += 1
        return freed

    def seal_cold(self, stop: Callable[[], bool] = lambda: False) -> ColdPass:
        """Seal cold state; drop what is not worth sealing, with what lies below it (unusable without it)."""
        cold = self.arena.seal_cold(stop)
        doomed: dict[Scope, list[SpanHandle]] = {}
        for scope, handle in cold.unkept:
            doomed.setdefault(scope, []).append(handle)
        for scope, handles in doomed.items():
            self.discard(scope, handles)
        return cold

    def cached_tokens(self, scope: Scope) -> int:
        tree = self._trees.get(scope)
        return 0 if tree is None else sum(len(node.tokens) for node in tree.nodes())

    def snapshot_positions(self, scope: Scope) -> list[int]:
        tree = self._trees.get(scope)
        if tree is None:
            return []
        return sorted(node.end for node in tree.nodes()
                      if node.handle is not None and self.arena.has_snapshot(node.handle))


def _expired(node: TreeNode[SpanHandle], default: float | None, now: float) -> bool:
    """Whether `node` was unused for longer than its time to live (`default`: its caller's; None: no limit)."""
    if node.default_ttl and default is None:
        return False
    ttl = max(node.ttl_s, default or 0.0) if node.default_ttl else node.ttl_s
    return now - node.used_s > ttl


def _wipe_run(run: object) -> None:
    assert isinstance(run, DigestRun)
    run.wipe()
