"""A disk tier folder's files: its record files, stale temp files, and the counters file.

Functions of a folder path, shared by :class:`~kvb_cache.tiers.disk.DiskTier` and ``kvboost cache status``
(:mod:`kvb_cache.tiers.status`), which reads a folder without building a tier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import NamedTuple

from kvb_cache.tiers.base import Counters

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
STATS_FILE = "stats.json"
# A temp file older than this is a dead writer's leftover (a live write renames its file within seconds).
_STALE_TMP_S = 600.0


class RecordFile(NamedTuple):
    """One record file: ``mtime`` (its recency: bumped on every hit), ``name`` (the key's hex), ``size``."""

    mtime: float
    name: str
    size: int


def record_path(directory: Path, name: str) -> Path:
    """Where the record ``name`` (a key's hex) lives: ``<directory>/<hh>/<name>.kvb``."""
    return directory / name[:2] / f"{name}{SUFFIX}"


def scan_records(directory: Path) -> list[RecordFile]:
    """Each record file of ``directory`` (unordered), stale temp files removed on the way."""
    found: list[RecordFile] = []
    if not directory.exists():
        return found
    now = time.time()
    # Records' temp files, and the counters' and the write probe's (a process killed while writing them, or a
    # full disk, left them behind).
    stale = (f"*/*{SUFFIX}.*.tmp", f"{STATS_FILE}.*.tmp", ".probe.*.tmp")
    for tmp in (found for pattern in stale for found in directory.glob(pattern)):
        # A writer died between write and rename. Only stale ones: in a folder shared by several processes a
        # fresh temp file is another process's write in flight (it renames it next). Any OSError is left
        # alone: a read-only folder (or another user's) cannot drop it, and the records beside it must still
        # be served (it made every lookup and store raise before).
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink(missing_ok=True)
    for path in directory.glob(f"*/*{SUFFIX}"):
        try:
            st = path.stat()
        except OSError:  # gone since the glob, or unreadable (a symlink loop): not a record
            continue
        if not stat.S_ISREG(st.st_mode):  # a folder or a pipe: refused (and removed) when looked up
            continue
        found.append(RecordFile(st.st_mtime, path.name[: -len(SUFFIX)], st.st_size))
    return found


def read_counters(directory: Path) -> dict[str, int]:
    """The cumulative counters persisted in ``directory`` (every :attr:`Counters.FIELDS` name found as an
    int); ``{}`` when the file is missing or unreadable."""
    try:
        raw = json.loads((directory / STATS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    # NOTE: valid JSON that is not an object (a truncated rewrite, another program's file) is ignored like
    # unreadable JSON: the counters are a report, and raw.items() on a list crashed the first request that
    # touched the tier.
    if not isinstance(raw, dict):
        return {}
    return {
        k: int(v)
        for k, v in raw.items()
        if k in Counters.FIELDS and isinstance(v, int) and not isinstance(v, bool)
    }


def write_counters(directory: Path, totals: dict[str, int]) -> None:
    """Persist ``totals`` atomically (a temp file, then a rename); a failure is logged at debug level only:
    the counters are a report for ``kvboost cache status``."""
    tmp = directory / f"{STATS_FILE}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(totals))
        os.replace(tmp, directory / STATS_FILE)
    except OSError as exc:
        logger.debug("could not persist disk tier counters: %s", exc)
        with contextlib.suppress(OSError):  # a full disk left it half-written
            tmp.unlink(missing_ok=True)
