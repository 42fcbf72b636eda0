"""A caller verifies a real `--tls` node before sending a prompt (issue 35): `tenzro client verify` and `pin` against
its code and model digests, a TLS-terminating man in the middle refused before any prompt, and the official openai
client through `tenzro proxy`, which verifies a restarted node again and fails closed on an unaccepted one.

None of these machines has a TEE: the nodes present `none` evidence, accepted only with `--allow-none` and a policy
that says so too.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from client.verify import NodeRefused, verify
from tests.client.tls_server import self_signed
from tests.node.conftest import (
    TENZRO,
    Node,
    NodeFactory,
    free_port,
    launch_node,
    node_view,
    stop_node,
    unverified_context,
)

PROMPT = "the verified channel carries this"


def development_policy(path: Path, code: str | list[str] = "any", models: Any = "any") -> Path:
    path.write_text(yaml.safe_dump({
        "tee_types": ["none"], "allow_none": True, "roots": None, "measurements": "any", "rtmrs": "any",
        "min_tcb": "any", "code_digests": code if code == "any" else [code] if isinstance(code, str) else code,
        "model_digests": models, "gpu": "optional"}))
    return path


def tenzro(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TENZRO, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tls_node(node_factory: NodeFactory, small_model_dir: Path) -> Node:
    return node_factory(small_model_dir, "--tls")


def test_client_verify_accepts_the_node_its_policy_names_and_refuses_another_code_or_model(
        tls_node: Node, small_model_dir: Path, tmp_path: Path) -> None:
    view = node_view(tls_node)
    code, model = view["code"]["digest"], view["models"][0]
    assert model["model"] == small_model_dir.name
    pinned = development_policy(tmp_path / "pinned.yaml", code, {model["model"]: [model["digest"]]})
    verified = tenzro("client", "verify", tls_node.url, "--trust-policy", str(pinned), "--allow-none")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lines = verified.stdout.splitlines()
    assert lines[0] == "OK, UNTRUSTED (none evidence, accepted by allow_none)"
    assert f"  tls spki sha256 {view['tls']['spki_sha256']} (bound by the evidence)" in lines
    assert lines[1:4] == [f"  code_digests: {code} (pinned)", f"  model_digests: {model['model']} {model['digest']} "
                          "(pinned)", "  measurements: any (not pinned)"]

    other_model = development_policy(tmp_path / "model.yaml", code, {model["model"]: ["d1" * 32]})
    refused = tenzro("client", "verify", tls_node.url, "--trust-policy", str(other_model), "--allow-none")
    assert refused.returncode == 1
    assert refused.stdout.splitlines()[:2] == [
        "REFUSED", f"  model-not-accepted: the node serves {model['model']} with weights {model['digest']}, which "
                   "model_digests does not accept"]
    other_code = development_policy(tmp_path / "code.yaml", "c1" * 32, {model["model"]: [model["digest"]]})
    refused = tenzro("client", "verify", tls_node.url, "--trust-policy", str(other_code), "--allow-none")
    assert refused.returncode == 1
    assert refused.stdout.splitlines()[:2] == [
        "REFUSED", f"  code-not-accepted: the node runs code {code}, which code_digests does not accept"]
    # Without --allow-none, none evidence is refused whatever the policy says.
    strict = tenzro("client", "verify", tls_node.url, "--trust-policy", str(pinned))
    assert strict.returncode == 1 and "none-evidence" in strict.stdout

    # Pin refuses none evidence without --allow-none (it would pin hardware evidence under the roots given).
    roots = tmp_path / "roots"
    roots.mkdir()
    unpinned = tenzro("client", "pin", tls_node.url, "--roots", str(roots))
    assert unpinned.returncode == 1 and "none-evidence" in unpinned.stderr and unpinned.stdout == ""
    # Pin writes exactly what was verified; it verifies again as it is.
    pin = tenzro("client", "pin", tls_node.url, "--allow-none")
    assert pin.returncode == 0, pin.stderr
    written = yaml.safe_load(pin.stdout)
    assert written["code_digests"] == [code] and written["model_digests"] == {model["model"]: [model["digest"]]}
    (tmp_path / "pin.yaml").write_text(pin.stdout)
    again = tenzro("client", "verify", tls_node.url, "--trust-policy", str(tmp_path / "pin.yaml"), "--allow-none")
    assert again.returncode == 0, again.stdout

    # In-process: the Python API, then the official openai client over the verified channel only.
    node = verify(tls_node.url, tmp_path / "pin.yaml", allow_none=True)
    caller = openai.OpenAI(base_url=node.channel.url + "/v1", api_key=tls_node.add_key("alice"), max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=node.channel.ssl_context()))
    reply = caller.chat.completions.create(model=model["model"], messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=2, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    with pytest.raises(NodeRefused) as refusal:
        verify(tls_node.url, other_code, allow_none=True)
    assert refusal.value.lines[1] == (
        f"  code-not-accepted: the node runs code {code}, which code_digests does not accept")


class Relay:
    """A man in the middle: terminates TLS with a key of its own and relays the bytes to the genuine node over a
    TLS connection of its own, recording everything the client sent it."""

    def __init__(self, upstream_port: int, context: ssl.SSLContext) -> None:
        self.upstream_port, self.context = upstream_port, context
        self.received = bytearray()
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Relay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, ssl=self.context)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port,
                                                                         ssl=unverified_context())

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, record: bool) -> None:
            try:
                while data := await source.read(65536):
                    if record:
                        self.received.extend(data)
                    sink.write(data)
                    await sink.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer, True), pipe(upstream_reader, writer, False))


def test_a_tls_terminating_man_in_the_middle_is_refused_before_any_prompt(tls_node: Node, tmp_path: Path) -> None:
    policy = development_policy(tmp_path / "policy.yaml")
    port = int(tls_node.url.rsplit(":", 1)[1])
    with Relay(port, self_signed(tmp_path, "mitm")[0]) as relay:
        url = f"https://127.0.0.1:{relay.port}"
        refused = tenzro("client", "verify", url, "--trust-policy", str(policy), "--allow-none")
        assert refused.returncode == 1
        assert refused.stdout.splitlines()[1].startswith("  channel-not-attested: the TLS key presented (")
        assert b"/v1/attestation" in relay.received  # it relayed the evidence request faithfully
        proxy_port = free_port()
        with proxy(url, policy, proxy_port):
            caller = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="tz-unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as refusal:
                caller.chat.completions.create(model="small", messages=[{"role": "user", "content": PROMPT}])
            assert refusal.value.status_code == 503 and "node_not_verified" in str(refusal.value.body)
        assert PROMPT.encode() not in relay.received and b"chat/completions" not in relay.received


class proxy:  # noqa: N801 - used as a context manager, like open()
    """`tenzro proxy` as a subprocess, ready once its health route answers (verified or not)."""

    def __init__(self, node_url: str, policy: Path, port: int, *extra: str, allow_none: bool = True) -> None:
        self.process = subprocess.Popen([*TENZRO, "proxy", "--node", node_url, "--trust-policy", str(policy),
                                         "--port", str(port), *(["--allow-none"] if allow_none else []), *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, self.process.stdout
                time.sleep(0.1)

    def __enter__(self) -> subprocess.Popen[str]:
        return self.process

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.wait(10)


def test_the_openai_client_streams_through_the_proxy_which_verifies_a_restarted_node_and_fails_closed(
        node_factory: NodeFactory, small_model_dir: Path, tmp_path: Path) -> None:
    first = node_factory(small_model_dir, "--tls")
    key = first.add_key("alice")
    model = small_model_dir.name
    view = node_view(first)
    policy = development_policy(tmp_path / "policy.yaml", view["code"]["digest"],
                                {model: [view["models"][0]["digest"]]})
    port = free_port()
    with proxy(first.url, policy, port):
        caller = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        stream = caller.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=4, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

        # The node restarts on the same port with a new TLS key (and a new config: a new key for alice).
        port_of_node = int(first.url.rsplit(":", 1)[1])
        stop_node(first)
        second = restart_on(port_of_node, first, small_model_dir, tmp_path / "second")
        try:
            key = second.add_key("alice")
            caller = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
            reply = caller.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=2, temperature=0)
            assert reply.usage is not None and reply.usage.completion_tokens == 2
            assert node_view(second)["tls"]["spki_sha256"] != view["tls"]["spki_sha256"]
        finally:
            stop_node(second)

    # A policy naming another model digest: the application gets a clear error, never a completion.
    other = node_factory(small_model_dir, "--tls")
    refusing = development_policy(tmp_path / "other.yaml", view["code"]["digest"], {model: ["d1" * 32]})
    port = free_port()
    with proxy(other.url, refusing, port):
        caller = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=other.add_key("alice"), max_retries=0)
        with pytest.raises(openai.APIStatusError) as refusal:
            caller.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
        assert refusal.value.status_code == 503
        assert "model-not-accepted: the node serves" in str(refusal.value.body)
    # Without --allow-none the proxy refuses none evidence, whatever the policy accepts.
    port = free_port()
    with proxy(other.url, development_policy(tmp_path / "any.yaml"), port, allow_none=False):
        caller = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tz-unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refusal:
            caller.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
        assert refusal.value.status_code == 503 and "none-evidence" in str(refusal.value.body)


def restart_on(port: int, before: Node, model: Path, tmp: Path) -> Node:
    """A new node start on `port` (the same address the proxy was given)."""
    deadline = time.monotonic() + 30
    while True:  # the old process's socket may linger a moment
        try:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node's server binds
                probe.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    node = launch_node(tmp, model, "--tls", port=port)
    from tests.node.conftest import wait_healthy

    return wait_healthy(node)


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield
