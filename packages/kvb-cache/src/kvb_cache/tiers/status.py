"""What the lower tiers hold, per model namespace (``kvboost cache status``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvb_cache.tiers.base import Counters, TierStats
from kvb_cache.tiers.disk import DiskTier
from kvb_cache.tiers.disk_folder import SUFFIX, read_counters
from kvb_cache.tiers.remote import RedisTier, redact_url


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceStatus:
    """One model fingerprint's records in one tier (counters are cumulative over every process)."""

    tier: str
    namespace: str
    stats: TierStats


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisReachability:
    url: str
    reachable: bool
    round_trip_ms: float | None
    #: Why PING got no answer (redis-py's message: authentication failed, connection refused, timeout).
    error: str | None = None


def disk_status(directory: str | Path) -> list[NamespaceStatus]:
    """Every namespace folder under a disk cache directory (files and bytes counted from disk).

    Raises:
        NotADirectoryError: ``directory`` exists but is not a folder.
    """
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"--disk-cache-dir {str(directory)!r} is a file, not a disk cache folder")
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        sizes = _sizes(folder.glob(f"*/*{SUFFIX}"))
        # Every persisted counter (``dropped`` was left out: 0 in ``--json`` for a tier that skipped stores).
        counters = read_counters(folder)
        counts = {k: counters.get(k, 0) for k in Counters.FIELDS}
        stats = TierStats(name=DiskTier.name, entries=len(sizes), bytes=sum(sizes), **counts)
        out.append(NamespaceStatus(tier="disk", namespace=folder.name, stats=stats))
    return out


def _sizes(paths: Iterable[Path]) -> list[int]:
    """The sizes of the files among ``paths`` still there: a server sharing the folder may evict a record
    between the listing and its ``stat`` (``kvboost cache status`` died with FileNotFoundError)."""
    sizes = []
    for path in paths:
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            continue
    return sizes


def redis_status(url: str) -> tuple[RedisReachability, list[NamespaceStatus]]:
    """PING round trip, then every ``kvb:<namespace>:`` prefix with its entries, bytes and shared counters."""
    probe = RedisTier(url, namespace="probe", timeout_s=1.0)
    rtt = probe.ping_ms()
    reach = RedisReachability(
        url=redact_url(url), reachable=rtt is not None, round_trip_ms=rtt, error=probe.ping_error
    )
    if rtt is None:
        return reach, []
    namespaces = sorted(
        {
            name.split(b":")[1].decode()
            for name in probe._client.scan_iter(match="kvb:*", count=1000)
            if name.count(b":") >= 2
        }
    )
    out = []
    for ns in namespaces:
        tier = RedisTier(url, namespace=ns, timeout_s=1.0)
        out.append(NamespaceStatus(tier="redis", namespace=ns, stats=tier.namespace_usage()))
        tier.close()
    probe.close()
    return reach, out
