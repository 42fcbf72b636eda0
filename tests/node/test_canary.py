"""Canaries (issues 11 and 33): a request's text and token ids reach no file; they are nowhere in the node's memory
once its reply has settled (nor after other callers' requests, the caller's key removal or its time to live);
and a caller's keys and values leave the node's memory once another caller's request has replaced its hot working
cache.

All run a real node. The memory canary reads the node's memory through /proc/PID/mem, which the node's
PR_SET_DUMPABLE 0 leaves open to root only (CAP_SYS_PTRACE); elsewhere it is skipped.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from node.config import Limits
from node.engine.device import prefill_chunk
from node.engine.loader import load_model
from tests.node.conftest import Node, stop_node, tenzro

LINUX = pytest.mark.skipif(sys.platform != "linux", reason="/proc/PID/maps and /proc/PID/mem are Linux's")
CHUNK_BYTES = 64 << 20
SETTLE_TIMEOUT_S = 10.0

RowKey = tuple[str, int, int, int]
"""(keys or values, layer, kv head, token position)."""


def client(node: Node, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)


# -- files -------------------------------------------------------------------------------------------------


def id_needles(ids: list[int]) -> dict[str, bytes]:
    """A token id sequence as a file could hold it: decimal text and little-endian int32/int64 arrays."""
    return {"ids, ": ", ".join(map(str, ids)).encode(), "ids,": ",".join(map(str, ids)).encode(),
            "ids space": " ".join(map(str, ids)).encode(), "ids int32": np.array(ids, "<i4").tobytes(),
            "ids int64": np.array(ids, "<i8").tobytes()}


def files_touched(roots: list[Path], since: float) -> Iterator[Path]:
    for root in roots:
        candidates = [root] if root.is_file() else root.rglob("*") if root.is_dir() else []
        for path in candidates:
            if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= since:
                yield path


def test_request_text_and_token_ids_reach_no_file(node_factory, small_model_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    since = time.time() - 1.0  # file times come from a coarse clock, which can lag time.time() a little
    node_tmp = tmp_path / "tmp"
    node_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(node_tmp))  # the node's environment is copied from ours
    node = node_factory(small_model_dir)
    c, model = client(node, node.add_key("alice")), small_model_dir.name
    marker = " ".join(uuid.uuid4().hex for _ in range(2))
    tokenizer = AutoTokenizer.from_pretrained(small_model_dir)
    # Mid-sentence the marker follows a space; its first id may merge with what precedes it, so it is left out.
    plain, spaced = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (marker, " " + marker))

    messages = [{"role": "system", "content": "You keep codes."},
                {"role": "user", "content": f"Remember the code {marker} for me."}]
    first = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": f"Repeat the code {marker} once."}]
    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "And once more."}]
    third = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens > len(spaced)  # the history with the marker was reused
    c.completions.create(model=model, prompt=f"The code is {marker}", max_tokens=4, temperature=0)
    list(c.completions.create(model=model, prompt=spaced, max_tokens=4, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": marker}], max_tokens=0)
    with pytest.raises(openai.BadRequestError):  # an id past the vocabulary: the error must not quote the prompt
        c.completions.create(model=model, prompt=spaced + [10**7], max_tokens=4)
    stop_node(node)
    assert node.process.returncode is not None

    home = Path(node.env["TENZRO_HOME"])
    cache = Path.home() / ".cache"
    roots = [node.config.parent, home, node_tmp, *cache.glob("torch*"), cache / "tenzro", small_model_dir]
    files = sorted(set(files_touched(roots, since)))
    log, ledger = node.config.parent / "node.log", [path for path in files if path.is_relative_to(home / "ledger")]
    assert log in files and log.stat().st_size > 0
    assert ledger and sum(path.stat().st_size for path in ledger) > 0  # the requests were metered, on disk
    needles = {"marker": marker.encode(), **{f"marker word {i}": w.encode() for i, w in enumerate(marker.split())},
               **{f"{name} (alone)": n for name, n in id_needles(plain[1:]).items()},
               **{f"{name} (after a space)": n for name, n in id_needles(spaced[1:]).items()}}
    found = {}
    for path in files:
        data = path.read_bytes()
        hits = [name for name, needle in needles.items() if needle in data]
        if hits:
            found[str(path)] = hits
    print(f"scanned {len(files)} files, {sum(p.stat().st_size for p in files) >> 10} KiB, for {len(needles)} forms")
    assert found == {}


# -- memory ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Region:
    start: int
    end: int
    perms: str
    name: str
    """The mapped file's path, "[heap]", "[stack]", ..., or "" for anonymous memory."""

    def describe(self) -> str:
        return f"{self.name or 'anonymous'} {self.perms} {self.start:#x}+{(self.end - self.start) >> 10} KiB"


@dataclass(frozen=True, slots=True)
class Hit:
    address: int
    region: Region


@dataclass(frozen=True, slots=True)
class MemoryScan:
    rows_bytes: dict[RowKey, bytes]
    rows: dict[RowKey, list[Hit]]
    text: list[Hit]
    scanned_bytes: int
    seconds: float

    def rows_found(self) -> set[RowKey]:
        return {row for row, hits in self.rows.items() if hits}

    def summary(self) -> str:
        hits = [(row, hit) for row, found in self.rows.items() for hit in found]
        by_region = Counter(hit.region.describe() for _, hit in hits)
        by_layer = Counter(f"{kind} of layer {layer}" for (kind, layer, _, _), _ in hits)
        return (f"{len(self.rows_found())} of {len(self.rows)} rows, {len(hits)} copies; by region "
                f"{dict(by_region)}; by kind {dict(by_layer)}; head strides in rows "
                f"{ {name: strides.most_common(3) for name, strides in self.head_strides().items()} }")

    def head_strides(self) -> dict[str, Counter[int]]:
        """Per kind and layer, how many rows apart head 1's copy of a position lies from head 0's, which names
        the tensor: 1, token-major `[tokens, heads, dim]` as the projections write it; the working cache's
        capacity, its buffer `[heads, capacity, dim]`."""
        strides: dict[str, Counter[int]] = {}
        for (kind, layer, head, position), found in self.rows.items():
            row_bytes = len(self.rows_bytes[(kind, layer, head, position)])
            for first in found if head == 0 else ():
                for second in self.rows.get((kind, layer, 1, position), []):
                    if 0 < second.address - first.address < 1 << 20:
                        strides.setdefault(f"{kind} {layer}", Counter())[(second.address - first.address)
                                                                         // row_bytes] += 1
        return strides


def readable_regions(pid: int) -> list[Region]:
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        name = fields[5].strip() if len(fields) > 5 else ""
        if fields[1].startswith("r") and name not in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
            last = regions[-1] if regions else None
            if last is not None and last.end == start and last.perms == fields[1] and last.name == name:
                # One allocation split into mappings (madvise(MADV_DONTDUMP) on its whole pages does that): read
                # as one, or a row across the split would be missed.
                regions[-1] = Region(last.start, end, last.perms, name)
            else:
                regions.append(Region(start, end, fields[1], name))
    return regions


def scan_memory(pid: int, rows: dict[RowKey, bytes], text: bytes) -> MemoryScan:
    """Every copy of each row and of `text` in the process's readable memory.

    Rows are float32, so every copy of one starts 4-byte aligned: a table of the rows' first words (their low
    24 bits) picks the few aligned candidates, which are then compared whole.
    """
    started = time.perf_counter()
    by_word: dict[int, list[RowKey]] = {}
    for row, data in rows.items():
        by_word.setdefault(int.from_bytes(data[:4], "little"), []).append(row)
    words = np.array(list(by_word), dtype=np.uint32)
    table = np.zeros(1 << 24, dtype=bool)
    table[words & 0xFFFFFF] = True
    overlap = max(max(map(len, rows.values())), len(text))
    found: dict[RowKey, list[Hit]] = {row: [] for row in rows}
    text_hits: list[Hit] = []
    scanned = 0
    for region, start, limit, data in memory_chunks(pid, overlap):
        scanned += len(data)
        view = np.frombuffer(data, dtype=np.uint32, count=len(data) // 4)
        candidates = np.flatnonzero(table[view & 0xFFFFFF])
        for index in candidates[np.isin(view[candidates], words)].tolist():
            offset = 4 * index
            for row in by_word[int(view[index])] if start + offset < limit else ():
                if data[offset:offset + len(rows[row])] == rows[row]:
                    found[row].append(Hit(start + offset, region))
        text_hits.extend(Hit(start + offset, region) for offset in occurrences(data, text, limit - start))
    return MemoryScan(rows, found, text_hits, scanned, time.perf_counter() - started)


def memory_chunks(pid: int, overlap: int) -> Iterator[tuple[Region, int, int, bytes]]:
    """(region, start, limit, bytes from start) over the process's readable memory: a match that starts before
    `limit` lies whole in the bytes (they run `overlap` past it)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for region in readable_regions(pid):
            for start in range(region.start, region.end, CHUNK_BYTES):
                limit = min(region.end, start + CHUNK_BYTES)
                try:
                    memory.seek(start)
                    data = memory.read(min(region.end, limit + overlap) - start)
                except OSError:
                    continue
                yield region, start, limit, data


def occurrences(data: bytes, needle: bytes, limit: int) -> Iterator[int]:
    offset = data.find(needle)
    while 0 <= offset < limit:
        yield offset
        offset = data.find(needle, offset + 1)


@torch.inference_mode()
def working_cache_rows(model_dir: Path, prompt: list[int]) -> dict[RowKey, bytes]:
    """The K/V rows a prompt leaves in the node's working cache (but first-layer values), computed as the node
    computes them: its loader, its forward path (native kernels or transformers, one thread: tests/conftest.py),
    its working-cache layers, its prefill chunks."""
    loaded = load_model(model_dir.name, model_dir)
    assert loaded.state is not None
    cache = loaded.state.working_cache(len(prompt))
    chunk = prefill_chunk(loaded.device, Limits().prefill_chunk)
    for start in range(0, len(prompt), chunk):
        loaded.forward.prefill(prompt[start:start + chunk], start, cache)
    rows: dict[RowKey, bytes] = {}
    for index, layer in enumerate(cache.layers):
        # A first-layer value row is a function of its token alone: any prompt holding that token (the node's
        # load-time checks hold thousands) writes the same bytes, which say nothing about whose state is left.
        for kind, tensor in (("keys", layer.keys), ("values", layer.values))[:1 if index == 0 else 2]:
            for head in range(tensor.shape[1]):
                for position in range(len(prompt)):
                    rows[(kind, index, head, position)] = tensor[0, head, position].numpy().tobytes()
    return rows


def wait_settled(node: Node, operator: str) -> dict[str, Any]:
    """The node's sealing state once nothing is left in the hot tier (settle ran after the last reply)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        sealing: dict[str, Any] = node.state(operator)["sealing"]
        if sealing["plaintext_bytes"] == 0:
            return sealing
        time.sleep(0.01)
    raise AssertionError(f"the node did not settle in {SETTLE_TIMEOUT_S} s: {sealing}")


@LINUX
def test_a_callers_keys_and_values_leave_memory_once_another_callers_request_replaces_them(
        node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)  # one torch thread, as the in-process forward below
    pid = node.process.pid
    try:
        open(f"/proc/{pid}/mem", "rb").close()
    except PermissionError:
        pytest.skip("the node is not dumpable: only root (CAP_SYS_PTRACE) may read its memory")
    alice, bob = client(node, node.add_key("alice")), client(node, node.add_key("bob"))
    operator = node.add_key("ops", "operator")
    model = small_model_dir.name
    rng = random.Random(11)
    # Disjoint token ranges: a layer-0 key depends only on its token and position, a layer-0 value on its token
    # alone, so bob's prompt could otherwise write rows equal to some of alice's.
    prompt_a = [rng.randrange(100, 3000) for _ in range(300)]
    prompt_b = [rng.randrange(3000, 6000) for _ in range(400)]
    rows = working_cache_rows(small_model_dir, prompt_a)
    marker = uuid.uuid4().hex.encode()

    alice.chat.completions.create(model=model, messages=[{"role": "user", "content": f"My code is {marker.decode()}"}],
                                  max_tokens=1, temperature=0)
    alice.completions.create(model=model, prompt=prompt_a, max_tokens=1, temperature=0)
    assert wait_settled(node, operator)["sealed_bytes"] > 0
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5) as response:
        hygiene = json.load(response)["hygiene"]
    assert hygiene["freed_memory_overwritten"] is True  # the node re-ran itself with glibc's chunk cache off
    hot = scan_memory(pid, rows, marker)
    print(f"alice hot: {hot.summary()}; marker text {len(hot.text)} copies "
          f"({hot.scanned_bytes >> 20} MiB in {hot.seconds:.1f} s)")
    assert hot.rows_found() == set(rows)  # the scan sees alice's hot working cache

    bob.completions.create(model=model, prompt=prompt_b, max_tokens=1, temperature=0)
    wait_settled(node, operator)
    after = scan_memory(pid, rows, marker)
    print(f"after bob: {after.summary()}; marker text {len(after.text)} copies "
          f"in {Counter(hit.region.describe() for hit in after.text)}")
    left = len(after.rows_found())
    assert left == 0, f"alice's state is still in the node's memory: {after.summary()}"


# -- a caller's text and token ids ---------------------------------------------------------------------------


SMALL_INTS = 257
"""The interpreter keeps one object for each int from -5 to 256: a list or tuple of such ids is a run of pointers
to those objects, in the ids' order."""


def small_int_addresses(pid: int) -> dict[int, int]:
    """Where the interpreter of process `pid` keeps the small ints 0..256: at the same offsets from the start of
    the interpreter's mapped file as in this process (the same interpreter, at another address)."""
    def first_mapping(maps: str, path: str) -> int:
        return min(int(line.split()[0].split("-")[0], 16) for line in maps.splitlines()
                   if line.split(maxsplit=5)[5:] == [path])

    ours = Path("/proc/self/maps").read_text()
    for line in ours.splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= id(0) < end and len(fields) > 5:
            path = fields[5]
            break
    else:
        raise AssertionError("the small ints lie in no mapped file of this process")
    base = first_mapping(Path(f"/proc/{pid}/maps").read_text(), path) - first_mapping(ours, path)
    return {value: base + id(value) for value in range(SMALL_INTS)}


@dataclass(frozen=True, slots=True)
class Canary:
    """What one caller sends: a chat holding `marker`, and a text prompt of ids all small ints."""

    marker: str
    marker_ids: list[int]
    """The marker's ids after its first (which may merge with the text before it)."""
    small_ids: list[int]
    replies: list[tuple[str, list[int]]] = field(default_factory=list)
    """The first chat reply's text and ids once sent: the node keeps it, sealed, to recognise it when it is sent
    back (`cache/replies.py`)."""

    @staticmethod
    def make(tokenizer: Any, seed: int) -> Canary:
        rng = random.Random(seed)
        marker = " ".join(uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(2))
        spaced = tokenizer(" " + marker, add_special_tokens=False)["input_ids"]
        return Canary(marker, spaced[1:], [rng.randrange(SMALL_INTS) for _ in range(48)])

    def send(self, caller: openai.OpenAI, model: str) -> None:
        messages = [{"role": "system", "content": "You keep codes."},
                    {"role": "user", "content": f"Remember the code {self.marker} for me."}]
        first = caller.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"return_token_ids": True})
        reply = first.choices[0].message.content or ""
        self.replies.append((reply, list((first.choices[0].model_extra or {})["token_ids"])))
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Repeat the code {self.marker} once."}]
        stream = caller.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert first.usage is not None and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens_details is not None
        # The reply sent back was recognised: the first turn's prompt and its whole reply were reused.
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 6
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) is not None
        reused = caller.completions.create(model=model, prompt=self.small_ids, max_tokens=4, temperature=0)
        again = caller.completions.create(model=model, prompt=self.small_ids, max_tokens=4, temperature=0)
        assert reused.usage.prompt_tokens == len(self.small_ids)
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # stored, and found again by its digests

    def needles(self, small_ints: dict[int, int]) -> dict[str, bytes]:
        """Every form searched for: the marker's words (each is in every copy of the marker), its ids and the
        small prompt's as int32 and int64 little-endian runs, and the small prompt as a run of pointers; and the
        first reply's text and ids, which the node recognises when they are sent back."""
        text, ids = self.replies[0]
        reply = {"reply ids int32": np.array(ids, "<i4").tobytes(), "reply ids int64": np.array(ids, "<i8").tobytes()}
        if len(text.encode()) >= 16:  # long enough to be nowhere by chance
            reply["reply text"] = text.encode()
        return {**reply, **{f"marker word {i}": word.encode() for i, word in enumerate(self.marker.split())},
                "marker ids int32": np.array(self.marker_ids, "<i4").tobytes(),
                "marker ids int64": np.array(self.marker_ids, "<i8").tobytes(),
                "small ids int32": np.array(self.small_ids, "<i4").tobytes(),
                "small ids int64": np.array(self.small_ids, "<i8").tobytes(),
                "small ids as int objects": np.array([small_ints[i] for i in self.small_ids], "<u8").tobytes()}


