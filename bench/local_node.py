"""A node the benchmark runs itself, through the command line a user types: `tenzro node serve` in a
subprocess on a free loopback port, keys from `tenzro keys add`, models from `tenzro models init`."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import aiohttp

from bench.client import BenchError, Client

TENZRO = (sys.executable, "-m", "node")
"""The `tenzro` command of this interpreter's installation."""
STARTUP_TIMEOUT_S = 600.0
"""The first start of `--model default` builds the model."""
SERVING = b"tenzro node: serving model"
"""What `tenzro node serve` prints once it listens on its port."""


def tenzro(*args: str) -> str:
    """Run a `tenzro` command to its end; its standard output."""
    done = subprocess.run([*TENZRO, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"'tenzro {' '.join(args)}' failed: {done.stderr.strip()}")
    return done.stdout


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_dir(spec: str, workdir: Path) -> Path:
    """The directory of `--model`: an existing directory, else the `tenzro models init` architecture `spec`
    (`default`: the model `models init` builds without `--arch`) built into `workdir` at default size.

    The bench reads the model's tokenizer here, and its nodes serve this same directory."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    built = workdir / spec
    try:
        tenzro("models", "init", *(() if spec == "default" else ("--arch", spec)), str(built))
    except BenchError as exc:
        raise BenchError(f"--model {spec!r} is neither a model directory nor an architecture name: {exc}") from exc
    return built


class LocalNode:
    """`tenzro node serve` on a free loopback port, with its own config, key, ledger and prices in `workdir`;
    TENZRO_HOME is left alone so the generated model cache is shared with the user's.

    As a context manager it runs from `start` to `stop`, and a BenchError raised inside carries its log."""

    def __init__(self, workdir: Path, model: str, threads: int, device: str | None,
                 extra: tuple[str, ...] = (), tls: bool = False) -> None:
        self.extra = extra
        """More `tenzro node serve` flags."""
        self.tls = tls
        """Serve HTTPS (`--tls`); its clients pin the certificate the node presents once it is healthy."""
        self.pin: aiohttp.Fingerprint | None = None
        self.model, self.threads, self.device = model, threads, device
        self.workdir = workdir
        self.config = workdir / "node.yaml"
        self.log = workdir / "node.log"
        self.port = free_port()
        self.root = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.api_key = ""
        self.process: subprocess.Popen[bytes] | None = None

    def add_key(self, name: str, role: str = "caller") -> str:
        """A new key of `role` in this node's config (also while it runs); returns the key."""
        return tenzro("keys", "add", name, "--role", role, "--config", str(self.config)).strip().splitlines()[-1]

    def start(self) -> None:
        self.api_key = self.add_key("bench")
        # Its own ledger and prices: a benchmark's usage records are not the user's.
        command = [*TENZRO, "node", "serve", "--config", str(self.config), "--model", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--threads", str(self.threads),
                   "--ledger", str(self.workdir / "ledger"), "--pricing", str(self.workdir / "pricing.yaml")]
        if self.device:
            command += ["--device", self.device]
        command += [*self.extra, *(("--tls",) if self.tls else ())]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def wait_healthy(self, session: aiohttp.ClientSession) -> None:
        assert self.process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the local node exited ({self.process.returncode})")
            try:
                # Not verified yet: the node's certificate is pinned once it is ours.
                async with session.get(self.root + "/health", ssl=not self.tls) as response:
                    # Ours only once it says it serves: until then the port may answer for another process that
                    # took it between `free_port` and our bind (tests run nodes side by side).
                    if response.status == 200 and SERVING in self.log.read_bytes():
                        if self.tls:
                            self.pin = await self._presented_certificate()
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise BenchError(f"the local node was not healthy in {STARTUP_TIMEOUT_S:.0f} s")

    async def _presented_certificate(self) -> aiohttp.Fingerprint:
        """The certificate the node's handshake presents (made at its start), pinned: every later request must meet
        the very same one, as a client pinning it after verifying the node's evidence would."""
        pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", self.port))
        return aiohttp.Fingerprint(hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).digest())

    async def client(self, session: aiohttp.ClientSession, api_key: str | None = None,
                     model: str | None = None) -> Client:
        """A client of this node for `api_key` (default: the key `start` made), of `model` or the first listed."""
        return await Client.connect(session, self.root, api_key or self.api_key, model, pin=self.pin)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalNode:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
        if isinstance(error, BenchError):
            raise BenchError(f"{error}\nnode log ({self.log}):\n{self.log_tail()}") from error
