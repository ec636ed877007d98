"""Disk tier: atomic files, budget and LRU order, restarts, and the TieredStore over it."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvb_cache.codecs import DenseCodec, KiviCodec
from kvb_cache.core.kv_storage import LayerShape
from kvb_cache.hashing import content_hash, prefix_hash, root_hash
from kvb_cache.records import RecordFormat, decode_record, encode_record
from kvb_cache.store import ChunkEntry, ChunkStore
from kvb_cache.tiers import BackgroundWriter, DiskTier, LowerTier, TieredStore

FINGERPRINT = "a" * 64
ROOT = root_hash(FINGERPRINT)


def chain(n: int, tag: int = 0, tokens: int = 4) -> list[ChunkEntry]:
    out, parent = [], ROOT
    for i in range(n):
        ids = tuple(tag * 1000 + i * tokens + j for j in range(tokens))
        g = torch.Generator().manual_seed(tag * 100 + i)
        kv = tuple(
            (torch.randn(1, 2, tokens, 8, generator=g), torch.randn(1, 2, tokens, 8, generator=g))
            for _ in range(2)
        )
        key = prefix_hash(parent, ids)
        out.append(
            ChunkEntry(
                key=key,
                parent=parent,
                content=content_hash(ROOT, ids),
                token_ids=ids,
                kv=kv,
                start=i * tokens,
            )
        )
        parent = key
    return out


def tiered(tmp_path, *, ram_bytes=1 << 20, disk_bytes=1 << 20, codec=None, shapes=None) -> TieredStore:
    codec = codec or DenseCodec()
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=disk_bytes)
    ram = ChunkStore(ram_bytes)
    store = TieredStore(
        ram,
        root=ROOT,
        codec=codec,
        lower=[LowerTier(tier=disk, format=RecordFormat(fingerprint=FINGERPRINT, codec=codec))],
        writer=BackgroundWriter(16),
        shapes=shapes,
    )
    ram.on_evict = store.demote
    return store


def stored(tmp_path, entries: list[ChunkEntry]) -> TieredStore:
    """A tiered store over ``tmp_path`` holding ``entries`` on disk (written behind, flushed)."""
    store = tiered(tmp_path)
    for e in entries:
        store.put(e, root=ROOT)
    store.flush()
    return store


def record(entry: ChunkEntry) -> bytes:
    return encode_record(entry, RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec()))


def test_put_get_and_files_are_atomic(tmp_path):
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    entry = chain(1)[0]
    data = record(entry)
    assert disk.get(entry.key) is None
    assert disk.put(entry.key, data) and disk.contains(entry.key)
    assert disk.get(entry.key) == data
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files if p.suffix == ".kvb"] == [entry.key.hex() + ".kvb"]
    assert not [p for p in files if p.name.endswith(".tmp")]
    s = disk.stats()
    assert (s.entries, s.bytes, s.hits, s.misses, s.stores) == (1, len(data), 1, 1, 1)


def test_budget_evicts_least_recently_used_and_survives_restart(tmp_path):
    entries = chain(4)
    size = len(record(entries[0]))
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=3 * size)
    for i, e in enumerate(entries[:3]):
        disk.put(e.key, record(e))
        os.utime(disk._path(e.key), (1000 + i, 1000 + i))  # deterministic mtimes
    disk.get(entries[0].key)  # now most recent
    disk.put(entries[3].key, record(entries[3]))
    assert [disk.contains(e.key) for e in entries] == [True, False, True, True]
    assert disk.stats().evictions == 1 and disk.stats().bytes == 3 * size
    disk.close()
    again = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=3 * size)
    s = again.stats()
    assert (s.entries, s.bytes, s.evictions) == (3, 3 * size, 1)  # counters persisted across restarts
    back = decode_record(again.get(entries[3].key), RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec()))
    assert back.token_ids == entries[3].token_ids and torch.equal(back.kv[1][1], entries[3].kv[1][1])


def test_leftover_temp_files_are_removed_on_start(tmp_path):
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    entry = chain(1)[0]
    disk.put(entry.key, record(entry))
    stale = disk._path(entry.key).with_name("x.kvb.123.456.tmp")
    stale.write_bytes(b"half a record")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    # Another process sharing the folder is writing this one right now: it must survive a new tier's scan.
    in_flight = disk._path(entry.key).with_name("y.kvb.789.1011.tmp")
    in_flight.write_bytes(b"being written")
    # A counters file and a write probe left by a process killed while writing them, or by a full disk.
    leftovers = [disk.directory / "stats.json.12345.tmp", disk.directory / ".probe.12345.678.tmp"]
    for path in leftovers:
        path.write_bytes(b"{")
        os.utime(path, (old, old))
    DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20).stats()
    assert not stale.exists()
    assert in_flight.exists()
    assert [p.exists() for p in leftovers] == [False, False]


def test_a_folder_that_cannot_drop_a_stale_temp_file_still_serves_its_records(tmp_path, monkeypatch):
    """A read-only (or another user's) folder holding a crashed writer's stale temp file, or a record name
    that is a symlink loop: the start-up scan raised, and every lookup, store and stats call with it (an
    audit, 2026-12-01). Now the file is left alone and the records are served."""
    import errno
    from pathlib import Path

    entries = chain(2)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    data = [record(e) for e in entries]
    for e, d in zip(entries, data):
        assert disk.put(e.key, d)
    disk.close()
    stale = disk._path(entries[0].key).with_name("x.kvb.123.456.tmp")
    stale.write_bytes(b"half a record")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    loop = disk._path(entries[0].key).with_name("ab" * 16 + ".kvb")
    loop.symlink_to(loop.name)
    real_unlink = Path.unlink

    def denied(self, missing_ok=False):
        if self.name.endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", denied)
    again = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    assert again.stats().entries == 2 and stale.exists()
    assert [again.get(e.key) for e in entries] == data


def test_tiered_store_writes_behind_and_promotes_a_chain_after_restart(tmp_path):
    entries = chain(5)
    store = tiered(tmp_path)
    for e in entries:
        assert store.put(e, root=ROOT)
    store.flush()
    store.close()
    fresh = tiered(tmp_path)
    assert len(fresh) == 0
    assert fresh.prefetch([e.key for e in entries]) == 5
    assert len(fresh) == 5
    for e in entries:
        got = fresh.get(e.key)
        assert got.parent == e.parent and got.token_ids == e.token_ids
        assert all(torch.equal(a, b) for pa, pb in zip(got.kv, e.kv) for a, b in zip(pa, pb))
    assert fresh.lower[0].tier.stats().hits == 5


def test_get_without_prefetch_falls_back_to_disk_and_stops_at_a_gap(tmp_path):
    entries = chain(3)
    store = stored(tmp_path, entries)
    store.lower[0].tier.delete(entries[1].key)
    fresh = tiered(tmp_path)
    assert fresh.get(entries[0].key) is not None
    assert fresh.get(entries[1].key) is None
    assert fresh.prefetch([e.key for e in entries]) == 0  # the chain is cut at the missing middle link
    assert entries[2].key not in fresh


def test_corrupted_record_is_dropped_counted_and_treated_as_a_miss(tmp_path):
    entries = chain(2)
    store = stored(tmp_path, entries)
    path = store.lower[0].tier._path(entries[1].key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = tiered(tmp_path)
    assert fresh.prefetch([e.key for e in entries]) == 1
    fresh.flush()
    disk = fresh.lower[0].tier
    assert disk.stats().corrupt == 1 and not path.exists()
    # The corrupt record was found (a tier hit) but served nothing: the hit rate counts 1 of 2 lookups.
    stats = disk.stats()
    assert (stats.hits, stats.misses, stats.hit_rate) == (2, 0, 0.5)
    assert fresh.put(entries[1], root=ROOT)  # recomputed KV is stored again
    fresh.flush()
    assert path.exists()


@pytest.mark.parametrize("kind", ["fifo", "oversized", "folder"])
def test_what_no_record_write_leaves_is_refused_unread(tmp_path, kind):
    """A named pipe at a record's path blocked the read (and the request) forever; a file larger than the
    tier's budget was read whole and hashed first; a folder could not be removed, so it was refused on every
    lookup and blocked the record's write. All are refused without reading, counted as corrupt, removed,
    and the chunk is a miss (recomputed) that the next store heals."""
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=4096)
    disk.stats()  # indexed before: the thing appears later, as another process's file would
    entry, other = chain(2)
    assert disk.put(other.key, record(other))  # its budget holds a record: a file past it is no record
    path = disk._path(entry.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: no disk space used
    else:
        path.mkdir()
        (path / "inner").write_bytes(b"x")
    t0 = time.monotonic()
    assert disk.get(entry.key) is None
    assert time.monotonic() - t0 < 5
    stats = disk.stats()
    assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 0)
    assert not os.path.lexists(path)
    data = record(entry)
    assert disk.put(entry.key, data) and disk.get(entry.key) == data


def test_a_folder_reached_through_a_symlinked_sub_folder_is_left_alone(tmp_path):
    """Removing a folder at a record's path must not reach outside the tier's own folder (a review found the
    ``<hh>`` sub-folder could be a symlink to anywhere)."""
    disk = DiskTier(tmp_path / "cache", namespace=FINGERPRINT, max_bytes=1 << 20)
    entry = chain(1)[0]
    path = disk._path(entry.key)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / path.name).mkdir(parents=True)
    path.parent.symlink_to(elsewhere, target_is_directory=True)
    assert disk.get(entry.key) is None
    assert (elsewhere / path.name).is_dir()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_what_no_record_write_leaves_is_not_indexed_at_start(tmp_path, kind):
    """A folder or a pipe named like a record was indexed by the start-up scan (as 4096 bytes for a folder):
    ``contains`` answered True, so the write-behind skipped the block and it was never stored."""
    entry = chain(1)[0]
    path = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)._path(entry.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    assert disk.stats().entries == 0
    store = TieredStore(
        ChunkStore(1 << 20),
        root=ROOT,
        codec=DenseCodec(),
        lower=[LowerTier(tier=disk, format=RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec()))],
        writer=BackgroundWriter(16),
    )
    assert store.put(entry, root=ROOT)
    store.flush()
    back = decode_record(disk.get(entry.key), RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec()))
    assert back.token_ids == entry.token_ids


def test_the_budget_holds_over_records_already_in_the_folder_at_start(tmp_path):
    """A folder over the budget at start (a smaller ``disk_cache_bytes`` than the last run's, or several
    processes' records) stayed over it for as long as the process only read from it: only a store, or a
    record new to the index, evicted. The scan now evicts the least recently used down to the budget."""
    entries = chain(5)
    size = len(record(entries[0]))
    big = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=5 * size)
    for i, e in enumerate(entries):
        big.put(e.key, record(e))
        os.utime(big._path(e.key), (1000 + i, 1000 + i))  # deterministic mtimes: entries[0] oldest
    big.close()
    small = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=2 * size)
    assert small.get(entries[4].key) is not None  # a hit-only workload
    s = small.stats()
    assert (s.entries, s.bytes, s.evictions) == (2, 2 * size, 3)
    assert [small._path(e.key).exists() for e in entries] == [False, False, False, True, True]


def test_a_budget_below_one_record_leaves_the_records_in_a_shared_folder_alone(tmp_path, caplog):
    """A DiskTier used alone with a budget below one record (the engine refuses one; a tier does not know a
    record's size) deleted every record in the folder: evicted at its first use, or refused as "larger than
    the budget" and removed at each lookup, other processes' valid records included."""
    entries = chain(3)
    size = len(record(entries[0]))
    writer = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in entries:
        writer.put(e.key, record(e))
    small = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=size - 1)
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.disk"):
        assert small.stats().entries == 3 and small.stats().evictions == 0
    assert any("smaller than every record in the folder" in r.getMessage() for r in caplog.records)
    assert small.get(entries[0].key) is None  # refused unread: a miss, not corrupt
    assert (small.stats().corrupt, small.stats().misses) == (0, 1)
    assert all(writer.get(e.key) is not None for e in entries)


def test_a_record_larger_than_the_budget_is_counted_and_said_once(tmp_path, caplog):
    """A budget below one record turned the tier off in silence (stores=0, errors=0, no warning)."""
    entries = chain(3)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=len(record(entries[0])) - 1)
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.disk"):
        assert not any(disk.put(e.key, record(e)) for e in entries)
    assert disk.stats().dropped == 3 and disk.stats().stores == 0
    said = [r for r in caplog.records if "larger than disk_cache_bytes" in r.getMessage()]
    assert len(said) == 1


def test_deletes_in_a_read_only_folder_are_counted_not_raised(tmp_path, monkeypatch, caplog):
    """A corrupt record in a read-only folder: its delete (and those of the chain behind it) raised EROFS
    into the writer thread, a traceback each, uncounted. Now counted as errors, one warning (the pause)."""
    import errno
    from pathlib import Path

    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    entries = chain(3)
    for e in entries:
        assert disk.put(e.key, record(e))

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.disk"):
        for e in entries:
            disk.delete(e.key)
        assert disk.clear() == 0
    assert disk.stats().errors == 6
    assert len([r for r in caplog.records if "cannot store records" in r.message]) == 1


def test_a_read_only_folder_over_budget_is_served_without_a_delete_per_lookup(tmp_path, monkeypatch):
    """A folder another process filled past this process's budget, read-only here: the start-up trim's delete
    failed, the record left the index but not the disk, and every lookup of it re-indexed it and tried a
    delete again (one error each). Now the refused record stays indexed until the pause ends."""
    import errno
    from pathlib import Path

    from kvb_cache.tiers import disk as disk_module

    entries = chain(3)
    writer = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in entries:
        assert writer.put(e.key, record(e))
    size = len(record(entries[0]))
    unlink = Path.unlink

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=2 * size)
    for _ in range(5):
        for e in entries:
            assert disk.get(e.key) is not None
    stats = disk.stats()
    assert (stats.errors, stats.evictions, stats.entries, stats.bytes) == (1, 0, 3, 3 * size)
    assert disk.paused()

    # Writable again once the pause is over: the next store trims the folder to the budget.
    monkeypatch.setattr(Path, "unlink", unlink)
    now = time.monotonic()
    monkeypatch.setattr(disk_module.time, "monotonic", lambda: now + 60.0)
    new = chain(1, tag=9)[0]
    assert disk.put(new.key, record(new))
    stats = disk.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 2 * size, 2)
    assert disk.contains(new.key) and disk.contains(entries[2].key) and not disk.contains(entries[0].key)