def find_needles(pid: int, needles: dict[str, bytes]) -> dict[str, list[Hit]]:
    """Every copy of each needle in the process's readable memory, by needle."""
    found: dict[str, list[Hit]] = {name: [] for name in needles}
    for region, start, limit, data in memory_chunks(pid, max(map(len, needles.values()))):
        for name, needle in needles.items():
            found[name].extend(Hit(start + offset, region) for offset in occurrences(data, needle, limit - start))
    return found


def assert_gone(pid: int, canary: Canary, when: str) -> None:
    started = time.perf_counter()
    found = find_needles(pid, canary.needles(small_int_addresses(pid)))
    print(f"{when}: scanned in {time.perf_counter() - started:.1f} s")
    assert {name: [hit.region.describe() for hit in hits] for name, hits in found.items() if hits} == {}, when


RESERVE_BYTES = 64 << 20
"""The memory for sealed state that the scanned nodes reserve (the default's gigabyte would only slow the scan)."""


@LINUX
def test_a_callers_text_and_token_ids_are_nowhere_in_memory_once_its_reply_settled(
        node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir, config_text=f"cache:\n  reserve_bytes: {RESERVE_BYTES}\n")
    pid = node.process.pid
    try:
        open(f"/proc/{pid}/mem", "rb").close()
    except PermissionError:
        pytest.skip("the node is not dumpable: only root (CAP_SYS_PTRACE) may read its memory")
    with urllib.request.urlopen(node.url + "/v1/node", timeout=5) as response:
        assert json.load(response)["hygiene"]["freed_memory_overwritten"] is True
    model, tokenizer = small_model_dir.name, AutoTokenizer.from_pretrained(small_model_dir)
    alice, bob = client(node, node.add_key("alice")), client(node, node.add_key("bob"))
    operator = node.add_key("ops", "operator")
    canary = Canary.make(tokenizer, seed=1)

    canary.send(alice, model)
    wait_settled(node, operator)
    assert_gone(pid, canary, "after alice's replies settled")

    for seed in (2, 3):  # other callers' requests
        Canary.make(tokenizer, seed).send(bob, model)
    wait_settled(node, operator)
    assert_gone(pid, canary, "after bob's requests")

    removed = tenzro("keys", "remove", "alice", "--config", str(node.config), env=node.env)
    assert removed.returncode == 0, removed.stderr
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:  # the node re-reads its config every 0.5 s
        try:
            alice.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "alice's key still works"
        time.sleep(0.1)
    # The state of a removed key is dropped by the worker before it admits the next request.
    bob.completions.create(model=model, prompt=[7, 8, 9], max_tokens=1, temperature=0)
    wait_settled(node, operator)
    assert_gone(pid, canary, "after alice's key was removed")

    added = tenzro("keys", "add", "dave", "--ttl", "1", "--config", str(node.config), env=node.env)
    assert added.returncode == 0, added.stderr
    dave = client(node, added.stdout.strip().splitlines()[-1])
    entries = wait_settled(node, operator)["entries"]
    time.sleep(0.6)  # the node re-reads its config every 0.5 s
    short_lived = Canary.make(tokenizer, seed=4)
    short_lived.send(dave, model)
    assert wait_settled(node, operator)["entries"] > entries
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while node.state(operator)["sealing"]["entries"] > entries:  # unused for a second: expired at the next tick
        assert time.monotonic() < deadline, "dave's state did not expire"
        time.sleep(0.1)
    assert_gone(pid, short_lived, "after dave's time to live")
