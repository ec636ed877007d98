"""Where chunks live below RAM: disk and Redis settings."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvb_cache.errors import ConfigError

GiB = 1 << 30
#: Default byte budget of the disk tier.
DEFAULT_DISK_CACHE_BYTES = 16 * GiB


#: Connect/read timeout of every Redis call (seconds), unless TierConfig / --remote-timeout says otherwise.
DEFAULT_REMOTE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TierConfig:
    """Lower cache tiers (both optional; RAM is always first).

    Attributes:
        disk_cache_dir: folder for the disk tier (one sub-folder per model fingerprint; ``~`` is expanded);
            None disables it.
        disk_cache_bytes: byte budget of this engine's sub-folder (its model fingerprint's records, headers
            included), the records of every process writing it included (give each the folder's budget:
            each rereads the folder after storing an eighth of it, so a shared folder overshoots by at most
            what they stored since). Each model has its own sub-folder and budget (an old model's stays until
            removed; ``kvboost cache status`` lists them). Below one block record of the model: ConfigError.
        remote_url: ``redis://host:port/db`` of a shared Redis (``pip install 'kvb-cache[redis]'``).
        remote_codec: store Redis records in another codec than RAM, e.g. ``"absmax8"`` (the int8 wire codec,
            records 0.28x the bytes of fp32 KV, 0.57x of fp16). Lossy: it becomes part of the model fingerprint,
            so such engines share entries only with each other. None: same form as RAM.
        remote_ttl_s: expire Redis records after this many seconds (None: rely on ``maxmemory`` eviction).
        remote_timeout_s: connect/read timeout of every Redis call; past it the call is a miss (records
            of big models are megabytes: leave room for the transfer).
        max_pending_writes: bound of the write-behind queue; further writes are dropped and counted.
        exit_flush_timeout_s: how long ``close()`` (and the interpreter-exit hook an engine registers) waits
            for queued writes to reach disk/Redis; writes still queued past it are lost.
    """

    disk_cache_dir: str | os.PathLike[str] | None = None
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES
    remote_url: str | None = None
    remote_codec: str | None = None
    remote_ttl_s: int | None = None
    remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S
    max_pending_writes: int = 256
    exit_flush_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.disk_cache_bytes, int) or self.disk_cache_bytes < 1:
            raise ConfigError(
                f"disk_cache_bytes must be a positive int of bytes, got {self.disk_cache_bytes!r}"
            )
        # A file where the folder should be failed every read and write later (each write behind logging a
        # traceback) while the engine ran without its disk tier: refuse it here, where the fix is obvious.
        directory = self.disk_cache_dir
        if directory is not None:
            # "~/.cache/kvb" made a folder named "~" in the working directory (and a restart elsewhere missed
            # every record): expanded as a shell would.
            directory = os.path.expanduser(os.fspath(directory))
            object.__setattr__(self, "disk_cache_dir", directory)
        if directory is not None and os.path.exists(directory) and not os.path.isdir(directory):
            raise ConfigError(
                f"disk_cache_dir {os.fspath(directory)!r} is a file; pass a folder (created if missing)"
            )
        if self.remote_url is not None and not str(self.remote_url).startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(f"remote_url must look like redis://host:6379/0, got {self.remote_url!r}")
        if self.remote_codec is not None:
            from kvb_cache.codecs import codec_from_name  # deferred: the codecs import torch

            # The name first: an unknown one was reported as missing a remote_url.
            codec_from_name(self.remote_codec)  # an unknown name fails here, not when an engine is built
        if self.remote_codec is not None and self.remote_url is None:
            raise ConfigError("remote_codec only applies with a remote_url; set both or neither")
        if self.remote_ttl_s is not None and self.remote_url is None:
            raise ConfigError("remote_ttl_s only applies with a remote_url; set both or neither")
        if self.remote_ttl_s is not None and (
            not isinstance(self.remote_ttl_s, int) or self.remote_ttl_s < 1
        ):
            raise ConfigError(
                f"remote_ttl_s must be None or a positive int of seconds, got {self.remote_ttl_s!r}"
            )
        # NOTE: a finite number, checked before comparing: None or "2" raised a bare TypeError, and inf (meant
        # as "no timeout", i.e. a request hanging on a stalled Redis) an OverflowError from the socket layer.
        timeout = self.remote_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigError(
                f"remote_timeout_s must be a finite number of seconds > 0 (e.g. 2.0), got {timeout!r}"
            )
        if not isinstance(self.max_pending_writes, int) or self.max_pending_writes < 1:
            raise ConfigError(f"max_pending_writes must be a positive int, got {self.max_pending_writes!r}")
        # Finite too: inf (meant as "wait for every write") passed, and the flush's thread join then raised
        # OverflowError at close() / interpreter exit, losing the queued writes it was meant to keep.
        if isinstance(self.exit_flush_timeout_s, bool) or not (
            isinstance(self.exit_flush_timeout_s, (int, float))
            and 0 < self.exit_flush_timeout_s < float("inf")
        ):
            raise ConfigError(
                f"exit_flush_timeout_s must be a finite number > 0 seconds (e.g. 10.0), got "
                f"{self.exit_flush_timeout_s!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.disk_cache_dir is not None or self.remote_url is not None
