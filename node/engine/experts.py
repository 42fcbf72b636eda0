"""Expert parallelism over torch.distributed: rank 0 keeps the shared layers, holders compute the routed experts.

Every MoE family the node serves (mixtral, olmoe, qwen2-moe, granite-moe-hybrid, qwen3-next, jamba) calls its
routed experts in transformers 5 as one module holding 3D weights (`gate_up_proj [experts, 2 * inter, hidden]`,
`down_proj [experts, hidden, inter]`) with `(hidden [tokens, hidden], top_k_index [tokens, k], top_k_weights
[tokens, k])`. `ExpertSplit` replaces that module's forward on rank 0: each (token, expert) pair routed to a
holder's experts travels to that holder (point-to-point sends of a gloo group), the holder runs the library's own
experts forward on its slice of the weights, and rank 0 sums the weighted outputs back in expert order, the order
the library sums them in. The router, the shared experts and every other layer stay on rank 0, so the engine's
forward, reuse, sealing, batching and metering never learn about ranks: a restored prefix never runs a layer, so
it never reaches a holder.

transformers' own expert parallelism (`DistributedConfig(enable_expert_parallel=...)`, the configs'
`base_model_ep_plan`) shards the experts over a device mesh in which every rank runs the whole model on its own
batch and exchanges tokens by all-to-all collectives of the default group: every holder would also run the
attention and recurrent layers, hold the state, and a lost rank would end the group for good. It is not used; its
calling convention (the experts module called on local expert ids) is what the holders rely on.

Faults: a gloo group cannot re-admit a rank, so the group is formed per epoch over a `TCPStore` that rank 0
hosts at `--experts-master`. A holder that dies (connection closed) or stops answering (`answer_timeout_s`) fails
the forward in flight with `ExpertsUnavailable` (503; the engine stores nothing of a failed request), rank 0 drops
the group, which releases the surviving holders, and forms the next epoch as soon as every holder says it is ready
in the store. Until then requests are refused at once and `/health` names the missing holders.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from node.errors import Unavailable

log = logging.getLogger(__name__)

COMPUTE, CLOSE = 1, 2
"""Header ops rank 0 sends a holder."""
HEADER_FIELDS = 5
"""Header `[op, layer, pairs, hidden dtype, weight dtype]`, int64."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Wire codes of the dtypes: the index in this tuple."""
STORE_TIMEOUT = datetime.timedelta(seconds=30)
HOLDER_IDLE = datetime.timedelta(days=7)
"""A holder's group timeout: it waits for rank 0's next layer for as long as the node is idle."""


class ExpertsError(Exception):
    """The split cannot start (the model has no routed experts, the world is wrong, holders did not come)."""


class ExpertsUnavailable(Unavailable):
    """An expert holder is missing: the request is refused whole rather than answered from part of the experts."""

    default_code = "experts_unavailable"


@dataclass(frozen=True, slots=True)
class ExpertsTopology:
    """`--experts-world` and `--experts-master` of `tenzro node serve`."""

    world: int
    """Rank 0 and `world - 1` expert holders."""
    host: str
    port: int
    answer_timeout_s: float = 30.0
    """How long rank 0 waits for a holder's send or answer before it counts the holder as lost."""
    join_timeout_s: float = 300.0
    """How long the node's start waits for every holder; it refuses to start without them."""

    @classmethod
    def parse(cls, world: int, master: str, **timeouts: float) -> ExpertsTopology:
        host, sep, port = master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ExpertsError(f"--experts-master {master!r} is not ADDR:PORT")
        if world < 2:
            raise ExpertsError(f"--experts-world {world} leaves no expert holder; pass 2 or more")
        return cls(world, host, int(port), **timeouts)


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which holder computes which routed experts: contiguous ranges, as even as they divide."""

    experts: int
    world: int

    def __post_init__(self) -> None:
        if not 1 <= self.world - 1 <= self.experts:
            raise ExpertsError(f"{self.world - 1} holders for {self.experts} experts: pass an --experts-world "
                               f"from 2 to {self.experts + 1}")

    def experts_of(self, rank: int) -> range:
        holders = self.world - 1
        return range((rank - 1) * self.experts // holders, rank * self.experts // holders)

    @property
    def holders(self) -> range:
        return range(1, self.world)


def find_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules of `model` in layer order: those holding 3D `gate_up_proj` and `down_proj`
    whose first dimension is `num_experts` (the calling convention above, whatever the family)."""
    found = []
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
                and down.dim() == 3 and gate_up.shape[0] == getattr(module, "num_experts", None)):
            found.append(module)
    return found