def test_a_corrupt_record_in_a_read_only_folder_is_read_once(tmp_path, monkeypatch):
    """A record refused as corrupt whose delete the folder refuses: every lookup read it again, was refused
    again and retried the delete (an error each). Now a miss, unread, until a store replaces it."""
    import errno
    from pathlib import Path

    from kvb_cache.tiers import disk as disk_module

    [entry] = chain(1)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    assert disk.put(entry.key, b"not a record")
    unlink = Path.unlink

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    for _ in range(5):  # what a tiered store does: read, refuse, delete
        if disk.get(entry.key) is not None:
            disk.delete(entry.key)
    stats = disk.stats()
    assert (stats.hits, stats.misses, stats.errors) == (1, 4, 1)
    assert not disk.contains(entry.key)  # to be rewritten
    assert disk.put(entry.key, record(entry)) is False  # paused: dropped

    # The folder's owner replaces the file with a valid record: read again (it stayed a miss for good).
    path = disk._path(entry.key)
    fixed = record(entry)
    path.write_bytes(fixed)
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    assert disk.contains(entry.key) and disk.get(entry.key) == fixed
    disk.delete(entry.key)  # refused again (what a tiered store does with a record it rejects)
    assert disk.get(entry.key) is None

    # Writable again once the pause is over: the recomputed record replaces it and is served.
    monkeypatch.setattr(Path, "unlink", unlink)
    now = time.monotonic()
    monkeypatch.setattr(disk_module.time, "monotonic", lambda: now + 60.0)
    data = record(entry)
    assert disk.put(entry.key, data)
    assert disk.get(entry.key) == data and disk.contains(entry.key)


