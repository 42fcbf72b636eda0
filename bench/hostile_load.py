"""The hostile side of `tenzro bench hostile`: each case's requests, sent over raw sockets to the node's loopback
address from a process of their own, and what the node answered each.

Raw asyncio streams, not an HTTP client: a case must send exactly its bytes (a `Content-Encoding` its body does not
have, two `Authorization` lines, a header line that never ends, a body that trickles), which a client library
would compress, correct or refuse to send. Every request says `Connection: close`, so one exchange is one
connection; the connection is aborted as soon as the status line is read, and every exchange ends by the case's
deadline at the latest ("open": the node still held it then). The answer is read while the request is still
being sent, so a node that answers before it has read the body (and closes) is heard, not taken for a reset.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.queues
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

GZIP_INFLATED_BYTES = 1024**3
"""The gzip bomb inflates to this (its body is about a thousandth of it, the most deflate compresses zeros)."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The node's default request body limit (`limits.max_body_bytes`): the largest bodies the cases send."""
EMPTY_MESSAGES = 289_255
"""The issue's count: as many empty messages as fit in an 8 MiB chat body."""
BIG_INT_DIGITS = 5000
"""Over the interpreter's 4,300-digit limit on converting text to an int."""
BIG_INT_BODY_BYTES = 1024 * 1024 + 4096
"""Over a MiB: the node parses larger bodies with the standard library's json, which enforces that limit."""
SLOW_BODY_BYTES, TRICKLE_BYTES, TRICKLE_S = 1024 * 1024, 64, 0.5
"""The slow body announces a MiB and sends 64 bytes every half second: it never completes within a case."""
REFUSED_PAUSE_S = 0.1
"""A client whose connection was refused waits this long, so a node that is gone is not spun against."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One case's hostile load, handed to its process (plain data: it is pickled)."""

    case: str
    host: str
    """A loopback address literal."""
    port: int
    clients: int
    seconds: float
    keys: tuple[str, ...]
    """Caller keys of the hostile callers; client i uses keys[i % len(keys)]. Empty for keyless cases' runs."""
    model: str
    bomb: bytes = b""
    """The gzip bomb's body, built once per run (it takes seconds); empty for the other cases."""


@dataclass(frozen=True, slots=True)
class Request:
    head: bytes
    """Sent at once; a slowloris head stops inside a header line."""
    body: bytes = b""
    trickle: int = 0
    """Above 0: the body goes this many bytes every TRICKLE_S instead of at once."""


@dataclass(frozen=True, slots=True)
class Exchange:
    outcome: str
    """The status the node answered ("415"), or what happened instead: "open" (unanswered at the deadline),
    "closed" (closed without an answer), "reset", "refused" (no connection), "garbled" (not an HTTP status line)."""
    seconds: float


@dataclass
class Tally:
    """What one case's hostile clients got: exchanges by outcome, and the time of each the node answered."""

    outcomes: Counter[str] = field(default_factory=Counter)
    answer_ms: list[float] = field(default_factory=list)

    def add(self, exchange: Exchange) -> None:
        self.outcomes[exchange.outcome] += 1
        if exchange.outcome.isdigit():
            self.answer_ms.append(exchange.seconds * 1000.0)


def gzip_bomb(inflated_bytes: int = GZIP_INFLATED_BYTES) -> bytes:
    """A gzip stream of `inflated_bytes` zeros, compressed a MiB at a time (never all in memory)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(min(inflated_bytes, 1024 * 1024))
    parts = []
    for start in range(0, inflated_bytes, len(chunk)):
        parts.append(compressor.compress(chunk[:inflated_bytes - start]))
    parts.append(compressor.flush())
    return b"".join(parts)


def _authority(plan: Plan) -> str:
    return f"[{plan.host}]:{plan.port}" if ":" in plan.host else f"{plan.host}:{plan.port}"


def head(plan: Plan, method: str, path: str, headers: tuple[tuple[str, str], ...] = (),
         body_bytes: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {_authority(plan)}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    if body_bytes is not None:
        lines.append(f"Content-Length: {body_bytes}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _post(plan: Plan, path: str, body: bytes, *headers: tuple[str, str]) -> Request:
    return Request(head(plan, "POST", path, (("Content-Type", "application/json"), *headers), len(body)), body)


def _bearer(key: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {key}")


def _chat_body(plan: Plan, content: str = "hi", max_tokens: str = "4") -> bytes:
    return (f'{{"model":{json.dumps(plan.model)},"messages":[{{"role":"user","content":{json.dumps(content)}}}],'
            f'"max_tokens":{max_tokens}}}').encode()


def gzip_bomb_request(plan: Plan, key: str) -> Request:
    return _post(plan, "/v1/chat/completions", plan.bomb, ("Content-Encoding", "gzip"))


def false_gzip_request(plan: Plan, key: str) -> Request:
    return _post(plan, "/v1/chat/completions", _chat_body(plan), ("Content-Encoding", "gzip"), _bearer(key))


def empty_messages_request(plan: Plan, key: str) -> Request:
    messages = ",".join(['{"role":"user","content":""}'] * EMPTY_MESSAGES)
    body = f'{{"model":{json.dumps(plan.model)},"max_tokens":4,"messages":[{messages}]}}'.encode()
    return _post(plan, "/v1/chat/completions", body, _bearer(key))


def rpc_request(plan: Plan, key: str) -> Request:
    """An 8 MiB call with no key: its one param a list of zeros, the costliest JSON to parse per byte."""
    opening, closing = b'{"jsonrpc":"2.0","method":"tenzro_getAttestation","id":1,"params":[[0', b"]]}"
    zeros = (MAX_BODY_BYTES - len(opening) - len(closing)) // 2
    body = opening + b",0" * zeros + b" " * ((MAX_BODY_BYTES - len(opening) - len(closing)) % 2) + closing
    return _post(plan, "/rpc", body)


def slowloris_request(plan: Plan, key: str) -> Request:
    return Request(f"GET /health HTTP/1.1\r\nHost: {_authority(plan)}\r\nX-Slow: ".encode())


def slow_body_request(plan: Plan, key: str) -> Request:
    body = _chat_body(plan, "a" * SLOW_BODY_BYTES)[:SLOW_BODY_BYTES]
    return Request(_post(plan, "/v1/chat/completions", body, _bearer(key)).head, body, TRICKLE_BYTES)


def big_int_request(plan: Plan, key: str) -> Request:
    digits = "9" * BIG_INT_DIGITS
    padding = BIG_INT_BODY_BYTES - len(_chat_body(plan, "", digits))
    return _post(plan, "/v1/chat/completions", _chat_body(plan, "a" * padding, digits), _bearer(key))


def two_authorizations_request(plan: Plan, key: str) -> Request:
    """The caller's key first, another after it: a node that reads the first alone answers 200."""
    return Request(head(plan, "GET", "/v1/models", (_bearer(key), _bearer("sk-not-this-one"))))


