"""A token radix tree: the prefix index of one scope (caller, model).

The tree deals in token runs, positions and opaque state handles only; it never sees a tensor. Each node
owns the span of tokens from its parent's end to its own end and the handle of the state for that span.

A run is any immutable sequence whose slices are runs of its own type and whose `==` compares element by
element: a tuple of ids in tests, a `cache.token_digest.DigestRun` in the prefix cache, which stores no id. One
tree holds one type of run; the tree keeps slices of the runs it is given.

Invariants:
- a node's span is never empty, except the root's;
- siblings differ in their first token (`children` is keyed by it);
- `refs` of a node is at least the sum of `refs` of its children: locking a node locks its ancestors,
  so an in-flight request's whole path is safe from eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

H = TypeVar("H")
Run = Sequence[Any]
"""A token run: tuple[int, ...], str or DigestRun (see the module's docstring)."""


@dataclass(eq=False, slots=True)
class TreeNode(Generic[H]):
    tokens: Run
    start: int
    handle: H | None
    parent: TreeNode[H] | None
    children: dict[int, TreeNode[H]] = field(default_factory=dict)
    last_access: int = 0
    refs: int = 0
    used_s: float = 0.0
    """When the span was last stored or read (the prefix cache's clock, seconds): its time to live runs from
    there."""
    ttl_s: float = 0.0
    """The longest time to live a store over this span asked for in seconds (0: none asked for one)."""
    default_ttl: bool = False
    """A store over this span asked for its caller's default time to live, known only when it expires."""

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class PrefixMatch(Generic[H]):
    """The nodes whose spans cover `tokens[:length]`; the last one may be covered only in part."""

    nodes: tuple[TreeNode[H], ...]
    length: int


def common_prefix_length(a: Run, b: Run) -> int:
    own = getattr(a, "common_prefix_length", None)
    if own is not None:  # a run that compares all its elements at once
        return int(own(b))
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree(Generic[H]):
    """Prefix index over token sequences with per-span handles.

    `split(handle, offset)` must return the handles of the span's first `offset` tokens and of the rest;
    the tree calls it when a new sequence diverges inside an existing span.
    """

    def __init__(self, split: Callable[[H, int], tuple[H, H]], clock: Callable[[], int]) -> None:
        self.root: TreeNode[H] = TreeNode(tokens=(), start=0, handle=None, parent=None)
        self._split_handle = split
        self._clock = clock

    def match(self, tokens: Run) -> PrefixMatch[H]:
        """The longest stored prefix of `tokens`; touches the nodes on the path."""
        return self._walk(tokens, self._clock())

    def peek(self, tokens: Run) -> PrefixMatch[H]:
        """`match` without touching: for reading what is held (a summary) without changing eviction order."""
        return self._walk(tokens, None)

    def _walk(self, tokens: Run, now: int | None) -> PrefixMatch[H]:
        nodes: list[TreeNode[H]] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = common_prefix_length(child.tokens, tokens[pos:pos + len(child.tokens)])
            if now is not None:
                child.last_access = now
            nodes.append(child)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return PrefixMatch(tuple(nodes), pos)

    def insert(self, tokens: Run, make_handle: Callable[[int, int], H]) -> TreeNode[H] | None:
        """Store `tokens`; `make_handle(start, end)` gives the state handle for a new span.

        Returns the new leaf, or None when the tree already held all of `tokens`.
        """
        found = self.match(tokens)
        if found.length == len(tokens):
            return None
        node = found.nodes[-1] if found.nodes else self.root
        if node.end > found.length:  # the tokens leave the stored ones inside this span
            node = self._split(node, found.length - node.start)
        leaf = TreeNode(tokens=tokens[found.length:], start=found.length,
                        handle=make_handle(found.length, len(tokens)), parent=node, last_access=self._clock())
        node.children[leaf.tokens[0]] = leaf
        return leaf

    def boundary(self, tokens: Run, position: int) -> TreeNode[H]:
        """The node ending exactly at `position` on the path of `tokens` (held up to there), cutting one if needed."""
        assert 0 < position <= len(tokens)
        node, pos = self.root, 0
        while True:
            child = node.children[tokens[pos]]
            if child.end == position:
                return child
            if child.end > position:
                return self._split(child, position - child.start)
            node, pos = child, child.end

    def _split(self, node: TreeNode[H], offset: int) -> TreeNode[H]:
        """Cut `node` after `offset` tokens; returns the new upper node, `node` keeps the rest."""
        assert 0 < offset < len(node.tokens) and node.parent is not None and node.handle is not None
        left, right = self._split_handle(node.handle, offset)
        upper = TreeNode(tokens=node.tokens[:offset], start=node.start, handle=left, parent=node.parent,
                         last_access=node.last_access, refs=node.refs, used_s=node.used_s, ttl_s=node.ttl_s,
                         default_ttl=node.default_ttl)
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.start, node.handle, node.parent = node.tokens[offset:], node.start + offset, right, upper
        upper.children[node.tokens[0]] = node
        return upper

    def lock(self, node: TreeNode[H]) -> None:
        current: TreeNode[H] | None = node
        while current is not None and current is not self.root:
            current.refs += 1
            current = current.parent

    def unlock(self, node: TreeNode[H]) -> None:
        current: TreeNode[H] | None = node
        while current is not None and current is not self.root:
            assert current.refs > 0
            current.refs -= 1
            current = current.parent

    def evictable_leaves(self) -> Iterator[TreeNode[H]]:
        """Leaves no in-flight request holds."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.refs == 0:
                yield node

    def remove_leaf(self, node: TreeNode[H]) -> H:
        """Detach a leaf; it keeps no parent and no handle, so stale references can tell it is gone."""
        assert not node.children and node.refs == 0 and node.parent is not None and node.handle is not None
        del node.parent.children[node.tokens[0]]
        handle, node.parent, node.handle = node.handle, None, None
        return handle

    def remove_subtree(self, node: TreeNode[H]) -> list[H]:
        """Detach `node` and everything below it (none may be leased); returns their handles."""
        assert node.parent is not None and node.refs == 0
        del node.parent.children[node.tokens[0]]
        handles, stack = [], [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            if current.handle is not None:
                handles.append(current.handle)
            current.parent, current.handle, current.children = None, None, {}
        return handles

    def prune(self, doomed: Callable[[TreeNode[H]], bool]) -> list[H]:
        """Detach every node `doomed` takes that no in-flight request holds, with everything below it (unusable
        without it); returns their handles. A node kept is looked below: expiry, for one, may take a child and
        keep its parent."""
        handles: list[H] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.refs == 0 and doomed(node):
                handles.extend(self.remove_subtree(node))
            else:
                stack.extend(node.children.values())
        return handles

    def clear(self, wipe: Callable[[Run], None]) -> list[H]:
        """Empty the tree at once: every node's run goes through `wipe` and every link is cut, so nothing of it
        waits for the cycle collector (a node and its parent refer to each other); returns the handles."""
        handles, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.handle is not None:
                handles.append(node.handle)
            wipe(node.tokens)
            node.parent, node.handle, node.children, node.tokens = None, None, {}, ()
        self.root.children = {}
        return handles

    def nodes(self) -> Iterator[TreeNode[H]]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