def test_a_chain_of_corrupt_records_heals_in_one_recompute(tmp_path):
    # The fetch stopped at the first bad record and the recompute's write-behind skipped keys the tier held:
    # the bad records further down were never replaced (each request healed one, reuse grew a chunk a time).
    entries = chain(4)
    store = stored(tmp_path, entries)
    for e in entries:
        store.lower[0].tier._path(e.key).write_bytes(b"garbage")
    fresh = tiered(tmp_path)
    assert fresh.prefetch([e.key for e in entries]) == 0
    for e in entries:  # the request recomputes the chain and stores it
        fresh.put(e, root=ROOT)
    fresh.flush()
    stats = fresh.lower[0].tier.stats()
    # One record read and refused; the three behind it were fetched, dropped unread: misses, not hits.
    assert (stats.hits, stats.corrupt, stats.misses, stats.hit_rate) == (1, 1, 3, 0.0)
    again = tiered(tmp_path)
    assert again.prefetch([e.key for e in entries]) == 4


def test_an_unwritable_folder_warns_once_at_start_and_reads_go_on(tmp_path, monkeypatch, caplog):
    # Only a full or read-only file system paused stores: a folder this process may not write (EACCES,
    # EPERM) logged a warning per block of every request, and nothing was said at start-up.
    import errno
    import logging
    from pathlib import Path

    [kept, new] = chain(2)
    DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20).put(kept.key, record(kept))

    def refuse(self, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_bytes", refuse)
    with caplog.at_level(logging.WARNING, logger="kvb_cache.tiers.disk"):
        disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
        assert len(caplog.records) == 1 and "cannot store records" in caplog.text
        for _ in range(5):
            assert disk.put(new.key, record(new)) is False
        assert disk.get(kept.key) is not None  # a read-only folder of records is still served
    assert len(caplog.records) == 1
    assert (disk.stats().errors, disk.stats().dropped) == (1, 5)


def test_disk_cache_dir_expands_the_home_folder(tmp_path, monkeypatch):
    # "~/.cache/kvb" (the README's example) made a folder named "~" in the working directory.
    from kvb_cache.tiers import TierConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    assert TierConfig(disk_cache_dir="~/kvb").disk_cache_dir == str(tmp_path / "kvb")


def test_ram_eviction_demotes_what_the_disk_lacks(tmp_path):
    first, others = chain(1, tag=0)[0], chain(2, tag=1)
    store = tiered(tmp_path, ram_bytes=2 * first.nbytes)
    disk = store.lower[0].tier
    store.put(first, root=ROOT)
    store.flush()
    disk.delete(first.key)  # as if its write-behind had been dropped
    for e in others:
        assert store.put(e, root=ROOT)  # the second one evicts `first`, the least recently used leaf
    store.flush()
    assert first.key not in store and store.ram.stats().evictions == 1
    assert disk.contains(first.key)  # demoted on eviction


def test_write_behind_queue_drops_instead_of_blocking(tmp_path):
    import threading

    gate = threading.Event()
    store = tiered(tmp_path)
    store.writer = BackgroundWriter(1)
    store.writer.submit(gate.wait)  # occupies the thread
    for e in chain(4):
        assert store.put(e, root=ROOT)  # returns at once
    dropped = store.lower[0].tier.stats().dropped
    gate.set()
    store.flush()
    assert dropped >= 2 and store.writer.dropped == dropped


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_ram_holds_fewer_bytes_and_disk_keeps_the_codec(tmp_path, bits):
    codec = KiviCodec(bits=bits, group_size=4)
    store = tiered(tmp_path, codec=codec)
    entries = chain(2, tokens=8)
    for e in entries:
        store.put(e, root=ROOT)
    store.flush()
    held = store.peek(entries[0].key)
    # fp32 dense -> codes plus fp16 scale and zero point per group of 4: (bits + 32 / 4) / 32 of the bytes.
    assert held.encoded is not None and held.nbytes == entries[0].nbytes * (bits + 8) // 32
    fresh = tiered(tmp_path, codec=codec)
    assert fresh.prefetch([e.key for e in entries]) == 2
    got = fresh.peek(entries[1].key)
    assert torch.equal(got.layer(0)[1], store.peek(entries[1].key).layer(0)[1])


def test_other_fingerprints_live_in_other_folders(tmp_path):
    a = DiskTier(tmp_path, namespace="1" * 64, max_bytes=1 << 20)
    b = DiskTier(tmp_path, namespace="2" * 64, max_bytes=1 << 20)
    entry = chain(1)[0]
    a.put(entry.key, record(entry))
    assert b.get(entry.key) is None and a.get(entry.key) is not None


def test_a_process_reading_a_shared_folder_keeps_its_budget_and_counts_only_its_evictions(tmp_path):
    """A process that only read records another process wrote indexed them and never evicted (it reported
    2.2x its budget), and an eviction of a file another process had already removed was counted."""
    entries = chain(5)
    size = len(record(entries[0]))
    writer = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=3 * size)
    reader = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=3 * size)
    reader.get(entries[0].key)  # indexes the (empty) folder now
    for e in entries[:3]:
        writer.put(e.key, record(e))
    for e in entries[:3]:
        assert reader.get(e.key) is not None
    for e in entries[3:]:
        writer.put(e.key, record(e))  # the writer removes the two oldest files
    for e in entries[3:]:
        assert reader.get(e.key) is not None
    assert reader.stats().bytes <= 3 * size
    assert writer.stats().evictions == 2 and reader.stats().evictions == 0
    assert len(list((tmp_path / FINGERPRINT[:32]).rglob("*.kvb"))) == 3


