"""Per-token (and per-image) prices in integer wei, read from a YAML file that the operator may change while serving.

Every usage record copies the prices it was charged at, so a change applies from the next completion
on and never rewrites history. A missing or malformed price file is an error, never a silent zero
schedule: a node must not serve for free because a path was wrong.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from metering.durable import atomic_write_text


class PricingError(ValueError):
    """A price schedule or price file is invalid; the message names the file or field to fix."""


@dataclass(frozen=True, slots=True)
class PriceSchedule:
    """Prices per token, in wei. Cached reads and writes replace the plain input price for their tokens.

    Writes held longer than the default (`cache/ttl.py`'s `1h` and `24h` classes) may be priced apart: they take
    memory for longer. None: at the plain write price (a price file written before the classes existed).

    `image_price_wei` is charged per image an image node renders, on top of its prompt's tokens: the denoising steps
    are the work, and no token counts them. 0 (a price file without it): images cost their prompt's tokens only.
    """

    input_price_wei: int
    output_price_wei: int
    cached_read_price_wei: int
    cached_write_price_wei: int
    cached_write_1h_price_wei: int | None = None
    cached_write_24h_price_wei: int | None = None
    image_price_wei: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in CLASS_PRICE_FIELDS and value is None:
                continue
            if type(value) is not int or value < 0:
                raise PricingError(f"{field.name} must be a non-negative integer (wei), got {value!r}")

    @property
    def write_1h_price_wei(self) -> int:
        """The price of a `1h` write in force."""
        return self.cached_write_price_wei if self.cached_write_1h_price_wei is None else self.cached_write_1h_price_wei

    @property
    def write_24h_price_wei(self) -> int:
        """The price of a `24h` write in force."""
        return (self.cached_write_price_wei if self.cached_write_24h_price_wei is None
                else self.cached_write_24h_price_wei)

    def to_mapping(self) -> dict[str, int]:
        """The prices set (a class price left to the plain write price is left out)."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return {name: value for name, value in values.items() if value is not None}


CLASS_PRICE_FIELDS = ("cached_write_1h_price_wei", "cached_write_24h_price_wei")
"""Optional in a price file: each defaults to the plain write price."""
OPTIONAL_PRICE_FIELDS = (*CLASS_PRICE_FIELDS, "image_price_wei")
"""Optional in a price file: the class write prices, and the image price (default 0)."""
PRICE_FIELDS: tuple[str, ...] = tuple(field.name for field in fields(PriceSchedule))

DEFAULT_PRICING = PriceSchedule(
    input_price_wei=1_000_000_000,
    output_price_wei=4_000_000_000,
    cached_read_price_wei=100_000_000,
    cached_write_price_wei=1_250_000_000,
)
"""Starting point for `provider pricing set` when no price file exists yet (1 gwei per input token;
cached reads at a tenth, cached writes at 1.25x, output at 4x). Never used implicitly by the node."""


def parse_pricing(data: object, source: str) -> PriceSchedule:
    """Build a schedule from parsed YAML: a mapping with the four plain price fields, and optionally the class
    write prices and the image price (OPTIONAL_PRICE_FIELDS)."""
    if not isinstance(data, dict):
        raise PricingError(f"{source}: expected a mapping of the fields {', '.join(PRICE_FIELDS)}")
    unknown = sorted(str(key) for key in data if key not in PRICE_FIELDS)
    if unknown:
        raise PricingError(
            f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(PRICE_FIELDS)}"
        )
    missing = [name for name in PRICE_FIELDS if name not in data and name not in OPTIONAL_PRICE_FIELDS]
    if missing:
        raise PricingError(f"{source}: missing field(s) {', '.join(missing)}")
    try:
        return PriceSchedule(**{name: data[name] for name in PRICE_FIELDS if name in data})
    except PricingError as exc:
        raise PricingError(f"{source}: {exc}") from exc


def load_pricing(path: str | os.PathLike[str]) -> PriceSchedule:
    """Read a price file; raise `PricingError` if it is missing, unreadable or invalid."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise PricingError(
            f"price file {path} does not exist; create it with `tenzro provider pricing set`"
        ) from exc
    except OSError as exc:
        raise PricingError(f"price file {path} cannot be read: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PricingError(f"price file {path} is not valid YAML: {exc}") from exc
    return parse_pricing(data, str(path))


def save_pricing(path: str | os.PathLike[str], schedule: PriceSchedule) -> None:
    """Write a price file atomically, so a running node never loads a half-written one."""
    text = ("# Prices in integer wei: per token, and per image (image_price_wei).\n"
            + yaml.safe_dump(schedule.to_mapping(), sort_keys=False))
    atomic_write_text(Path(path), text)


_FileStamp = tuple[int, int, int]
"""(inode, mtime_ns, size): changes whenever `save_pricing` replaces the file or an editor rewrites it."""


class PricingSource:
    """The current schedule of a price file, reloaded when the file changes (one `stat` per call).

    The file must be valid when the source is created, so a node with bad prices fails at start.
    A later bad edit keeps the last good schedule and is reported in `reload_error` (the node
    exposes it), because refusing to meter completions that already ran would lose records.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        # Stat before reading: a change between the two is then seen, and loaded, by the next call.
        self._stamp: _FileStamp | None
        try:
            self._stamp = self._stat()
        except OSError:
            self._stamp = None
        self._schedule = load_pricing(self.path)
        self.reload_error: str | None = None

    def current(self) -> PriceSchedule:
        """The schedule in force now."""
        with self._lock:
            try:
                stamp = self._stat()
            except OSError as exc:
                self.reload_error = f"price file {self.path} cannot be read: {exc}"
                return self._schedule
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._schedule = load_pricing(self.path)
                    self.reload_error = None
                except PricingError as exc:
                    self.reload_error = str(exc)
            return self._schedule

    def _stat(self) -> _FileStamp:
        result = os.stat(self.path)
        return (result.st_ino, result.st_mtime_ns, result.st_size)
