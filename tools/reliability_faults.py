"""Fault runs on real server processes: Redis outage, corrupted records, kill -9 during disk writes, disk full.

Every request must succeed (HTTP 200); what differs between runs is where the KV comes from, read from the
tiers' counters in ``/v1/stats`` (``hits``, ``misses``, ``errors``, ``corrupt``, ``stores``). Greedy
(``temperature`` 0) answers are compared with the answer computed before the fault: a bad read would
change them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from reliability_procs import Redis, Server, filler_text, http_json

WORDS = 120  # ~350 tokens: ~21 blocks of 16


def _wait(predicate: Callable[[], bool], timeout_s: float = 60.0, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def _ok(server: Server, prompt: str, max_tokens: int = 4) -> dict:
    status, body = server.complete(prompt, max_tokens=max_tokens)
    if status != 200:
        raise AssertionError(f"request failed with {status}: {body}")
    return {
        "text": body["choices"][0]["text"],
        "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
        "prompt_tokens": body["usage"]["prompt_tokens"],
    }


def _stored(server: Server, tier: str, at_least: int, timeout_s: float = 60.0) -> bool:
    return _wait(lambda: server.tier(tier)["stores"] >= at_least, timeout_s=timeout_s)


# --------------------------------------------------------------------------------------------- Redis outage
def redis_outage(log_dir: Path, *, down_requests: int = 6, words: int = WORDS) -> dict:
    """Redis killed mid-run and restarted on the same port (empty: no persistence)."""
    redis = Redis().start()
    server = Server(flags=("--remote-url", redis.url), log_dir=log_dir, name="redis-outage").start()
    out: dict = {"requests": 0, "failed": 0}
    try:
        first = _ok(server, filler_text(1, words))
        out["requests"] += 1
        _stored(server, "redis", first["prompt_tokens"] // 16)
        server.reset_ram()
        again = _ok(server, filler_text(1, words))
        out["requests"] += 1
        out["before_outage"] = {
            "cached_tokens_from_redis": again["cached_tokens"],
            "same_text": again["text"] == first["text"],
            "redis": server.tier("redis"),
        }
        redis.kill()
        down_t0 = time.monotonic()
        cached_while_down = []
        for i in range(down_requests):
            server.reset_ram()
            got = _ok(server, filler_text(1 if i % 2 == 0 else 100 + i, words))
            out["requests"] += 1
            cached_while_down.append(got["cached_tokens"])
        out["while_down"] = {
            "requests_ok": down_requests,
            "cached_tokens": cached_while_down,
            "seconds": round(time.monotonic() - down_t0, 2),
            "redis": server.tier("redis"),
        }
        redis.start()
        up_t0 = time.monotonic()
        hit_after_s = None
        attempt = 0
        while time.monotonic() - up_t0 < 60 and hit_after_s is None:
            attempt += 1
            prompt = filler_text(500 + attempt, words)
            stores = server.tier("redis")["stores"]
            written = _ok(server, prompt)
            out["requests"] += 1
            if not _wait(lambda s=stores: server.tier("redis")["stores"] > s, timeout_s=5):
                continue  # still inside the 2 s back-off: the write was skipped
            # Every full block of this prompt, or try another prompt: a write that began inside the back-off
            # stores only part of it. (This waited for 16 blocks, more than a short prompt has: the one
            # attempt then used the whole 60 s, and a partial write meant no hit at all.)
            if not _stored(server, "redis", stores + written["prompt_tokens"] // 16, timeout_s=10):
                continue
            server.reset_ram()
            got = _ok(server, prompt)
            out["requests"] += 1
            if got["cached_tokens"] > 0:
                hit_after_s = time.monotonic() - up_t0
                out["after_restart"] = {"cached_tokens": got["cached_tokens"], "attempts": attempt}
        out["hits_again_after_s"] = None if hit_after_s is None else round(hit_after_s, 2)
        out["redis_final"] = server.tier("redis")
        out["server_alive"] = server.alive()
    except AssertionError as exc:
        out["failed"] += 1
        out["error"] = str(exc)
    finally:
        server.stop()
        redis.kill()
    return out


# --------------------------------------------------------------------------------------- corrupted records
def _flip(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]


def corrupted_disk_record(log_dir: Path, *, words: int = WORDS, heal: bool = True) -> dict:
    """Flip a byte in every record, then truncate every record (a torn write); each time: 200, same text.

    With ``heal``, requests are repeated until every damaged record was replaced (counted)."""
    with tempfile.TemporaryDirectory(prefix="kvb-rel-disk-") as disk:
        server = Server(flags=("--disk-cache-dir", disk), log_dir=log_dir, name="corrupt-disk").start()
        out: dict = {}
        try:
            prompt = filler_text(2, words)
            ref = _ok(server, prompt, max_tokens=8)
            _stored(server, "disk", ref["prompt_tokens"] // 16)
            for how, damage in (("flipped_byte", _flip), ("truncated", lambda d: d[: len(d) // 2])):
                files = sorted(Path(disk).rglob("*.kvb"))
                for f in files:
                    f.write_bytes(damage(f.read_bytes()))
                before = server.tier("disk")
                server.reset_ram()
                got = _ok(server, prompt, max_tokens=8)
                after = server.tier("disk")
                # The recomputed blocks are written again, but only where no record file is left: a walk
                # stops at the first invalid record, so the damaged records after it are still on disk
                # (and still indexed), and the rewrite skips them until a later walk reaches them.
                _wait(lambda a=after: server.tier("disk")["stores"] > a["stores"], 15)
                # Every later request recomputes from the first damaged record still on disk and rewrites it.
                heal_requests, healed = 0, got
                while heal and healed["cached_tokens"] < ref["prompt_tokens"] - 16 and heal_requests < 30:
                    stores = server.tier("disk")["stores"]
                    _wait(lambda s=stores: server.tier("disk")["stores"] > s, 5)
                    server.reset_ram()
                    healed = _ok(server, prompt, max_tokens=8)
                    heal_requests += 1
                    if healed["text"] != ref["text"]:
                        break
                out[how] = {
                    "records_damaged": len(files),
                    "status": 200,
                    "same_text": got["text"] == ref["text"],
                    "cached_tokens": got["cached_tokens"],
                    "corrupt_counted": after["corrupt"] - before["corrupt"],
                    "requests_until_all_records_valid": heal_requests,
                    "cached_tokens_then": healed["cached_tokens"],
                    "healed_same_text": healed["text"] == ref["text"],
                }
            out["disk_final"] = server.tier("disk")
        except AssertionError as exc:
            out["error"] = str(exc)
        finally:
            server.stop()
    return out


def corrupted_redis_record(log_dir: Path, *, words: int = WORDS) -> dict:
    """Overwrite every record of the namespace with a flipped copy, then with garbage; 200, same text."""
    redis = Redis().start()
    server = Server(flags=("--remote-url", redis.url), log_dir=log_dir, name="corrupt-redis").start()
    out: dict = {}
    try:
        prompt = filler_text(3, words)
        ref = _ok(server, prompt, max_tokens=8)
        _stored(server, "redis", ref["prompt_tokens"] // 16)
        client = redis.client()
        for how, damage in (("flipped_byte", _flip), ("garbage", lambda d: b"not a record")):
            keys = [k for k in client.keys("kvb:*") if not k.endswith(b"__stats__")]
            for k in keys:
                client.set(k, damage(client.get(k)))
            before = server.tier("redis")
            server.reset_ram()
            got = _ok(server, prompt, max_tokens=8)
            after = server.tier("redis")
            out[how] = {
                "records_damaged": len(keys),
                "status": 200,
                "same_text": got["text"] == ref["text"],
                "cached_tokens": got["cached_tokens"],
                "corrupt_counted": after["corrupt"] - before["corrupt"],
            }
            _wait(lambda a=after: server.tier("redis")["stores"] > a["stores"], 15)
        server.reset_ram()
        healed = _ok(server, prompt, max_tokens=8)
        out["rewritten_then_hit_tokens"] = healed["cached_tokens"]
        out["redis_final"] = server.tier("redis")
    except AssertionError as exc:
        out["error"] = str(exc)
    finally:
        server.stop()
        redis.kill()
    return out


# ------------------------------------------------------------------------------------ kill -9 during writes
def kill9_during_disk_writes(
    log_dir: Path, *, prompts: int = 9, reference: int = 3, words: int = 250, kill_after_stores: int = 40
) -> dict:
    """SIGKILL while 3 clients send long distinct prompts (MBs of records written behind them).

    The first ``reference`` prompts are answered (and written) first, one at a time, for their greedy
    text. Then 3 clients send the rest and the server is killed once ``kill_after_stores`` more records
    were stored (writes still queued). Two records are then torn by hand and a stray temp file left. The
    restarted server on the same folder must answer every prompt (200), the reference prompts with the
    pre-kill text, the others with the text a cache-less recompute gives (after a full reset), and count
    the torn records as corrupt instead of serving them.
    """
    with tempfile.TemporaryDirectory(prefix="kvb-rel-kill9-") as disk:
        server = Server(flags=("--disk-cache-dir", disk), log_dir=log_dir, name="kill9").start()
        texts = [filler_text(1000 + i, words) for i in range(prompts)]
        answers = {i: _ok(server, texts[i])["text"] for i in range(reference)}
        stores_reference = server.tier("disk")["stores"]
        threads = [
            threading.Thread(target=_quietly, args=(server, [texts[i] for i in range(k, prompts, 3)]))
            for k in range(reference, reference + 3)
        ]
        for t in threads:
            t.start()
        _wait(lambda: server.tier("disk")["stores"] >= stores_reference + kill_after_stores, 300, 0.05)
        stores_before_kill = server.tier("disk")["stores"]
        server.kill()
        for t in threads:
            t.join()
        records = sorted(Path(disk).rglob("*.kvb"))
        tmp_left = sorted(Path(disk).rglob("*.tmp"))
        torn = records[len(records) // 3 :: max(1, len(records) // 2)][:2]
        for f in torn:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
        (records[0].parent / f"{records[0].name}.999.1.tmp").write_bytes(b"half a record")
        out: dict = {
            "prompt_words": words,
            "disk_stores_before_kill": stores_before_kill,
            "records_on_disk_after_kill": len(records),
            "temp_files_left_by_kill": len(tmp_left),
            "records_torn_by_hand": len(torn),
        }
        server.start()
        try:
            failed, cached, got = 0, 0, {}
            for i, text in enumerate(texts):
                status, body = server.complete(text)
                if status != 200:
                    failed += 1
                    continue
                cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                got[i] = body["choices"][0]["text"]
            tier = server.tier("disk")
            temp_files = len(list(Path(disk).rglob("*.tmp")))
            # Cache-less answers of the prompts that were in flight at the kill.
            http_json(server.url + "/v1/cache/reset", {"lower_tiers": True})
            fresh = {i: _ok(server, texts[i])["text"] for i in range(reference, prompts)}
            same = sum(got.get(i) == answers[i] for i in answers) + sum(
                got.get(i) == t for i, t in fresh.items()
            )
            out.update(
                requests_after_restart=len(texts),
                failed_after_restart=failed,
                same_text=f"{same}/{prompts}",
                cached_tokens_after_restart=cached,
                corrupt_counted=tier["corrupt"],
                temp_files_after_restart=temp_files,
                disk_after_restart=tier,
            )
        finally:
            server.stop()
    return out


def _quietly(server: Server, prompts: list[str]) -> None:
    """Send ``prompts`` one by one until the server dies under them."""
    for prompt in prompts:
        try:
            server.complete(prompt)
        except OSError:
            return


# ---------------------------------------------------------------------------------------------- disk full
def disk_full(log_dir: Path, *, size: str = "2m", prompts: int = 6) -> dict:
    """The disk tier's folder on a tiny tmpfs (root only); falls back to a 1-record byte budget."""
    mount = Path(tempfile.mkdtemp(prefix="kvb-rel-full-"))
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
        ).returncode
        == 0
    )
    flags = (
        ("--disk-cache-dir", str(mount))
        if mounted
        else ("--disk-cache-dir", str(mount), "--disk-cache-bytes", "1000000")
    )
    server = Server(flags=flags, log_dir=log_dir, name="disk-full").start()
    out: dict = {"tmpfs": f"{size} tmpfs" if mounted else None, "flags": list(flags)}
    try:
        failed, answers = 0, []
        for i in range(prompts):
            status, body = server.complete(filler_text(2000 + i, WORDS))
            failed += status != 200
            answers.append(status)
        time.sleep(2)
        server.reset_ram()
        status, body = server.complete(filler_text(2000, WORDS))
        failed += status != 200
        out.update(
            requests=prompts + 1,
            failed=failed,
            cached_tokens_after_ram_reset=body["usage"]["prompt_tokens_details"]["cached_tokens"]
            if status == 200
            else None,
            disk=server.tier("disk"),
            disk_used_bytes=sum(f.stat().st_size for f in mount.rglob("*") if f.is_file()),
            write_failure_warnings=server.log.read_text(errors="replace").count("disk tier write failed"),
            disk_full_warnings=server.log.read_text(errors="replace").count("cannot store records"),
            server_alive=server.alive(),
        )
    finally:
        server.stop()
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(mount)
    return out


