"""Signed metering of a real node on loopback: records match usage and the times the client saw, prices
come from the CLI, records and proofs are visible only to whom they belong (and auditors), `metering sla`
reports the records' times, and a SIGKILLed node's ledger verifies."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

from metering.pricing import DEFAULT_PRICING, load_pricing
from metering.record import UsageRecord
from metering.tree_head import InclusionProof, TreeHead, TreeHeadError
from tests.node.conftest import Node, tenzro


def get(url: str, key: str | None = None, **params: str) -> tuple[int, Any]:
    async def fetch() -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as session, session.get(url, params=params, headers=headers) as resp:
            return resp.status, await resp.json()

    return asyncio.run(fetch())


def set_prices(path: Path, env: dict[str, str], **prices: int) -> None:
    flags = {"input": "--input-price-wei", "output": "--output-price-wei",
             "cached_read": "--price-per-cached-read-token-wei", "cached_write": "--price-per-cached-write-token-wei"}
    args = [arg for name, value in prices.items() for arg in (flags[name], str(value))]
    result = tenzro("provider", "pricing", "set", *args, "--pricing", str(path), env=env)
    assert result.returncode == 0, result.stdout


def cost(record: dict[str, Any], input: int, output: int, cached_read: int, cached_write: int) -> str:
    uncached = record["input_tokens"] - record["cached_read_tokens"] - record["cached_write_tokens"]
    return str(uncached * input + record["cached_read_tokens"] * cached_read
               + record["cached_write_tokens"] * cached_write + record["output_tokens"] * output)


def check_times(record: dict[str, Any], server_ttft_ms: float | None = None,
                client_ms: float | None = None) -> None:
    """A record that got a first token: times ordered from the enqueue, at least the first token time the
    node reported in `usage` (measured from the job's start), at most the time the client waited."""
    assert record["output_tokens"] > 0
    assert 0 <= record["queue_wait_ms"] <= record["ttft_ms"] <= record["total_ms"]
    assert record["ttft_ms"] >= 1  # rounded up: a token that came took some time
    if server_ttft_ms is not None:
        assert record["ttft_ms"] >= server_ttft_ms - 0.001  # usage rounds to the microsecond
    if client_ms is not None:
        assert record["total_ms"] <= math.ceil(client_ms)


def add_auditor(node: Node, name: str) -> str:
    result = tenzro("keys", "add", name, "--role", "auditor", "--config", str(node.config), env=node.env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_three_turn_conversation_is_metered_at_the_prices_set_through_the_cli(
        node_factory, small_model_dir: Path, tmp_path: Path) -> None:
    env = {"TENZRO_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    pricing, ledger = tmp_path / "prices.yaml", tmp_path / "ledger"
    set_prices(pricing, env, input=7, output=13, cached_read=2, cached_write=9)
    node = node_factory(small_model_dir, "--pricing", str(pricing), "--ledger", str(ledger))
    alice_key, bob_key = node.add_key("alice"), node.add_key("bob")
    alice = openai.OpenAI(base_url=node.base, api_key=alice_key, max_retries=0)
    model = small_model_dir.name
    messages = [{"role": "system", "content": "You are a terse assistant for the metering test."}]
    turns: list[tuple[str, Any, float]] = []  # (completion id, usage, ms the client waited) per turn
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: which flowers grow in the shade?"})
        if turn < 2:
            sent = time.perf_counter()
            reply = alice.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
            turns.append((reply.id, reply.usage, (time.perf_counter() - sent) * 1000))
            text = reply.choices[0].message.content
        else:
            set_prices(pricing, env, output=17)  # while the node runs
            sent = time.perf_counter()
            chunks = list(alice.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
            turns.append((chunks[0].id, chunks[-1].usage, (time.perf_counter() - sent) * 1000))
            assert {chunk.id for chunk in chunks} == {chunks[0].id}
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        messages.append({"role": "assistant", "content": text})

    records = []
    for turn, (completion_id, usage, client_ms) in enumerate(turns):
        status, record = get(node.base + "/generation", alice_key, id=completion_id)
        assert status == 200
        records.append(record)
        assert usage.cached_read_tokens == usage.prompt_tokens_details.cached_tokens
        assert (record["record_id"], record["seq"], record["caller_id"], record["model"], record["status"]) == (
            completion_id, turn, "alice", model, "completed")
        assert (record["input_tokens"], record["cached_read_tokens"], record["cached_write_tokens"],
                record["output_tokens"]) == (usage.prompt_tokens, usage.cached_read_tokens,
                                             usage.cached_write_tokens, usage.completion_tokens)
        # What was not read from reuse was computed and stored for the next turn.
        assert usage.cached_read_tokens + usage.cached_write_tokens == usage.prompt_tokens
        output_price = 17 if turn == 2 else 13
        assert (record["input_price_wei"], record["output_price_wei"], record["cached_read_price_wei"],
                record["cached_write_price_wei"]) == ("7", str(output_price), "2", "9")
        assert record["cost_wei"] == cost(record, 7, output_price, 2, 9)
        check_times(record, usage.server_ttft_ms, client_ms)
    assert records[0]["cached_read_tokens"] == 0
    assert records[1]["cached_read_tokens"] >= records[0]["input_tokens"]
    assert records[2]["cached_read_tokens"] >= records[1]["input_tokens"]

    not_found = get(node.base + "/generation", bob_key, id="chatcmpl-0123456789abcdef0123456789abcdef")
    assert not_found[0] == 404 and not_found[1]["error"]["code"] == "generation_not_found"
    assert get(node.base + "/generation", bob_key, id=turns[0][0]) == not_found
    assert get(node.base + "/generation", alice_key, id="chatcmpl-0123456789abcdef0123456789abcdef") == not_found

    status, identity = get(node.base + "/node")
    assert status == 200 and identity["prices"]["output_price_wei"] == "17"
    segment = ledger / identity["ledger_segment"]
    assert segment.name == f"ledger-{identity['boot_id']}.jsonl"
    verified = tenzro("metering", "verify", str(segment), "--node-key", identity["public_key"], env=env)
    assert verified.returncode == 0, verified.stdout
    assert verified.stdout.startswith(f"OK {segment}: 3 records verified under key {identity['key_id']}")
    status, head = get(node.base + "/metering/checkpoint", alice_key)
    assert status == 200 and head["size"] == 3 and head["key_id"] == identity["key_id"]
    assert len(head["evidence_digest"]) == 64
    assert {record["evidence_digest"] for record in records} == {head["evidence_digest"]}
    (tmp_path / "head.json").write_text(json.dumps(head))
    against_head = tenzro("metering", "verify", str(segment), "--node-key", identity["public_key"],
                          "--tree-head", str(tmp_path / "head.json"), env=env)
    assert against_head.returncode == 0, against_head.stdout
    assert f"tree head of 3 records; Merkle root {head['root_hash_hex']}" in against_head.stdout
    bill = tenzro("metering", "bill", str(ledger), "--caller", "alice", "--node-key", identity["public_key"], env=env)
    assert bill.returncode == 0, bill.stdout
    total = bill.stdout.splitlines()[-1].split()
    assert total[0] == "TOTAL" and total[-1] == str(sum(int(r["cost_wei"]) for r in records))

    ttfts, totals = sorted(r["ttft_ms"] for r in records), sorted(r["total_ms"] for r in records)
    for promise, share in ((ttfts[-1], "3/3 = 100.00%"), (ttfts[0] - 1, "0/3 = 0.00%")):
        sla = tenzro("metering", "sla", str(ledger), "--caller", "alice", "--ttft-ms", str(promise),
                     "--node-key", identity["public_key"], env=env)
        assert sla.returncode == 0, sla.stdout
        lines = sla.stdout.splitlines()
        assert lines[0].startswith(f"OK {segment}: 3 records verified under key {identity['key_id']} "
                                   f"(evidence {head['evidence_digest']}; code {identity['code']['digest']}; "
                                   f"model {model} {identity['models'][0]['digest']})")
        assert lines[2:4] == ["requests 3, with a first token 3", f"ttft_ms <= {promise}: {share}"]
        # Nearest rank of 3 values: p50 is the 2nd, p90 and p99 the 3rd.
        assert [line.split() for line in lines[5:]] == [
            ["ttft_ms", str(ttfts[1]), str(ttfts[2]), str(ttfts[2])],
            ["total_ms", str(totals[1]), str(totals[2]), str(totals[2])],
        ]


def test_auditors_read_every_record_and_proofs_verify(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    alice_key, bob_key, auditor_key = node.add_key("alice"), node.add_key("bob"), add_auditor(node, "audit")
    model = small_model_dir.name
    ids = []
    for key in (alice_key, alice_key, bob_key):
        c = openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
        ids.append(c.completions.create(model=model, prompt=list(range(300, 340)), max_tokens=3).id)
    home = Path(node.env["TENZRO_HOME"])
    assert load_pricing(home / "pricing.yaml") == DEFAULT_PRICING  # written at start from policies/
    about = get(node.base + "/node")[1]
    # The segment, and the evidence binding its key.
    assert sorted(path.name for path in (home / "ledger").iterdir()) == [
        f"{about['boot_id']}.evidence.json", about["ledger_segment"]]

    status, refused = get(node.base + "/metering/records", alice_key)
    assert status == 403
    assert (refused["error"]["type"], refused["error"]["code"]) == ("permission_error", "auditor_role_required")
    assert get(node.base + "/metering/records", None)[0] == 401
    status, page = get(node.base + "/metering/records", auditor_key)
    assert status == 200
    assert [(r["seq"], r["record_id"], r["caller_id"]) for r in page["data"]] == [
        (0, ids[0], "alice"), (1, ids[1], "alice"), (2, ids[2], "bob")]
    assert (page["object"], page["next_since"], page["has_more"]) == ("list", 3, False)
    status, part = get(node.base + "/metering/records", auditor_key, since="1", limit="1")
    assert [r["seq"] for r in part["data"]] == [1] and (part["next_since"], part["has_more"]) == (2, True)
    assert get(node.base + "/metering/records", auditor_key, since="3")[1]["data"] == []

    public_key = get(node.base + "/node")[1]["public_key"]
    status, answer = get(node.base + "/metering/proof", alice_key, id=ids[1])
    assert status == 200
    record, head = UsageRecord.from_json(answer["record"]), TreeHead.from_json(answer["tree_head"])
    proof = InclusionProof(**{**answer["proof"], "audit_path": tuple(answer["proof"]["audit_path"])})
    assert (proof.record_id, proof.leaf_index, proof.tree_size, head.size) == (ids[1], 1, 3, 3)
    proof.verify(record, head, public_key)
    other = UsageRecord.from_json(page["data"][2])
    try:
        proof.verify(other, head, public_key)
        raise AssertionError("a proof for one record verified another")
    except TreeHeadError as exc:
        assert str(exc).startswith(f"proof is for record {ids[1]} at 1")
    unknown = get(node.base + "/metering/proof", bob_key, id="cmpl-unknown")
    assert unknown[0] == 404
    assert get(node.base + "/metering/proof", bob_key, id=ids[0]) == unknown
    assert get(node.base + "/metering/proof", auditor_key, id=ids[0])[1]["record"]["caller_id"] == "alice"
    assert get(node.base + "/metering/checkpoint", None)[0] == 401


def test_a_stream_the_client_leaves_is_recorded_as_cancelled(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    key = node.add_key("alice")
    prompt, max_tokens = list(range(500, 1000)), 3000

    async def leave_after_first_chunk() -> str:
        body = {"model": small_model_dir.name, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(node.base + "/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as response:
                while not (line := await response.content.readline()).startswith(b"data: "):
                    pass
                response.close()  # the client goes away mid-stream
            return str(json.loads(line[6:])["id"])

    async def wait_for_record(completion_id: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                async with session.get(node.base + "/generation", params={"id": completion_id},
                                       headers={"Authorization": f"Bearer {key}"}) as response:
                    if response.status == 200:
                        return dict(await response.json())
                await asyncio.sleep(0.1)
        raise AssertionError("the cancelled completion was never recorded")

    completion_id = asyncio.run(leave_after_first_chunk())
    record = asyncio.run(wait_for_record(completion_id))
    assert (record["status"], record["input_tokens"], record["cached_read_tokens"],
            record["cached_write_tokens"]) == ("cancelled", 500, 0, 500)
    assert 1 <= record["output_tokens"] < max_tokens
    check_times(record)
    assert record["cost_wei"] == cost(record, **{name[:-len("_price_wei")]: int(record[name]) for name in (
        "input_price_wei", "output_price_wei", "cached_read_price_wei", "cached_write_price_wei")})


def test_sigkill_under_load_leaves_a_ledger_that_verifies_to_its_last_complete_record(
        node_factory, small_model_dir: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    node = node_factory(small_model_dir, "--ledger", str(ledger))
    key = node.add_key("alice")
    identity = get(node.base + "/node")[1]
    segment, public_key = ledger / identity["ledger_segment"], identity["public_key"]
    delivered: list[str] = []  # completion ids whose response reached the client

    async def client(session: aiohttp.ClientSession, worker: int) -> None:
        body = {"model": small_model_dir.name, "prompt": list(range(1000 + worker * 50, 1040 + worker * 50)),
                "max_tokens": 4}
        while True:
            try:
                async with session.post(node.base + "/completions", json=body) as response:
                    delivered.append((await response.json())["id"])
            except aiohttp.ClientError:
                return  # the node is gone

    async def load_then_kill() -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as session:
            workers = [asyncio.create_task(client(session, worker)) for worker in range(16)]
            while len(delivered) < 24:
                await asyncio.sleep(0.01)
            async with session.get(node.base + "/metering/checkpoint") as response:
                head = dict(await response.json())
            while len(delivered) < 48:
                await asyncio.sleep(0.01)
            node.process.kill()
            node.process.wait()
            await asyncio.gather(*workers)
            return head

    head = asyncio.run(load_then_kill())
    data = segment.read_bytes()
    lines = data.split(b"\n")
    complete = lines[1:-1]  # after the header; the last piece is b"" or a torn line
    in_ledger = {json.loads(line)["record_id"]: json.loads(line)["status"] for line in complete}
    assert set(delivered) <= set(in_ledger) and {in_ledger[i] for i in delivered} == {"completed"}
    assert head["size"] >= 24 and len(complete) >= len(delivered) >= 48

    (tmp_path / "head.json").write_text(json.dumps(head))
    report = tenzro("metering", "verify", str(segment), "--node-key", public_key, "--tree-head",
                    str(tmp_path / "head.json"), env=node.env)
    if data.endswith(b"\n"):
        assert report.returncode == 0, report.stdout
        assert report.stdout.startswith(f"OK {segment}: {len(complete)} records verified")
    else:
        assert report.returncode == 1
        assert f"line {len(complete) + 2}, seq {len(complete)}: torn-line" in report.stdout

    torn = tmp_path / segment.name  # the complete lines, the last record then cut mid-line
    whole = data[:data.rfind(b"\n") + 1]
    torn.write_bytes(whole[:whole.rstrip(b"\n").rfind(b"\n") + 1] + complete[-1][:40])
    records_before = len(complete) - 1
    report = tenzro("metering", "verify", str(torn), "--node-key", public_key, env=node.env)
    assert report.returncode == 1
    assert report.stdout.splitlines() == [
        f"FAILED {torn}: line {records_before + 2}, seq {records_before}: torn-line: the final line (40 bytes) "
        f"is incomplete and is not a record; the {records_before} records before it verify",
        f"{records_before} records before it verified under key {identity['key_id']}",
    ]