def test_processes_sharing_a_folder_keep_it_within_one_budget(tmp_path):
    """Each process evicted only the records it knew (its own), so a folder shared by several processes
    held the sum of their budgets (two servers of 8 MiB each kept 15.6 MiB). A process now reads the folder
    again after storing an eighth of its budget and evicts over everything in it, oldest first."""
    entries = chain(12)
    size = len(record(entries[0]))
    a = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=4 * size)
    b = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=4 * size)
    a.stats(), b.stats()  # both indexed the empty folder at start
    for i, e in enumerate(entries):
        (a if i < 6 else b).put(e.key, record(e))
        os.utime((a if i < 6 else b)._path(e.key), (1000 + i, 1000 + i))  # deterministic mtimes
    on_disk = {p.name for p in (tmp_path / FINGERPRINT[:32]).rglob("*.kvb")}
    assert on_disk == {e.key.hex() + ".kvb" for e in entries[8:]}  # the newest four; before: eight files
    assert b.stats().bytes == 4 * size


def test_a_disk_full_before_the_budget_evicts_the_oldest_records_to_store(tmp_path, monkeypatch):
    """Other files filled the disk before the tier reached its budget: stores paused, retried, paused again,
    and the cache froze with its oldest records in place. The oldest records now make way (twice the new
    record's size), and the store goes through."""
    import errno
    from pathlib import Path

    entries = chain(4)
    tier = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in entries[:3]:
        assert tier.put(e.key, record(e))
    real = Path.write_bytes
    failures = iter([OSError(errno.ENOSPC, "No space left on device")])

    def full_once(self, data):
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_once)
    assert tier.put(entries[3].key, record(entries[3]))
    stats = tier.stats()
    assert stats.evictions == 2 and stats.errors == 1 and stats.entries == 2
    assert tier.get(entries[0].key) is None and tier.get(entries[3].key) is not None
    assert tier.put(chain(1, tag=9)[0].key, b"x" * 10)  # not paused