def keep_experts(module: torch.nn.Module, experts: range) -> int:
    """Cut `module` down to `experts` (renumbered from 0); returns the bytes of weights it keeps."""
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name)
        setattr(module, name, torch.nn.Parameter(weight.data[experts.start:experts.stop].clone(),
                                                 requires_grad=False))
    module.num_experts = len(experts)  # type: ignore[assignment]
    return sum(getattr(module, name).nbytes for name in ("gate_up_proj", "down_proj"))


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def new_group(store: dist.Store, epoch: int, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    """The gloo group of `epoch`; blocks until all `world` ranks construct it (or `timeout`)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"group/{epoch}/", store), rank, world, timeout)


@dataclass
class HolderTraffic:
    """What rank 0 sent one holder: (token, expert) pairs and bytes (headers, hidden rows, ids, weights)."""

    pairs: int = 0
    bytes: int = 0


class ExpertSplit:
    """Rank 0's side: the store, the group of the current epoch, and the experts modules' dispatching forward."""

    def __init__(self, modules: list[torch.nn.Module], topology: ExpertsTopology) -> None:
        self.topology = topology
        self.placement = ExpertPlacement(modules[0].get_parameter("down_proj").shape[0], topology.world)
        self.traffic = {rank: HolderTraffic() for rank in self.placement.holders}
        self.epoch = 0
        self._group: Any = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reforming: threading.Thread | None = None
        try:
            self.store = dist.TCPStore(topology.host, topology.port, None, True, STORE_TIMEOUT,
                                       wait_for_workers=False)
        except RuntimeError as exc:
            raise ExpertsError(f"cannot listen on --experts-master {topology.host}:{topology.port}: {exc}") from exc
        self.store.set("world", str(topology.world))

    @classmethod
    def start(cls, model: torch.nn.Module, dtype: torch.dtype, topology: ExpertsTopology) -> ExpertSplit:
        """Install the split in `model` and wait for every holder (`join_timeout_s`)."""
        modules = find_experts(model)
        if not modules:
            raise ExpertsError("--experts-world needs a mixture-of-experts model; this one has no routed experts")
        split = cls(modules, topology)
        split.store.set("dtype", str(dtype_code(dtype)))
        for layer, module in enumerate(modules):
            keep_experts(module, range(0))  # rank 0 never computes a routed expert
            module.forward = _Dispatch(split, layer)
        if not split._form(time.monotonic() + topology.join_timeout_s):
            split.close()
            raise ExpertsError(f"expert holders {split.missing()} did not join {topology.host}:{topology.port} "
                               f"within {topology.join_timeout_s:.0f} s; start them with `tenzro experts serve`")
        return split

    # -- forming the group -----------------------------------------------------------------------------------

    def missing(self) -> list[int]:
        """Holders that have not said they are ready for the current epoch."""
        return [rank for rank in self.placement.holders if not self.store.check([f"ready/{self.epoch}/{rank}"])]

    def _form(self, deadline: float) -> bool:
        """Form the current epoch's group once every holder is ready; a failed attempt moves to the next epoch.
        False at `deadline` or on close."""
        self.store.set("epoch", str(self.epoch))
        while not self._closed.is_set() and time.monotonic() < deadline:
            if self.missing():
                time.sleep(0.05)
                continue
            try:
                group = new_group(self.store, self.epoch, 0, self.topology.world,
                                  datetime.timedelta(seconds=self.topology.answer_timeout_s))
            except RuntimeError as exc:
                log.warning("experts: forming epoch %d failed (%s); trying the next", self.epoch, type(exc).__name__)
                self.epoch += 1
                self.store.set("epoch", str(self.epoch))
                continue
            with self._lock:
                self._group = group
            log.info("experts: %d holders joined (epoch %d)", self.topology.world - 1, self.epoch)
            return True
        return False

    def _lost(self, epoch: int, holder: int) -> None:
        """Drop the group of `epoch`, which closes its connections and so releases the other holders (nothing
        else may hold a reference to it: gloo's `abort` and `shutdown` leave the connections open), and form the
        next epoch in the background."""
        with self._lock:
            if self._group is None or self.epoch != epoch:
                return
            self._group = None
            self.epoch += 1
            self.store.set("epoch", str(self.epoch))
        log.warning("experts: holder %d lost; waiting for it to return (epoch %d)", holder, self.epoch)
        self._reforming = threading.Thread(target=self._form, args=(float("inf"),), name="experts-reform",
                                           daemon=True)
        self._reforming.start()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            header = torch.tensor([CLOSE, 0, 0, 0, 0], dtype=torch.int64)
            for rank in self.placement.holders:
                try:
                    group.send([header], rank, 0).wait()
                except RuntimeError:
                    pass

    # -- what the node reports -------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._group is not None

    def describe(self) -> dict[str, Any]:
        """`/health`'s `experts`: the world and each holder's state (`up`, or `down` while the group re-forms)."""
        missing = set() if self.serving else set(self.missing()) or set(self.placement.holders)
        return {"world": self.topology.world, "serving": self.serving,
                "holders": {str(rank): "down" if rank in missing else "up" for rank in self.placement.holders}}

    def collector(self) -> Collector:
        return _TrafficCollector(self.traffic)

    # -- the forward -----------------------------------------------------------------------------------------

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum `[tokens, hidden]` of `hidden [tokens, hidden]`, computed by the
        holders; raises `ExpertsUnavailable` (and nothing is returned) if any holder fails to answer."""
        with self._lock:
            group, epoch = self._group, self.epoch
            if group is None:
                raise ExpertsUnavailable(f"expert holders {self.missing() or list(self.placement.holders)} are "
                                         f"not connected; retry when /health shows them up", retry_after_s=1)
            talking = [0]
            try:
                return self._exchange(group, layer, hidden, top_k_index, top_k_weights, talking)
            except RuntimeError:
                error = ExpertsUnavailable(f"expert holder {talking[0]} stopped answering; the request was not "
                                           f"completed", retry_after_s=1)
            del group  # the split's reference must be the last, so that dropping it closes the group
        self._lost(epoch, talking[0])
        raise error

    def _exchange(self, group: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, talking: list[int]) -> torch.Tensor:
        """`talking[0]` is set to the holder being waited for. Pairs are sorted by expert, so each holder's pairs
        are one contiguous run and the outputs, concatenated in rank order, are summed per token in the library's
        order (ascending expert)."""
        device, k = hidden.device, top_k_index.shape[1]
        flat = top_k_index.reshape(-1).cpu()
        order = torch.argsort(flat, stable=True)
        experts, tokens = flat[order], order // k
        rows, weights = hidden.cpu()[tokens], top_k_weights.reshape(-1).cpu()[order]
        header_code = (dtype_code(rows.dtype), dtype_code(weights.dtype))
        sent, waits, outputs = [], [], []
        for rank in self.placement.holders:
            owned = self.placement.experts_of(rank)
            lo, hi = (int(i) for i in torch.searchsorted(experts, torch.tensor([owned.start, owned.stop])))
            if lo == hi:
                continue
            parts = [torch.tensor([COMPUTE, layer, hi - lo, *header_code], dtype=torch.int64),
                     rows[lo:hi].contiguous(), (experts[lo:hi] - owned.start).unsqueeze(1).contiguous(),
                     weights[lo:hi].unsqueeze(1).contiguous()]
            talking[0] = rank
            waits += [(rank, group.send([part], rank, 0)) for part in parts]
            sent.append((rank, parts))
            outputs.append((rank, torch.empty(hi - lo, rows.shape[1], dtype=rows.dtype)))
        for rank, work in waits:
            talking[0] = rank
            work.wait()
        for rank, output in outputs:
            talking[0] = rank
            group.recv([output], rank, 0).wait()
        for rank, parts in sent:
            traffic = self.traffic[rank]
            traffic.pairs += int(parts[1].shape[0])
            traffic.bytes += sum(part.nbytes for part in parts)
        combined = torch.zeros(hidden.shape, dtype=hidden.dtype)
        if outputs:
            combined.index_add_(0, tokens, torch.cat([out for _, out in outputs]))
        return combined.to(device)


class _Dispatch:
    """The forward installed on one experts module."""

    def __init__(self, split: ExpertSplit, layer: int) -> None:
        self.split, self.layer = split, layer

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.split.dispatch(self.layer, hidden, top_k_index, top_k_weights)


class _TrafficCollector(Collector):
    def __init__(self, traffic: dict[int, HolderTraffic]) -> None:
        self._traffic = traffic

    def collect(self) -> Iterator[Metric]:
        pairs = CounterMetricFamily("tenzro_experts_sent_tokens", "(token, expert) pairs sent to each expert "
                                    "holder: computed tokens times the router's top-k, summed over MoE layers",
                                    labels=["holder"])
        sent = CounterMetricFamily("tenzro_experts_sent_bytes", "Bytes sent to each expert holder",
                                   labels=["holder"])
        for rank, traffic in sorted(self._traffic.items()):
            pairs.add_metric([str(rank)], traffic.pairs)
            sent.add_metric([str(rank)], traffic.bytes)
        yield pairs
        yield sent
