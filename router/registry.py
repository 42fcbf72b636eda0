"""What the router knows of each provider, kept fresh by polling: up or down, offer (prices, jurisdiction, trust
tier, evidence), load, latency and verified summaries per model.

Every poll asks each provider for `GET /health` (with the router's key: the node then adds its queue's
depth and its running requests), `GET /v1/node` and, per model, `GET /v1/cache/summary`. A provider is up once its
health and its node document have answered, and down from the first failure, a poll's or a forwarded request's,
until a poll finds it answering again. A summary that cannot be fetched or verified leaves the provider up but cold.

A provider's load is its requests in flight: those of this router, counted from the moment it forwards one until
the answer has ended (or failed, or its client went away), plus the others the node held at the last poll (its
waiting and running requests less this router's then in flight). A finished request stops counting at once:
counted until the next poll, it pushed an agent's next turn, sent as soon as the reply ends, off the node holding
its conversation.

With a trust policy (`trust:` in the providers file) the router verifies each provider itself before it polls or
sends anything there (`client.verify`: the hardware, code, model and TLS channel under the policy, not the node's
own word), and every connection to it, polls and forwarded requests alike, is pinned to the certificate that
verification bound. A provider that does not verify is down, with the policy's reason. One whose certificate
changes (a pinned connection fails: a restarted node has a new key) or whose `GET /v1/node` names another key than
the one verified is down until it verifies again, which the next poll tries.

This is the router's only state, and all of it is a cache of what the nodes say (plus the latency this router
measured, the requests it has in flight and the verifications it made), so routers can run side by side and be
restarted at will.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp

from cache.summary import SummaryError
from client.verify import NodeRefused, VerifiedNode, verify_node
from router.errors import ModelNotFound, NoProviderAvailable
from router.node_info import NodeInfo, NodeInfoError, parse_node_info
from router.providers import ProviderSpec, RouterSettings, RouterTrust
from router.selection import Candidate
from router.summaries import VerifiedSummary, WarmView, verify_summary

log = logging.getLogger(__name__)

LATENCY_WEIGHT = 0.3
"""The weight of the newest measurement in the latency EWMA: about the last few requests count."""
SUMMARY_REFRESH_S = 1.0
"""The most an answer's end waits for the serving node's new summary."""
HEALTH_COUNTS = ("waiting", "running")
"""The requests a node's `/health` says it holds, for a router key: queued, and in its running batch. A node that
leaves one out holds none of that kind as far as the router can tell."""
POLL_FAILURES = (aiohttp.ClientError, TimeoutError, OSError, ValueError)
"""What a poll request can fail with: the network, a status or body that is not the node's (ValueError covers
JSON that does not parse and documents that do not validate)."""


class PollFailed(ValueError):
    """A provider answered a poll with something other than 200 and JSON."""


@dataclass(slots=True)
class ProviderState:
    spec: ProviderSpec
    node: NodeInfo | None = None
    up: bool = False
    problem: str | None = "not polled yet"
    """Why the provider is down; None while it is up."""
    others: int = 0
    """Requests the node held at the last poll, waiting or running, that were not this router's then in flight:
    other routers' and direct callers' load, as of that poll."""
    in_flight: int = 0
    """This router's requests there now, from forwarding to the end of the answer."""
    last_sent: int = 0
    """The number of the request this router last sent there (requests counted from 1 as sent); 0 for none."""
    latency_s: float | None = None
    summaries: dict[str, VerifiedSummary] = field(default_factory=dict)
    verified: VerifiedNode | None = None
    """Under a trust policy: the provider as last verified, whose certificate every connection is pinned to."""


