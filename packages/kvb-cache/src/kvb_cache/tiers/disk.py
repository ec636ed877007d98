"""Local disk tier: one record file per chunk under ``<dir>/<namespace>/``, byte-budgeted, LRU-evicted."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvb_cache.hashing import ChunkHash
from kvb_cache.tiers.base import Counters, RecordTier, TierStats
from kvb_cache.tiers.disk_folder import SUFFIX, read_counters, record_path, scan_records, write_counters

logger = logging.getLogger(__name__)

# Counters are persisted (for ``kvboost cache status``) at most this often, from whichever thread writes.
_STATS_INTERVAL_S = 5.0
# A full, over-quota or read-only file system, or a folder this process may not write: stores are skipped
# this long before the next try (one warning each time, not one per block).
_FULL_PAUSE_S = 30.0
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
#: Errors eviction can help with (no space, quota), and how many records' worth a failed store frees first.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_ROOM_RECORDS = 2
# After storing 1/_RESCAN_SHARE of its budget, a process reads the folder again: it learns the records other
# processes wrote since, so its eviction keeps the whole folder, not only its own records, within the budget.
_RESCAN_SHARE = 8


class _NotARecord(Exception):
    """A path holding something no record write could have left (see :meth:`DiskTier._read`).

    ``remove``: whether it is removed (a file merely larger than this tier's budget may be another process's
    valid record, when this budget is below one record)."""

    def __init__(self, why: str, *, remove: bool = True) -> None:
        super().__init__(why)
        self.remove = remove


class DiskTier(RecordTier):
    """Records as files ``<directory>/<namespace>/<hh>/<key hex>.kvb``.

    Writes are atomic (a temp file in the same folder, then ``os.replace``), so a reader or a crash never
    sees half a record; torn or flipped bytes that slip through (disk faults) fail the record checksum on
    read. Recency survives restarts through file mtimes (bumped on every hit), so a new process evicts in
    the same least-recently-used order.

    Several processes may share a folder: a key this process has not indexed is still looked up on disk.
    Each process enforces the budget over the files it knows, and reads the folder again after storing an
    eighth of its budget (learning what the others wrote), so a shared folder exceeds the budget by at most
    what the processes stored since their last reads.

    A folder that cannot take records (a full or read-only file system, a quota, no write permission:
    ``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``, ``EPERM``) pauses stores for 30 s (counted as ``errors``
    once, then ``dropped``) with one warning, instead of failing and logging every write behind every
    request; reads go on (a read-only folder of records another process wrote is served), and the next
    store after the pause tries again. The folder is probed when the tier is built, so that warning comes
    at start-up, not with the first request.

    Args:
        directory: the cache root; one sub-folder per model fingerprint.
        namespace: the model fingerprint (records of other models live in other folders).
        max_bytes: byte budget of this namespace; least recently used records are deleted past it.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], *, namespace: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"disk_cache_bytes must be a positive number of bytes, got {max_bytes!r}")
        self.directory = Path(directory) / namespace[:32]
        self.max_bytes = max_bytes
        self.counters = Counters()
        self._lock = threading.RLock()
        self._index: OrderedDict[str, int] | None = None
        self._bytes = 0
        self._stored_since_scan = 0  # bytes this process stored since it last read the folder
        self._stored = False  # this process stored a record (its budget holds one)
        self._base: dict[str, int] = {}
        self._last_persist = 0.0
        self._full_until = 0.0  # monotonic time before which stores are skipped (disk full)
        self._pause_errno: int | None = None  # why stores are paused (see _undeletable)
        #: Records refused (corrupt) whose delete the folder refused too, by name, with the file's
        #: (mtime_ns, size) then: misses, unread, until the file changes (rewritten here or elsewhere).
        self._refused: dict[str, tuple[int, int]] = {}
        self._full_logged = False  # the file system filled below the budget (said once)
        self._too_big_logged = False  # a record larger than the whole budget was offered (said once)
        self._probe()

    # ------------------------------------------------------------------ RecordTier
    def get(self, key: ChunkHash) -> bytes | None:
        index = self._loaded()
        path = self._path(key)
        if self._still_refused(key.hex(), path):
            self.counters.add("misses")
            return None
        try:
            data = self._read(path)
        except _NotARecord as exc:
            # Not a file this tier wrote: refused unread, counted and removed like a corrupt record.
            if exc.remove:
                logger.warning("disk tier: %s at %s; removed, treated as a miss", exc, path)
                self.counters.add("corrupt")
                self.delete(key)
            self.counters.add("misses")
            return None
        except FileNotFoundError:
            with self._lock:
                self._forget(key.hex())
            self.counters.add("misses")
            return None
        except OSError as exc:
            logger.warning("disk tier read failed (%s); treating as a miss", exc)
            self.counters.add("errors")
            self.counters.add("misses")
            return None
        with self._lock:
            name = key.hex()
            if name in index:
                index.move_to_end(name)
            else:
                # Another process's record, new to this index (inserted last, the most recent): a process
                # that only read others' records never trimmed its index, and reported more bytes than the
                # budget (2.2x, measured).
                index[name] = len(data)
                self._bytes += len(data)
                self._evict_over_budget()
        with contextlib.suppress(OSError):  # recency is a hint; a vanished file shows up as a miss later
            os.utime(path)
        self.counters.add("hits")
        return data

    def touch(self, keys: Sequence[ChunkHash]) -> None:
        index = self._loaded()
        for key in keys:
            name = key.hex()
            with self._lock:
                if name not in index:
                    continue
                index.move_to_end(name)
            with contextlib.suppress(OSError):  # mtimes carry the order to the next process
                os.utime(self._path(key))

    def _read(self, path: Path) -> bytes:
        """The bytes of the record file at ``path``; :class:`_NotARecord` for anything this tier cannot have
        written: not a regular file (a named pipe there blocked ``read_bytes`` forever, the request with
        it) or larger than the tier's whole budget (a 1 GiB file was read and hashed before being refused).
        """
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused on fstat below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _NotARecord("not a regular file")
            if st.st_size > self.max_bytes:
                # Junk only once this tier has stored a record (its budget holds this model's records);
                # before, a budget below one record deleted every valid record other processes looked up.
                raise _NotARecord(
                    f"{st.st_size} bytes, more than the tier's budget of {self.max_bytes}",
                    remove=self._stored,
                )
            # +1: a file growing under us is read whole, then fails its check.
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(st.st_size + 1)
        finally:
            os.close(fd)

    def put(self, key: ChunkHash, record: bytes) -> bool:
        return self._put(key, record, retry=True)

    def _put(self, key: ChunkHash, record: bytes, *, retry: bool) -> bool:
        index = self._loaded()
        name = key.hex()
        with self._lock:
            if name in index:
                return True
        if len(record) > self.max_bytes:
            # NOTE: counted and said once: a budget below one record turned the tier off in silence
            # (stores=0, errors=0). The engine refuses such a budget when it is built (ConfigError).
            self.counters.add("dropped")
            if not self._too_big_logged:
                self._too_big_logged = True
                logger.warning(
                    "disk tier at %s: a record of %d bytes is larger than disk_cache_bytes (%d); such "
                    "records are not stored: raise disk_cache_bytes",
                    self.directory,
                    len(record),
                    self.max_bytes,
                )
            return False
        if self.paused():
            self.counters.add("dropped")  # the disk is full: skipped without touching it
            return False
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(record)
            os.replace(tmp, path)
        except OSError as exc:
            self.counters.add("errors")
            # NOTE: the cleanup must not raise in turn: when a path component is not a folder, unlink raises
            # NotADirectoryError (missing_ok covers FileNotFoundError only), which escaped put() and logged
            # a traceback per block from the writer thread.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if retry and path.is_dir() and not path.is_symlink() and self._remove_folder(path):
                return self._put(key, record, retry=False)  # a folder in the record's place (see _unlink)
            if retry and exc.errno in _NO_SPACE and self._make_room(_ROOM_RECORDS * len(record)):
                # The disk filled up before the tier reached its budget (other files share it): the
                # oldest records make way, as the budget would have had them do; the cache froze before.
                if not self._full_logged:  # once per process: it repeats with every write from now on
                    self._full_logged = True
                    logger.warning(
                        "disk tier at %s: the file system is full at %d bytes of records, below "
                        "disk_cache_bytes (%d); the oldest records make room for new ones from now on",
                        self.directory,
                        self._bytes,
                        self.max_bytes,
                    )
                return self._put(key, record, retry=False)
            if exc.errno in _FULL_ERRNOS:
                # NOTE: one warning per pause, not one per block: a full disk would otherwise log every
                # write behind every request. Reads go on; stores retry after the pause.
                self._pause(exc)
            else:
                logger.warning("disk tier write failed (%s); record not stored", exc)
            return False
        with self._lock:
            self._refused.pop(name, None)
            index[name] = len(record)
            self._bytes += len(record)
            self._stored_since_scan += len(record)
            self._stored = True
            if self._stored_since_scan * _RESCAN_SHARE >= self.max_bytes:
                self._rescan()
            self._evict_over_budget()
        self.counters.add("stores")
        self._maybe_persist_stats()
        return True

    def paused(self) -> bool:
        return time.monotonic() < self._full_until

    def _pause(self, exc: OSError) -> None:
        self._full_until = time.monotonic() + _FULL_PAUSE_S
        self._pause_errno = exc.errno
        logger.warning(
            "disk tier at %s cannot store records (%s: full, read-only or not writable by this process); "
            "reads go on, stores skipped for %.0f s",
            self.directory,
            exc.strerror or exc,
            _FULL_PAUSE_S,
        )

    def _probe(self) -> None:
        """Create the namespace folder and write a probe file; a folder that cannot take records pauses
        stores now, with the warning at start-up (it came with the first request)."""
        probe = self.directory / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        except OSError as exc:
            self.counters.add("errors")
            self._pause(exc)
        finally:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)

    def contains(self, key: ChunkHash) -> bool:
        if self._still_refused(key.hex(), self._path(key)):
            return False  # a refused record that could not be deleted: to be rewritten
        with self._lock:
            if key.hex() in self._loaded():
                return True
        # is_file: a folder or a pipe at the path is no record (exists() said stored: never written)
        return self._path(key).is_file()

    def delete(self, key: ChunkHash) -> None:
        path = self._path(key)
        removed = self._unlink(path)
        with self._lock:
            self._forget(key.hex())
            if not removed and self._undeletable():
                # NOTE: a corrupt record in a read-only folder was read, refused and its delete retried (an
                # error counted) by every lookup; it is a miss now, unread, until its file changes.
                signature = _signature(path)
                if signature is not None:
                    self._refused[key.hex()] = signature

    def _still_refused(self, name: str, path: Path) -> bool:
        """``name`` was refused and its file has not changed since (another process may have replaced it
        with a valid record: then it is read again)."""
        refused = self._refused.get(name)
        if refused is None:
            return False
        if _signature(path) == refused:
            return True
        self._refused.pop(name, None)
        return False

    def _unlink(self, path: Path) -> bool:
        """Remove one record file; whether it was there and removed. Never raises: in a read-only folder
        every delete of a corrupt record (and of the chain read behind it) escaped into the writer thread, a
        traceback each, uncounted. Counted as ``errors``, with the stores' pause and its one warning for a
        folder that cannot be written."""
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if path.is_dir() and not path.is_symlink():
                # A folder named like a record (no write of ours leaves one): unlink cannot remove it, so
                # it was refused on every lookup and blocked the record's write (os.replace onto a folder).
                return self._remove_folder(path)
            self.counters.add("errors")
            if exc.errno in _FULL_ERRNOS:
                if not self.paused():
                    self._pause(exc)
            else:
                logger.warning("disk tier could not remove %s (%s)", path, exc)
            return False

    def _remove_folder(self, path: Path) -> bool:
        try:
            if path.resolve().parent.parent != self.directory.resolve():
                # NOTE: the folder is reached through a symlinked <hh> sub-folder: it lies outside the tier's
                # own folder, which is all the tier may delete.
                logger.warning("disk tier: %s lies outside %s; left alone", path, self.directory)
                return False
            shutil.rmtree(path)
            return True
        except OSError as exc:
            self.counters.add("errors")
            logger.warning("disk tier could not remove the folder %s (%s)", path, exc)
            return False

    def clear(self) -> int:
        with self._lock:
            # NOTE: the folder, not just the index: records another process (or another engine on the same
            # folder) wrote after this one scanned it were left behind, so ``reset_cache(lower_tiers=True)``
            # kept serving them to the next engine.
            names = set(self._loaded()) | {
                path.name[: -len(SUFFIX)] for path in self.directory.glob(f"*/*{SUFFIX}")
            }
            removed = 0
            for name in names:
                if self._unlink(self._file(name)):
                    removed += 1
                    self._refused.pop(name, None)
                self._forget(name)
        return removed

    def stats(self) -> TierStats:
        index = self._loaded()
        with self._lock:
            entries, size = len(index), self._bytes
        totals = self.counters.snapshot()
        return TierStats(
            name=self.name,
            entries=entries,
            bytes=size,
            **{k: self._base.get(k, 0) + v for k, v in totals.items()},
        )

    def close(self) -> None:
        self._persist_stats()

    # ------------------------------------------------------------------ internals
    def _path(self, key: ChunkHash) -> Path:
        return self._file(key.hex())

    def _file(self, name: str) -> Path:
        return record_path(self.directory, name)

    def _loaded(self) -> OrderedDict[str, int]:
        """The index, built on first use from the files on disk (oldest mtime first), trimmed to the
        budget: a folder left over budget (a smaller ``disk_cache_bytes`` than the last run's, or several
        processes' records) stayed so for as long as the process only read from it, since only a store or
        a record new to the index evicted."""
        with self._lock:
            if self._index is None:
                self._index = self._scan()
                self._bytes = sum(self._index.values())
                self._base = read_counters(self.directory)
                smallest = min(self._index.values(), default=0)
                if smallest > self.max_bytes:
                    # NOTE: a budget below every record in the folder (below one record of the model: the
                    # engine refuses it, a DiskTier used alone does not know a record's size) would delete
                    # them all, other processes' records too, and could store none.
                    logger.warning(
                        "disk tier at %s: disk_cache_bytes (%d) is smaller than every record in the folder "
                        "(the smallest holds %d bytes): none is evicted, and none can be stored; raise "
                        "disk_cache_bytes",
                        self.directory,
                        self.max_bytes,
                        smallest,
                    )
                else:
                    self._evict_over_budget()
            return self._index

    def _rescan(self) -> None:
        """Replace the index with the folder's records (in place: callers hold the index object): records
        this process knew keep its order, the others go by mtime (see the note below).

        Before, a process only knew the records it wrote or read: with several servers on one folder, each
        evicted its own records only, and the folder held the sum of their budgets (measured: two servers of
        8 MiB each kept 15.6 MiB)."""
        index = self._index
        assert index is not None
        # NOTE: mtimes are coarse (the kernel stamps files with a clock of a few milliseconds), so records
        # this process stored or bumped within one tick tie; sorting by mtime alone shuffled them, and the
        # chain a finished request had bumped from its end lost its head first again. Records already known
        # keep this process's exact order (their times made non-decreasing in it); new ones go by mtime.
        ranked = []
        floor = -math.inf
        files = {name: (mtime, size) for mtime, name, size in scan_records(self.directory)}
        for position, name in enumerate(index):
            if name in files:
                mtime, size = files[name]
                floor = max(floor, mtime)
                ranked.append((floor, 1, position, name, size))
        ranked.extend((mtime, 0, 0, name, size) for name, (mtime, size) in files.items() if name not in index)
        ranked.sort()
        index.clear()
        index.update((name, size) for *_, name, size in ranked)
        self._bytes = sum(index.values())
        self._stored_since_scan = 0

    def _scan(self) -> OrderedDict[str, int]:
        """The folder's records, name -> size, oldest mtime first."""
        return OrderedDict((name, size) for _, name, size in sorted(scan_records(self.directory)))

    def _forget(self, name: str) -> None:
        size = self._index.pop(name, None) if self._index is not None else None
        if size is not None:
            self._bytes -= size

    def _make_room(self, nbytes: int) -> bool:
        """Evict the least recently used records until ``nbytes`` are freed; whether any was removed."""
        freed = 0
        with self._lock:
            while freed < nbytes and self._index and not self._undeletable():
                freed += self._evict_oldest()
        return freed > 0

    def _evict_over_budget(self) -> None:
        while self._bytes > self.max_bytes and self._index and not self._undeletable():
            self._evict_oldest()

    def _undeletable(self) -> bool:
        """Stores are paused because the folder cannot be written (read-only, not ours), not because it is
        full: deletes fail too, so eviction waits for the pause to end."""
        return self.paused() and self._pause_errno not in _NO_SPACE

    def _evict_oldest(self) -> int:
        """Drop the least recently used record from the index and the folder; the bytes it removed (0 for a
        file another process had already removed: not counted as an eviction).

        A record the folder refuses to delete (read-only: the tier pauses) stays indexed, still the oldest:
        dropped from the index, it stayed on disk, the next lookup found it again, and each such lookup retried
        the delete (an error counted per lookup, a shared read-only folder over budget never settling)."""
        name, size = self._index.popitem(last=False)
        self._bytes -= size
        path = self._file(name)
        if not self._unlink(path):
            if self._undeletable() and path.exists():
                self._index[name] = size
                self._index.move_to_end(name, last=False)
                self._bytes += size
            return 0
        self.counters.add("evictions")
        return size

    def _maybe_persist_stats(self) -> None:
        if time.monotonic() - self._last_persist >= _STATS_INTERVAL_S:
            self._persist_stats()

    def _persist_stats(self) -> None:
        """Write cumulative counters (previous runs + this one) for ``kvboost cache status``."""
        if self._index is None:
            return
        self._last_persist = time.monotonic()
        write_counters(
            self.directory, {k: self._base.get(k, 0) + v for k, v in self.counters.snapshot().items()}
        )


def _signature(path: Path) -> tuple[int, int] | None:
    """``(mtime_ns, size)`` of the file at ``path``; None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
