"""The prefix index alone: exact matches, splits, locks and eviction candidates."""

from __future__ import annotations

import itertools

from cache.radix_tree import RadixTree, common_prefix_length


def make_tree() -> tuple[RadixTree[str], list[tuple[str, int]]]:
    splits: list[tuple[str, int]] = []

    def split(handle: str, offset: int) -> tuple[str, str]:
        splits.append((handle, offset))
        return f"{handle}[:{offset}]", f"{handle}[{offset}:]"

    return RadixTree(split, itertools.count(1).__next__), splits


def test_common_prefix_length() -> None:
    assert common_prefix_length((1, 2, 3), (1, 2, 3)) == 3
    assert common_prefix_length((1, 2, 3, 4, 5), (1, 2, 9, 4, 5)) == 2
    assert common_prefix_length((5,), (6,)) == 0
    assert common_prefix_length((1, 2), (1, 2, 3)) == 2


def test_insert_and_match_with_split_inside_a_span() -> None:
    tree, splits = make_tree()
    leaf = tree.insert((1, 2, 3, 4, 5), lambda s, e: f"A{s}-{e}")
    assert leaf is not None and (leaf.start, leaf.end, leaf.handle) == (0, 5, "A0-5")
    other = tree.insert((1, 2, 3, 9), lambda s, e: f"B{s}-{e}")
    assert splits == [("A0-5", 3)]
    assert other is not None and (other.start, other.tokens, other.handle) == (3, (9,), "B3-4")
    upper = tree.root.children[1]
    assert (upper.tokens, upper.handle) == ((1, 2, 3), "A0-5[:3]")
    assert sorted(upper.children) == [4, 9]
    assert upper.children[4].handle == "A0-5[3:]" and upper.children[4].start == 3

    match = tree.match((1, 2, 3, 4, 7))
    assert match.length == 4 and [n.handle for n in match.nodes] == ["A0-5[:3]", "A0-5[3:]"]
    assert tree.match((2, 1)).length == 0
    assert tree.insert((1, 2, 3), lambda s, e: "never") is None


def test_locks_protect_the_path_and_eviction_sees_only_free_leaves() -> None:
    tree, _ = make_tree()
    a = tree.insert((1, 2, 3, 4), lambda s, e: "a")
    b = tree.insert((1, 2, 7), lambda s, e: "b")
    assert a is not None and b is not None
    tree.lock(b)
    assert b.parent is not None and b.parent.refs == 1
    assert [n.handle for n in tree.evictable_leaves()] == ["a[2:]"]
    tree.unlock(b)
    assert sorted(n.handle for n in tree.evictable_leaves()) == ["a[2:]", "b"]
    assert tree.remove_leaf(b) == "b"
    assert tree.match((1, 2, 7)).length == 2


def test_a_split_node_inherits_the_locks_of_the_node_it_cut() -> None:
    tree, _ = make_tree()
    a = tree.insert((1, 2, 3, 4), lambda s, e: "a")
    assert a is not None
    tree.lock(a)
    tree.insert((1, 2, 5), lambda s, e: "b")
    assert a.parent is not None and a.parent.refs == 1
    tree.unlock(a)
    assert a.parent.refs == 0 and a.refs == 0


def test_peek_matches_as_match_does_without_touching() -> None:
    tree, _ = make_tree()
    tree.insert((1, 2, 3, 4), lambda s, e: "a")
    tree.insert((1, 2, 7), lambda s, e: "b")
    before = {node.handle: node.last_access for node in tree.nodes()}
    peeked = tree.peek((1, 2, 3, 9))
    assert peeked.length == 3 and [n.handle for n in peeked.nodes] == ["a[:2]", "a[2:]"]
    assert {node.handle: node.last_access for node in tree.nodes()} == before
    matched = tree.match((1, 2, 3, 9))
    assert (matched.length, matched.nodes) == (peeked.length, peeked.nodes)
    assert [node.last_access for node in matched.nodes] == [5, 5]  # the clock's next tick, after 4 of them