class Registry:
    def __init__(self, providers: Sequence[ProviderSpec], session: aiohttp.ClientSession,
                 settings: RouterSettings, trust: RouterTrust | None = None) -> None:
        self._states = {provider.name: ProviderState(provider) for provider in providers}
        self._index = {provider.name: index for index, provider in enumerate(providers)}
        """Each provider's place in the file: a number, which a log line keeps when the node's privacy filter
        withholds the name."""
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=settings.connect_timeout_s)
        self._interval_s = settings.poll_interval_s
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._sent = itertools.count(1)
        self._trust = trust

    def pin(self, name: str) -> aiohttp.Fingerprint | bool:
        """aiohttp's `ssl=` for a connection to `name`: pinned to its verified certificate under a trust policy
        (a provider not verified yet gets a pin no certificate matches: nothing is sent to it), else the default."""
        if self._trust is None:
            return True
        verified = self._states[name].verified
        return verified.channel.pin() if verified is not None else aiohttp.Fingerprint(bytes(32))

    def state(self, name: str) -> ProviderState:
        return self._states[name]

    def models(self) -> list[str]:
        return sorted({model for state in self._states.values() for model in state.spec.models})

    async def _get_json(self, spec: ProviderSpec, path: str, keyed: bool) -> Any:
        headers = {"Authorization": f"Bearer {spec.api_key}"} if keyed else {}
        async with self._session.get(spec.url + path, headers=headers, timeout=self._timeout,
                                     ssl=self.pin(spec.name)) as response:
            if response.status != 200:
                raise PollFailed(f"{path.partition('?')[0]} answered {response.status}")
            return await response.json(content_type=None)

    async def _summary(self, spec: ProviderSpec, node: NodeInfo, model: str) -> VerifiedSummary | None:
        try:
            doc = await self._get_json(spec, f"/v1/cache/summary?model={quote(model, safe='')}", keyed=True)
            return verify_summary(doc, node, model)
        except (*POLL_FAILURES, SummaryError) as exc:
            log.debug("no summary from provider %s (providers[%d]): %s", spec.name, self._index[spec.name],
                      type(exc).__name__)
            return None

    async def poll_provider(self, state: ProviderState) -> None:
        """Ask one provider how it is (verifying it first under a trust policy); mark it up with what it said, or
        down with why not."""
        spec = state.spec
        if self._trust is not None and state.verified is None and not await self._verify(state):
            return
        try:
            health = await self._get_json(spec, "/health", keyed=True)
            ours = state.in_flight  # as the node counted them: read before anything else is awaited
            node = parse_node_info(await self._get_json(spec, "/v1/node", keyed=False), spec.declared)
            if state.verified is not None and node.public_key.hex() != state.verified.result.public_key_hex:
                state.verified = None
                raise PollFailed("its node key is not the one verified: verifying it again")
            if not isinstance(health, dict) or health.get("status") != "ok":
                raise PollFailed("/health does not say ok")
            held = [health.get(name, 0) for name in HEALTH_COUNTS]
            if any(type(count) is not int or count < 0 for count in held):
                raise PollFailed(f"/health's {' and '.join(map(repr, HEALTH_COUNTS))} are not counts")
        except (PollFailed, NodeInfoError) as exc:
            self.mark_down(spec.name, str(exc))
            return
        except POLL_FAILURES as exc:
            if isinstance(exc, aiohttp.ServerFingerprintMismatch | aiohttp.ClientConnectorError):
                state.verified = None  # another certificate, or nobody there: verify whoever answers next
            self.mark_down(spec.name, f"poll failed: {type(exc).__name__}")
            return
        found = await asyncio.gather(*(self._summary(spec, node, model) for model in spec.models))
        if not state.up:
            log.info("provider %s (providers[%d]) is up", spec.name, self._index[spec.name])
        state.node, state.up, state.problem = node, True, None
        # A request of ours the node has not received yet, or has answered while the router still relays the
        # end, is subtracted without having been counted: the floor keeps that an undercount of others' load,
        # never a negative one. Counting ours twice is what the subtraction is for.
        state.others = max(0, sum(held) - ours)
        state.summaries = {model: summary for model, summary in zip(spec.models, found, strict=True)
                           if summary is not None}

    async def _verify(self, state: ProviderState) -> bool:
        """Verify the provider under the router's trust policy; mark it down with the policy's reason if it fails."""
        assert self._trust is not None
        try:
            state.verified = await verify_node(state.spec.url, self._trust.policy, self._trust.allow_none,
                                               self._session)
        except NodeRefused as exc:
            reasons = [line.strip() for line in exc.lines[1:2]]
            self.mark_down(state.spec.name, "not verified: " + ("; ".join(reasons) or "refused"))
            return False
        log.info("provider %s (providers[%d]) verified: key %s", state.spec.name, self._index[state.spec.name],
                 state.verified.result.public_key_hex)
        return True

    async def poll(self) -> None:
        await asyncio.gather(*(self.poll_provider(state) for state in self._states.values()))

    async def run(self) -> None:
        """Poll every provider every `poll_interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.poll()

    def refresh(self, name: str) -> None:
        """Poll one provider now, in the background (once at a time): what it said last is out of date."""
        if name in self._refreshing:
            return
        task = asyncio.create_task(self.poll_provider(self._states[name]))
        self._refreshing[name] = task
        task.add_done_callback(lambda _: self._refreshing.pop(name, None))

    async def refresh_summary(self, name: str, model: str) -> None:
        """Fetch one provider's summary of `model` now and wait for it, at most `SUMMARY_REFRESH_S`: it has just
        stored a caller's state. A summary that does not come keeps the last one."""
        state = self._states[name]
        if state.node is None:
            return
        try:
            summary = await asyncio.wait_for(self._summary(state.spec, state.node, model), SUMMARY_REFRESH_S)
        except TimeoutError:
            return
        if summary is not None:
            state.summaries[model] = summary

    async def close(self) -> None:
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def mark_down(self, name: str, problem: str) -> None:
        """Stop sending to a provider until a poll finds it answering. `problem` names a status or an exception
        type, never request content."""
        state = self._states[name]
        if state.up or state.problem != problem:
            log.warning("provider %s (providers[%d]) is down: %s", name, self._index[name], problem)
        state.up, state.problem, state.summaries = False, problem, {}

    @contextmanager
    def in_flight(self, name: str) -> Iterator[None]:
        """Count a request forwarded to `name` as its load for as long as this block runs: however it ends (an
        answer, a failure, the client going away cancels it), the count comes down exactly once."""
        state = self._states[name]
        state.in_flight += 1
        state.last_sent = next(self._sent)
        try:
            yield
        finally:
            state.in_flight -= 1

    def observe_latency(self, name: str, seconds: float) -> None:
        state = self._states[name]
        state.latency_s = seconds if state.latency_s is None else (
            LATENCY_WEIGHT * seconds + (1 - LATENCY_WEIGHT) * state.latency_s)

    def candidates(self, model: str, caller: str) -> list[Candidate]:
        """The providers of `model` that are up, as selection sees them for `caller`; raises ModelNotFound when
        none serves the model and NoProviderAvailable when all that do are down."""
        serving = [state for state in self._states.values() if model in state.spec.models]
        if not serving:
            raise ModelNotFound(f"no provider serves the model {model!r}; GET /v1/models lists the models",
                                param="model")
        up = [(state, state.node) for state in serving if state.up and state.node is not None]
        if not up:
            raise NoProviderAvailable(f"every provider of the model {model!r} is down; retry in a few seconds")
        return [Candidate(state.spec.name, node.offer, node.trust_tier, state.others + state.in_flight,
                          state.latency_s, WarmView(state.summaries[model], state.spec.api_key, caller)
                          if model in state.summaries else None, state.last_sent)
                for state, node in up]