def test_a_disk_full_before_the_budget_is_said_once(tmp_path, monkeypatch, caplog):
    # The oldest records quietly made room: only an errors counter grew, with no log line.
    import errno
    from pathlib import Path

    entries = chain(6)
    tier = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in entries[:2]:
        assert tier.put(e.key, record(e))
    real = Path.write_bytes
    calls = {"n": 0}

    def full_every_other(self, data):  # each store fails once, then its retry goes through
        calls["n"] += 1
        if calls["n"] % 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_every_other)
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.disk"):
        for e in entries[2:]:
            tier.put(e.key, record(e))
    said = [r.getMessage() for r in caplog.records if "file system is full" in r.getMessage()]
    assert len(said) == 1 and "below disk_cache_bytes" in said[0]


def test_touch_makes_records_recent_in_the_order_given(tmp_path):
    entries = chain(4)
    size = len(record(entries[0]))
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=3 * size)
    for i, e in enumerate(entries[:3]):
        disk.put(e.key, record(e))
        os.utime(disk._path(e.key), (1000 + i, 1000 + i))
    disk.touch([entries[1].key, entries[0].key, chain(1, tag=5)[0].key])  # an unknown key is skipped
    disk.put(entries[3].key, record(entries[3]))
    assert [disk.contains(e.key) for e in entries] == [True, True, False, True]
    assert os.stat(disk._path(entries[0].key)).st_mtime > 1002  # the mtime carries it to the next process


