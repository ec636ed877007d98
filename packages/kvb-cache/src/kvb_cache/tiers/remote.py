"""Redis tier: records shared by every engine process and machine that points at the same server.

Redis brings what a home-grown cache server would have to rebuild: LRU/LFU eviction under ``maxmemory``
(run it with ``maxmemory-policy allkeys-lru``), persistence, replication and clustering. Each chunk is one
key ``kvb:<fingerprint[:32]>:<prefix hash hex>`` holding a self-describing record (optionally with a TTL),
so eviction of any single key is safe: a chain whose middle link vanished is simply used up to the gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvb_cache.hashing import ChunkHash
from kvb_cache.tiers.base import Counters, RecordTier, TierStats
from kvb_cache.tiers.config import DEFAULT_REMOTE_TIMEOUT_S

logger = logging.getLogger(__name__)

#: Hash holding cumulative counters of every process sharing the namespace (for ``kvboost cache status``).
STATS_SUFFIX = "__stats__"


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://user:secret@host``, or ``?password=`` on ``unix://``) masked.

    Outage warnings and ``kvboost cache status`` print the URL: a password in it ended up in every log.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:***@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        shown = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        if not netloc and url.startswith(f"{parts.scheme}://"):  # urlunsplit drops unix:///'s empty host
            shown = f"{parts.scheme}://{shown[len(parts.scheme) + 1 :]}"
        return shown
    except ValueError:  # unparsable (a bad port): show nothing of it rather than a secret
        return "<redis url>"


def _redis_module() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImportError("the Redis tier needs redis-py: pip install 'kvb-cache[redis]'") from exc
    return redis


class RedisTier(RecordTier):
    """Chunk records in Redis, a whole chain fetched with one ``MGET``.

    Any Redis error (connection refused, timeout, OOM under ``maxmemory-policy noeviction``) is logged once
    per outage, counted, and answered as a miss or a skipped store. After a connection error the tier stays
    off for ``retry_after_s`` so requests do not each pay a connect timeout while Redis is down. A write
    Redis answers with an error (OOM when full under ``noeviction``, a read-only replica) leaves it on:
    Redis is there and its records can still be read (one such refusal turned reads off for 2 s, and a full
    Redis flapped between "failed" and "reachable again" in the log).

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` sockets).
        namespace: the model fingerprint.
        ttl_s: expire records after this many seconds (None: rely on ``maxmemory`` eviction).
        timeout_s: socket connect and read timeout.
        retry_after_s: how long to skip Redis after a connection error.

    :attr:`max_record_bytes` (None: no bound) bounds what a lookup reads of each value: set, records are
    read with ``GETRANGE`` up to one byte past it (one pipelined round trip, as ``MGET``), so a value far
    larger than any record (anything anyone wrote under a record's name) costs that much, not its whole
    size in memory, and fails validation (counted ``corrupt``, deleted) like any damaged record. The engine
    sets it from the size of one of its block records.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        ttl_s: int | None = None,
        timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S,
        retry_after_s: float = 2.0,
    ) -> None:
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"remote_ttl_s must be None or >= 1 second, got {ttl_s!r}")
        redis = _redis_module()
        self.url = url
        self._shown_url = redact_url(url)  # what logs print: never the password
        self.prefix = f"kvb:{namespace[:32]}:"
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.max_record_bytes: int | None = None
        self.counters = Counters()
        self._errors = redis.exceptions.RedisError
        self._refusals = redis.exceptions.ResponseError  # Redis answered, and said no
        self._refusal_logged = False
        #: Why the last :meth:`ping_ms` got no answer (None: it did, or none was sent).
        self.ping_error: str | None = None
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._outage_logged = False
        # Counter deltas not yet added to the shared stats hash (flushed with the next store).
        self._unsent = dict.fromkeys(("hits", "misses", "corrupt"), 0)

    # ------------------------------------------------------------------ RecordTier
    def get(self, key: ChunkHash) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ChunkHash]) -> list[bytes | None]:
        if not keys:
            return []
        if self._is_down():
            self.counters.add("misses", len(keys))
            return [None] * len(keys)
        try:
            found = self._read([self._name(k) for k in keys])
        except self._errors as exc:
            self._failed("MGET" if self.max_record_bytes is None else "GETRANGE", exc)
            self.counters.add("misses", len(keys))
            return [None] * len(keys)
        self._recovered()
        hits = sum(value is not None for value in found)
        self.counters.add("hits", hits)
        self.counters.add("misses", len(keys) - hits)
        with self._lock:
            self._unsent["hits"] += hits
            self._unsent["misses"] += len(keys) - hits
        return list(found)

    def _read(self, names: list[str]) -> list[bytes | None]:
        """The values of ``names`` (None: none, or not a string), each cut one byte past
        :attr:`max_record_bytes` when it is set."""
        cap = self.max_record_bytes
        if cap is None:
            return list(self._client.mget(names))
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, cap)  # inclusive end: at most cap + 1 bytes
        found: list[bytes | None] = []
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, self._refusals):  # WRONGTYPE: another type under the name, a miss (as MGET)
                found.append(None)
            elif isinstance(reply, Exception):
                raise reply
            else:
                found.append(reply or None)  # GETRANGE answers "" for a missing key
        return found

    def count(self, field: str, n: int = 1) -> None:
        self.counters.add(field, n)
        with self._lock:
            if field in self._unsent:  # corrupt records too: `kvboost cache status` showed 0 for Redis
                self._unsent[field] += n

    def put(self, key: ChunkHash, record: bytes) -> bool:
        if self._is_down():
            # NOTE: counted like the disk tier's stores skipped while it is full: uncounted, the records an
            # outage cost showed nowhere (one error for the whole outage, then silence).
            self.counters.add("dropped")
            return False
        with self._lock:
            deltas, self._unsent = self._unsent, dict.fromkeys(self._unsent, 0)
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._name(key), record, ex=self.ttl_s)
            for field, n in (*deltas.items(), ("stores", 1)):
                if n:
                    pipe.hincrby(self.prefix + STATS_SUFFIX, field, n)
            # NOTE: only the SET decides success. The counters hash is shared with every process (and
            # writable by anyone using the database): a non-integer field or a key of another type made
            # each HINCRBY fail, which failed every store and took the tier down as if Redis were.
            replies = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            with self._lock:  # nothing reached Redis: the counts go with the next store that does
                for field, n in deltas.items():
                    self._unsent[field] += n
            self._failed("SET", exc)
            return False
        if isinstance(replies[0], self._refusals):
            self._refused(replies[0])
            return False
        if isinstance(replies[0], Exception):
            self._failed("SET", replies[0])
            return False
        if any(isinstance(r, Exception) for r in replies[1:]):
            logger.debug("Redis counters %s not updated: %s", self.prefix + STATS_SUFFIX, replies[1:])
        self._recovered()
        self._refusal_logged = False
        self.counters.add("stores")
        return True

    def touch(self, keys: Sequence[ChunkHash]) -> None:
        """TOUCH: under an LRU ``maxmemory-policy`` the records of blocks served from RAM stay recent."""
        if not keys or self._is_down():
            return
        try:
            self._client.touch(*[self._name(k) for k in keys])
        except self._errors as exc:
            self._failed("TOUCH", exc)

    def contains(self, key: ChunkHash) -> bool:
        if self._is_down():
            return False
        try:
            # TYPE, not EXISTS: a key some other client left holding a hash or list under our name reads as
            # a miss (MGET returns nil for it), and must not count as stored, or every write would skip it
            # and the chunk would miss forever; SET then replaces it.
            kind = self._client.type(self._name(key))
            return kind in (b"string", "string")
        except self._errors as exc:
            self._failed("TYPE", exc)
            return False

    def delete(self, key: ChunkHash) -> None:
        if self._is_down():
            return
        try:
            self._client.delete(self._name(key))
        except self._errors as exc:
            self._failed("DEL", exc)

    def clear(self) -> int:
        """Drop the namespace's records (every process sharing it loses them) and its shared counters."""
        stats = (self.prefix + STATS_SUFFIX).encode()
        try:
            names = list(self._client.scan_iter(match=self.prefix + "*", count=1000))
            if names:
                self._client.delete(*names)
        except self._errors as exc:
            self._failed("SCAN/DEL", exc)
            return 0
        return sum(name != stats for name in names)

    def stats(self) -> TierStats:
        """This process's counters (``entries``/``bytes`` are None: counting a shared namespace needs a scan)."""
        return TierStats(name=self.name, entries=None, bytes=None, **self.counters.snapshot())

    def close(self) -> None:
        """Send the hit/miss counts no store has carried yet, then close the connection.

        Without this, lookups after a process's last store never reached the shared hash: a reader that
        only restores (a replica, ``kvboost cache bench``'s restore runs) showed 0 hits in ``status``.
        """
        with self._lock:
            deltas, self._unsent = self._unsent, dict.fromkeys(self._unsent, 0)
        if any(deltas.values()) and not self._is_down():
            try:
                pipe = self._client.pipeline(transaction=False)
                for field, n in deltas.items():
                    if n:
                        pipe.hincrby(self.prefix + STATS_SUFFIX, field, n)
                pipe.execute(raise_on_error=False)  # a report: a bad field must not fail close()
            except self._errors as exc:
                logger.debug("Redis counters %s not sent at close: %s", self.prefix + STATS_SUFFIX, exc)
        self._client.close()

    # ------------------------------------------------------------------ diagnostics
    def check_reachable(self) -> bool:
        """PING once, when the engine is built: a Redis that does not answer (down, a wrong password, a
        wrong port) is reported then, as an outage (one warning, skipped for ``retry_after_s``), not at the
        first request. The engine starts either way."""
        try:
            self._client.ping()
        except self._errors as exc:
            self._failed("PING", exc)
            return False
        return True

    def ping_ms(self) -> float | None:
        """Round-trip time of a PING in milliseconds, or None when Redis did not answer it (why in
        :attr:`ping_error`)."""
        t0 = time.perf_counter()
        try:
            self._client.ping()
        except self._errors as exc:
            # Kept for reports: a wrong password, a refused connection and a timeout all read "unreachable"
            # otherwise. redis-py's messages name host and port, never the password.
            self.ping_error = str(exc) or type(exc).__name__
            return None
        self.ping_error = None
        return (time.perf_counter() - t0) * 1e3

    def namespace_usage(self) -> TierStats:
        """Entries and bytes of this namespace (a SCAN plus MEMORY USAGE per key) and the shared counters."""
        entries = size = 0
        for name in self._client.scan_iter(match=self.prefix + "*", count=1000):
            if name.endswith(STATS_SUFFIX.encode()):
                continue
            entries += 1
            size += int(self._client.memory_usage(name) or 0)
        try:
            raw = self._client.hgetall(self.prefix + STATS_SUFFIX)
        except self._errors:  # the counters key holds another type (WRONGTYPE): no counters to report
            raw = {}
        shared = {}
        for k, v in raw.items():
            try:  # a field someone else wrote may not be an integer: it is skipped, not fatal
                shared[k.decode(errors="replace")] = int(v)
            except ValueError:
                continue
        counts = {k: shared.get(k, 0) for k in ("hits", "misses", "corrupt", "stores")}
        return TierStats(name=self.name, entries=entries, bytes=size, **counts)

    # ------------------------------------------------------------------ internals
    def _name(self, key: ChunkHash) -> str:
        return self.prefix + key.hex()

    def paused(self) -> bool:
        return self._is_down()

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, op: str, exc: Exception) -> None:
        self.counters.add("errors")
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s
            first = not self._outage_logged
            self._outage_logged = True
        if first:
            logger.warning(
                "Redis %s at %s failed (%s: %s); serving without the remote tier, retrying in %.0fs",
                op,
                self._shown_url,
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )

    def _refused(self, exc: Exception) -> None:
        """A write Redis refused: counted (``errors`` and ``dropped``), logged once until a write succeeds;
        the tier stays on for reads."""
        self.counters.add("errors")
        self.counters.add("dropped")
        if not self._refusal_logged:
            self._refusal_logged = True
            logger.warning(
                "Redis at %s refused a write (%s); records are not stored until it takes writes again, "
                "reads go on (a full Redis: give records a TTL, --remote-ttl, and set maxmemory-policy volatile-lru; or "
                "allkeys-lru; or a larger maxmemory)",
                self._shown_url,
                exc,
            )

    def _recovered(self) -> None:
        if self._outage_logged:
            with self._lock:
                self._outage_logged = False
            logger.warning("Redis at %s is reachable again", self._shown_url)