Builder = Callable[[Plan, str], Request]


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    clients: int
    """The issue's count of hostile clients (connections held, for `stalls`)."""
    stalls: bool
    """Its clients hold connections open (counted by `--connections`) rather than loop requests (`--clients`)."""
    keyed: bool
    """Its requests carry a caller's key."""
    what: str
    build: Builder


CASES = {case.name: case for case in (
    Case("gzip-bomb", 4, False, False, "no key: a 1 MB gzip body that inflates to 1 GiB", gzip_bomb_request),
    Case("false-gzip", 4, False, True, "a plain JSON body marked Content-Encoding: gzip", false_gzip_request),
    Case("empty-messages", 2, False, True, f"{EMPTY_MESSAGES:,} empty messages, an 8 MiB chat body",
         empty_messages_request),
    Case("rpc", 8, False, False, "no key: an 8 MiB /rpc call", rpc_request),
    Case("slowloris", 200, True, False, "a header line that never ends", slowloris_request),
    Case("slow-body", 200, True, True, "complete headers, then 64 bytes of the body every 0.5 s",
         slow_body_request),
    Case("big-ints", 4, False, True, f"a {BIG_INT_DIGITS}-digit max_tokens in a body over 1 MiB", big_int_request),
    Case("two-auth", 4, False, True, "GET /v1/models with two Authorization headers", two_authorizations_request),
)}


async def _send(writer: asyncio.StreamWriter, request: Request) -> None:
    writer.write(request.head)
    if not request.trickle:
        writer.write(request.body)
        await writer.drain()
        return
    for start in range(0, len(request.body), request.trickle):
        await writer.drain()
        await asyncio.sleep(TRICKLE_S)
        writer.write(request.body[start:start + request.trickle])
    await writer.drain()


async def _status(reader: asyncio.StreamReader) -> str:
    try:
        line = await reader.readline()
    except (ConnectionError, ValueError):  # ValueError: a line over the reader's limit
        return "reset"
    if not line:
        return "closed"
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return parts[1].decode()
    return "garbled"


async def exchange(host: str, port: int, request: Request, deadline: float) -> Exchange:
    """Send `request` on a connection of its own and read the answer's status, by `deadline` (the loop's clock)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout_at(deadline):
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                return Exchange("refused", loop.time() - started)
            sending = asyncio.create_task(_send(writer, request))
            try:
                outcome = await _status(reader)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            return Exchange(outcome, loop.time() - started)
    except TimeoutError:
        return Exchange("open", loop.time() - started)
    finally:
        if writer is not None:
            writer.transport.abort()


async def _client(plan: Plan, request: Request, deadline: float, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        done = await exchange(plan.host, plan.port, request, deadline)
        tally.add(done)
        if done.outcome == "refused":
            await asyncio.sleep(min(REFUSED_PAUSE_S, max(deadline - loop.time(), 0.0)))


async def hostile_load(plan: Plan, started: Callable[[], None] = lambda: None) -> Tally:
    """The case's clients for `plan.seconds` from when `started` is called (after the requests are built)."""
    case = CASES[plan.case]
    keys = plan.keys if case.keyed else ("",)
    built = {key: case.build(plan, key) for key in dict.fromkeys(keys)}
    tally = Tally()
    loop = asyncio.get_running_loop()
    started()
    deadline = loop.time() + plan.seconds
    clients = [_client(plan, built[keys[i % len(keys)]], deadline, tally) for i in range(plan.clients)]
    await asyncio.gather(*clients)
    return tally


def hostile_process(plan: Plan, results: multiprocessing.queues.Queue[tuple[str, Tally | None]]) -> None:
    """A process's whole life: put ("ready", None) as the load starts, then ("done", its tally)."""
    tally = asyncio.run(hostile_load(plan, lambda: results.put(("ready", None))))
    results.put(("done", tally))
    results.close()
    results.join_thread()