def test_clear_drops_records_another_process_wrote_after_the_scan(tmp_path):
    # reset_cache(lower_tiers=True) cleared only the files this tier had indexed: a record another process
    # wrote into the shared folder afterwards survived and the next engine was served it.
    ours = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    theirs = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    other_model = DiskTier(tmp_path, namespace="b" * 64, max_bytes=1 << 20)
    mine, foreign = chain(2)
    ours.put(mine.key, record(mine))  # indexes the folder (empty until now)
    theirs.put(foreign.key, record(foreign))
    other_model.put(foreign.key, record(foreign))
    assert ours.clear() == 2
    assert not list((tmp_path / FINGERPRINT[:32]).rglob("*.kvb"))
    fresh = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    assert fresh.get(mine.key) is None and fresh.get(foreign.key) is None
    assert fresh.stats().entries == 0 and ours.stats().bytes == 0
    assert other_model.get(foreign.key) is not None  # another namespace is untouched


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"hits"', '{"hits": "7", "misses": true}'])
def test_counters_file_of_another_shape_is_ignored(tmp_path, content):
    # stats.json is a report; valid JSON that is not an object of ints (a foreign or half-rewritten file)
    # crashed the first request that touched the tier (AttributeError: 'list' object has no attribute 'items').
    entries = chain(2)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in entries:
        disk.put(e.key, record(e))
    disk.close()
    (disk.directory / "stats.json").write_text(content)
    again = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    assert again.get(entries[0].key) is not None
    s = again.stats()
    assert (s.entries, s.hits, s.misses) == (2, 1, 0)


def test_a_file_in_place_of_a_folder_fails_stores_without_raising(tmp_path):
    # The failed store's cleanup (unlinking its temp file) raised NotADirectoryError out of put(): the
    # writer thread logged a traceback per block. A failed store is counted and answered False.
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    disk = DiskTier(blocker, namespace=FINGERPRINT, max_bytes=1 << 20)
    [entry] = chain(1)
    assert disk.put(entry.key, record(entry)) is False
    assert disk.get(entry.key) is None
    # The start-up probe failed (one warning, stores paused: the store is dropped), then the failed read.
    assert (disk.stats().errors, disk.stats().dropped) == (2, 1)


def test_disk_cache_dir_naming_a_file_is_a_config_error(tmp_path):
    from kvb_cache import ConfigError
    from kvb_cache.tiers import TierConfig

    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="is a file"):
        TierConfig(disk_cache_dir=blocker)
    TierConfig(disk_cache_dir=tmp_path / "created-later")  # a missing folder is fine: created on first store


#: The KV layout of the model ``chain()`` stands for: 2 layers of 2 KV heads of 8 channels, fp32.
SHAPES = (LayerShape(kv_heads=2, key_dim=8, value_dim=8, dtype=torch.float32),) * 2


