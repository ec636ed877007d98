"""The interface every lower tier implements: a key -> record-bytes store with counters."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvb_cache.hashing import ChunkHash


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """A snapshot of one tier's counters (JSON-safe via :meth:`as_dict`).

    Attributes:
        name: ``"ram"``, ``"disk"`` or ``"redis"``.
        entries: records held (None when the tier cannot count cheaply, e.g. a shared Redis).
        bytes: bytes held (None when unknown).
        hits / misses: lookups that found a record / found none. A record found and then refused by
            validation counts in ``hits`` and in ``corrupt``, so :attr:`hit_rate` takes it out.
        errors: failed operations (I/O errors, Redis connection errors and timeouts), each a miss or a
            skipped store, never a failed request.
        corrupt: records that failed validation (dropped and recomputed).
        stores / dropped: records written, and writes dropped (the write-behind queue was full, or the tier
            was paused: disk full, Redis down since an error).
        evictions: records removed to stay within the byte budget.
    """

    name: str
    entries: int | None = 0
    bytes: int | None = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    corrupt: int = 0
    stores: int = 0
    dropped: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of lookups served a valid record: ``(hits - corrupt) / (hits + misses)``."""
        lookups = self.hits + self.misses
        # A corrupt record was a lookup that found bytes (a hit to the tier) but served nothing. A shared
        # Redis tier's hits are every process's and its corrupt count this process's, hence the floor.
        return max(self.hits - self.corrupt, 0) / lookups if lookups else 0.0

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {f: getattr(self, f) for f in self.__slots__} | {"hit_rate": round(self.hit_rate, 4)}


class Counters:
    """Thread-safe counters for a tier (``hits`` are corrected down when a fetched record goes unread,
    :func:`~kvb_cache.tiers.tiered.drop_unread`)."""

    FIELDS = ("hits", "misses", "errors", "corrupt", "stores", "dropped", "evictions")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, field: str, n: int = 1) -> None:
        with self._lock:
            self._values[field] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class RecordTier(ABC):
    """A lower cache tier: record bytes by chunk key. No children index (the radix match is RAM-only).

    Implementations never raise on I/O trouble from :meth:`get`, :meth:`get_many` or :meth:`put`: they log,
    count an error and behave as a miss / a skipped store.

    :attr:`counters` is created on first use when a subclass does not set its own, so a tier implementing
    only the abstract methods can be counted against (a corrupt record, a dropped write-behind) by the store.
    """

    name: str

    @property
    def counters(self) -> Counters:
        """This tier's :class:`Counters` (a subclass may assign its own)."""
        # NOTE: not made in an __init__: subclasses (users' too) set their attributes without calling super().
        counters = self.__dict__.get("_counters")
        if counters is None:
            counters = self.__dict__["_counters"] = Counters()
        return counters

    @counters.setter
    def counters(self, value: Counters) -> None:
        self.__dict__["_counters"] = value

    @abstractmethod
    def get(self, key: ChunkHash) -> bytes | None:
        """The record stored under ``key``, or None."""

    def get_many(self, keys: Sequence[ChunkHash]) -> list[bytes | None]:
        """Records for ``keys`` in order. The default loops; remote tiers override it with one round trip."""
        return [self.get(key) for key in keys]

    @abstractmethod
    def put(self, key: ChunkHash, record: bytes) -> bool:
        """Store ``record`` under ``key``; returns whether it is stored."""

    @abstractmethod
    def contains(self, key: ChunkHash) -> bool: ...

    @abstractmethod
    def delete(self, key: ChunkHash) -> None:
        """Drop ``key`` (a record that failed validation)."""

    @abstractmethod
    def clear(self) -> int:
        """Drop every record of this tier's namespace; returns how many were dropped."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    def count(self, field: str, n: int = 1) -> None:
        """Add ``n`` to counter ``field`` (a tier whose counters are shared with other processes also
        sends it there)."""
        self.counters.add(field, n)

    def touch(self, keys: Sequence[ChunkHash]) -> None:  # noqa: B027 - optional hook
        """Mark ``keys``' records as just used (their blocks were hit in RAM, which never reads this tier),
        the last one most recently; records this tier does not hold are skipped. Never raises."""

    def paused(self) -> bool:
        """Whether stores are being skipped for now (a full disk, an unreachable Redis): the engine then
        neither encodes records for this tier nor queues blocks it missed for writing again."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release connections or persist counters."""