# ------------------------------------------------------------------------------- /v1/warm beside requests
def warm_during_requests(log_dir: Path, *, rounds: int = 6, warm_words: int = 500) -> dict:
    """``/v1/warm`` (a long text, several engine steps) sent while short completions run.

    Reproduces a bug found by schemathesis with 2 workers: ``KVBoost.warm`` runs the library loop
    (``_run_to_end``), which steps the shared engine and files the server's requests' outputs in the
    library's mailbox, so a request finishing during a warm is never answered: the worker then finds the
    engine idle with that request in flight and fails it (500 "the engine lost track of requests in
    flight").
    """
    server = Server(flags=("--max-tokens", "4"), log_dir=log_dir, name="warm-race").start()
    statuses: list[int] = []
    try:
        for r in range(rounds):
            result: dict[str, int] = {}

            def complete(result=result, r=r) -> None:
                result["completion"] = server.complete(f"short prompt {r}", max_tokens=2)[0]

            def warm(result=result, r=r) -> None:
                body = {"text": filler_text(3000 + r, warm_words)}
                result["warm"] = http_json(server.url + "/v1/warm", body, timeout=300)[0]

            threads = [threading.Thread(target=complete), threading.Thread(target=warm)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            statuses.append(result["completion"])
        alive = server.alive()
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    return {
        "rounds": rounds,
        "completion_statuses": statuses,
        "completion_5xx": sum(s >= 500 for s in statuses),
        "lost_track_errors_in_log": sum(
            "ERROR" in line and "lost track of requests" in line for line in log.splitlines()
        ),
        "server_alive_after": alive,
    }