def shaped(
    parent=ROOT,
    *,
    tag=50,
    tokens=4,
    start=0,
    layers=2,
    heads=2,
    key_dim=8,
    value_dim=8,
    dtype=torch.float32,
    kv_tokens=None,
) -> ChunkEntry:
    """A chunk whose KV has the given layout (``kv_tokens`` KV positions for its ``tokens`` token ids), as
    a store of another model (or another program) sharing the tier would write it."""
    ids = tuple(tag * 1000 + start + j for j in range(tokens))
    g = torch.Generator().manual_seed(tag)
    t = tokens if kv_tokens is None else kv_tokens
    kv = tuple(
        (
            torch.randn(1, heads, t, key_dim, generator=g).to(dtype),
            torch.randn(1, heads, t, value_dim, generator=g).to(dtype),
        )
        for _ in range(layers)
    )
    return ChunkEntry(
        key=prefix_hash(parent, ids),
        parent=parent,
        content=content_hash(ROOT, ids),
        token_ids=ids,
        kv=kv,
        start=start,
    )


WRONG_LAYOUTS = {
    "more-kv-heads": dict(heads=4),
    "fewer-kv-heads": dict(heads=1),
    "wider-keys": dict(key_dim=16),
    "narrower-values": dict(value_dim=4),
    "fewer-layers": dict(layers=1),
    "more-layers": dict(layers=3),
    "fp16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
}


@pytest.mark.parametrize("layout", WRONG_LAYOUTS.values(), ids=WRONG_LAYOUTS.keys())
def test_record_of_another_kv_layout_is_dropped_counted_and_a_miss(tmp_path, layout):
    # A well-checksummed record of this fingerprint whose KV does not fit the model (another model's store
    # or another program writing into the shared namespace) was promoted and served: the forward using it
    # then crashed inside torch or, with fewer layers, silently read stale KV for the others.
    good, bad = shaped(tag=1), shaped(tag=2, **layout)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in (good, bad):
        assert disk.put(e.key, record(e))
    disk.close()
    store = tiered(tmp_path, shapes=SHAPES)
    disk = store.lower[0].tier
    assert store.get(bad.key) is None  # a miss, not an exception and not the record
    store.flush()  # the invalid record's deletion is queued on the writer
    assert bad.key not in store
    assert disk.stats().corrupt == 1
    assert not disk.contains(bad.key) and not disk._path(bad.key).exists()
    # Positive control: a record of the model's layout is still promoted and served as written.
    got = store.get(good.key)
    assert got is not None and good.key in store
    assert all(torch.equal(a, b) for pa, pb in zip(got.kv, good.kv) for a, b in zip(pa, pb))
    assert disk.stats().corrupt == 1 and disk.contains(good.key)


def test_prefetch_cuts_a_chain_at_a_record_of_another_kv_layout(tmp_path):
    first = shaped(tag=3)
    second = shaped(first.key, tag=3, start=4, heads=4)
    third = shaped(second.key, tag=3, start=8)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in (first, second, third):
        disk.put(e.key, record(e))
    store = tiered(tmp_path, shapes=SHAPES)
    assert store.prefetch([first.key, second.key, third.key]) == 1
    store.flush()
    assert first.key in store and second.key not in store and third.key not in store
    assert store.lower[0].tier.stats().corrupt == 1 and not store.lower[0].tier.contains(second.key)
    # Behind the bad record, dropped unread: the request recomputes (and stores) the chain from there on.
    assert not store.lower[0].tier.contains(third.key)


def test_quantized_record_whose_kv_length_is_not_its_token_count_is_a_miss(tmp_path):
    # decode_record checks the KV length of dense records only; a quantized record's values decode to
    # however many tokens were encoded.
    codec = KiviCodec(bits=8, group_size=4)
    bad = shaped(tag=4, tokens=8, kv_tokens=12)
    good = shaped(tag=5, tokens=8)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in (good, bad):
        disk.put(e.key, encode_record(e, RecordFormat(fingerprint=FINGERPRINT, codec=codec)))
    store = tiered(tmp_path, codec=codec, shapes=SHAPES)
    assert store.get(bad.key) is None
    store.flush()
    assert store.lower[0].tier.stats().corrupt == 1 and not store.lower[0].tier.contains(bad.key)
    got = store.get(good.key)
    assert got is not None and got.layer(1)[1].shape == (1, 2, 8, 8)


def test_a_tier_implementing_only_the_abstract_methods_is_counted_against():
    """``RecordTier`` is the public base for custom tiers: one that sets no ``counters`` of its own got an
    AttributeError from the store on its first corrupt record (the store promises such records are misses,
    never raised) and when the write-behind queue dropped a write."""
    from kvb_cache.tiers import RecordTier, TierStats

    class DictTier(RecordTier):
        name = "dict"

        def __init__(self) -> None:
            self.records: dict = {}

        def get(self, key):
            return self.records.get(key)

        def put(self, key, record):
            self.records[key] = record
            return True

        def contains(self, key):
            return key in self.records

        def delete(self, key):
            self.records.pop(key, None)

        def clear(self):
            n = len(self.records)
            self.records.clear()
            return n

        def stats(self):
            return TierStats(name=self.name, entries=len(self.records), **self.counters.snapshot())

    tier, codec = DictTier(), DenseCodec()
    store = TieredStore(
        ChunkStore(1 << 20),
        root=ROOT,
        codec=codec,
        lower=[LowerTier(tier=tier, format=RecordFormat(fingerprint=FINGERPRINT, codec=codec))],
        writer=BackgroundWriter(1),
    )
    entries = chain(3)
    tier.put(entries[0].key, b"not a record")
    assert store.get(entries[0].key) is None
    store.flush()  # the corrupt record is deleted behind
    assert tier.stats().corrupt == 1 and not tier.contains(entries[0].key)
    import threading

    gate = threading.Event()
    store.writer.submit(gate.wait)  # occupies the writer: the next write-behinds are dropped
    for e in entries:
        store.put(e, root=ROOT)
    gate.set()
    store.flush()
    assert tier.stats().dropped >= 1
    store.close()


def test_recency_touches_never_take_the_slots_record_writes_need(tmp_path):
    # Touches shared the bounded write-behind queue: behind a slow tier they filled it, record writes were
    # dropped sooner, and a dropped touch still counted as done for its keys.
    import threading

    from kvb_cache.core.block_tiers import BlockTiers

    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    tiers = BlockTiers(
        [LowerTier(tier=disk, format=RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec()))],
        BackgroundWriter(4),
    )
    started, release = threading.Event(), threading.Event()
    tiers.writer.submit(lambda: (started.set(), release.wait(10)))  # the tier is slow: the writer is busy
    assert started.wait(10)
    tiers.writer.submit(lambda: None)
    tiers.writer.submit(lambda: None)
    keys = [e.key for e in chain(3)]
    tiers.touch(keys)  # half the queue is taken: a hint yields to writes
    assert tiers.writer.pending == 2 and not tiers._touched
    release.set()
    tiers.writer.flush(10)
    tiers.touch(keys)
    tiers.writer.flush(10)
    assert list(tiers._touched) == list(reversed(keys))


def test_a_submit_racing_close_starts_no_thread_after_it():
    """A loader thread's submit that passed the closed check just before ``close()`` started a new writer
    thread after close() returned: it ran the job on the closed tier and then waited forever (a review's
    repro). The check and the start now happen under the lock close() takes."""
    import threading

    from kvb_cache.tiers.writer import BackgroundWriter

    writer = BackgroundWriter(4, name="kvb-test-race-writer")
    entered, go = threading.Event(), threading.Event()
    start = writer._start_locked

    def paused_start():
        if threading.current_thread().name == "submitter":
            entered.set()
            go.wait(10)
        start()

    writer._start_locked = paused_start
    submitter = threading.Thread(target=writer.submit, args=(lambda: None,), name="submitter")
    submitter.start()
    assert entered.wait(10)
    closer = threading.Thread(target=writer.close)
    closer.start()
    closer.join(0.2)  # close() waits for the submit in progress (it holds the lock)
    go.set()
    submitter.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert writer.submit(lambda: None) is False  # closed: refused
    time.sleep(0.1)
    assert [t for t in threading.enumerate() if t.name == "kvb-test-race-writer"] == []


@pytest.mark.parametrize("full", [False, True], ids=["room", "full-queue"])
def test_a_writer_retired_by_the_collector_inside_a_submit_does_not_deadlock(full):
    """``retire`` runs from a garbage-collector finalizer, which may fire inside this thread's own
    ``submit`` (an allocation there: the thread object, a ``queue.Full``). Taking the submit's lock there
    deadlocked the thread (a review's repro; a loader thread promoting a record while its engine was
    cyclic garbage). The collection is placed inside the submit to make it deterministic."""
    import gc
    import threading
    import weakref

    from kvb_cache.tiers.writer import BackgroundWriter

    writer = BackgroundWriter(1, name="kvb-test-gc-writer")
    gate = threading.Event()
    writer.submit(lambda: gate.wait(10))  # the thread is busy with a job
    time.sleep(0.1)
    if full:
        writer.submit(lambda: None)

    class Owner:  # stands in for an engine in a reference cycle whose finalizer retires its writer
        pass

    gc.disable()
    try:
        owner = Owner()
        owner.me = owner
        weakref.finalize(owner, writer.retire, lambda: None).atexit = False
        del owner
        put = writer._queue.put_nowait

        def collecting_put(item):
            gc.collect()
            return put(item)

        writer._queue.put_nowait = collecting_put
        submitter = threading.Thread(target=writer.submit, args=(lambda: None,), daemon=True)
        submitter.start()
        submitter.join(5)
        assert not submitter.is_alive(), "submit deadlocked on the retire the collector ran inside it"
    finally:
        gc.enable()
        gate.set()
