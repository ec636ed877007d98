"""Engine lifecycle: idempotent close, the bounded flush at interpreter exit, and reset_cache."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
from conftest import make_model

from kvb_cache import CacheBusyError, CPUPagedEngine, EngineConfig, InvalidRequestError, KVBoost, StitchConfig
from kvb_cache.tiers import TierConfig

PROMPT = list(range(5, 75))  # 70 tokens: 4 full blocks of 16


def engine(model, tok, **config) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, **config))


def run(eng: KVBoost, prompt=PROMPT):
    return eng.generate(prompt, max_new_tokens=4, ignore_eos=True)


# ---------------------------------------------------------------------------------------- close


def test_close_is_idempotent_and_the_engine_serves_from_ram_afterwards(llama, tokenizer, tmp_path):
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path))
    run(eng)
    assert eng.close() is True
    disk = eng.tiers.lower[0].tier
    stored = disk.stats().stores
    assert stored >= 4 and eng.close() is True
    assert run(eng).cached_tokens == len(PROMPT) - 1
    run(eng, list(range(100, 170)))  # new blocks: nothing reaches the closed tier
    assert eng.flush() is True and disk.stats().stores == stored


@pytest.mark.parametrize("bad", ["5", -1, float("nan"), True, [1]])
def test_a_bad_timeout_is_refused_before_close_switches_anything(llama, tokenizer, tmp_path, bad):
    """close(timeout_s="5") failed after marking the engine closed, detaching its tiers and dropping the exit
    hook: queued writes were never drained and the tiers never closed (a second close() returned True)."""
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path))
    run(eng)
    for call in (eng.flush, eng.close):
        with pytest.raises(InvalidRequestError) as info:
            call(timeout_s=bad)
        assert info.value.param == "timeout_s"
    assert eng.kv.tiers is not None  # still open: the real close drains and closes them
    assert eng.close(timeout_s=float("inf")) is True and eng.kv.tiers is None
    assert eng.tiers.lower[0].tier.stats().stores >= 4


def test_every_engine_class_closes_as_a_context_manager(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    with CPUPagedEngine.from_pretrained(
        llama, tokenizer=tokenizer, num_blocks=64, chunk_size=16, tiers=tiers
    ) as paged:
        run(paged)
    with engine(llama, tokenizer, tiers=tiers) as plain:
        assert run(plain).cached_tokens == 64  # the first engine's writes were drained by its exit
    assert paged._closed and plain._closed


def test_the_exit_hook_does_not_keep_an_engine_alive(llama, tokenizer, tmp_path):
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path))
    assert eng._exit_hook is not None
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("stitching", [None, StitchConfig()])
def test_del_frees_an_engine_without_the_cyclic_collector(llama, tokenizer, stitching):
    """No reference cycle holds an engine that has served requests: ``del`` frees it (and its block pool) at
    once, not when the cyclic garbage collector next runs."""
    eng = engine(llama, tokenizer, stitching=stitching)
    eng.generate("the quick brown fox " * 8, max_new_tokens=2)
    list(eng.stream("the quick brown fox", max_new_tokens=2))
    eng.next_token_logits("a lazy dog " * 6)
    ref = weakref.ref(eng)
    gc.collect()
    gc.disable()
    try:
        del eng
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kv_cache_bits", [16, 8])  # the block tiers' writer; the TieredStore's as well
def test_an_engine_dropped_without_close_leaves_no_writer_thread(llama, tokenizer, tmp_path, kv_cache_bits):
    # Each dropped engine left its kvb-tier-writer thread blocked on an empty queue for the life of the
    # process (30 engines in a notebook loop: 30 threads), its tiers never closed.
    before = set(threading.enumerate())
    for i in range(3):
        eng = engine(
            llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / str(i)), kv_cache_bits=kv_cache_bits
        )
        run(eng)
        del eng
        gc.collect()
    left = [t for t in threading.enumerate() if t not in before]
    for thread in left:
        thread.join(10)
    assert [t.name for t in left if t.is_alive()] == []
    # What they had queued was written before they ended: a new engine on the same folder hits it.
    again = engine(
        llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / "2"), kv_cache_bits=kv_cache_bits
    )
    assert run(again).cached_tokens == 64
    again.close()


def test_engines_without_tiers_register_no_exit_hook(llama, tokenizer):
    assert engine(llama, tokenizer)._exit_hook is None


def test_bad_exit_flush_timeout_is_refused():
    with pytest.raises(ValueError, match="exit_flush_timeout_s"):
        TierConfig(disk_cache_dir="x", exit_flush_timeout_s=0)
    with pytest.raises(ValueError, match="finite"):  # the flush's join raised OverflowError at exit
        TierConfig(disk_cache_dir="x", exit_flush_timeout_s=float("inf"))


# A "process A" that generates and exits without close(); its disk is slow (sleep per record), so writes
# are still queued at exit: only the exit hook can save them.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from conftest import make_model, make_tokenizer
    from kvb_cache import EngineConfig, KVBoost
    from kvb_cache.tiers import TierConfig, DiskTier

    folder, delay, timeout = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    put = DiskTier.put
    DiskTier.put = lambda self, key, record: (time.sleep(delay), put(self, key, record))[1]
    prompt = list(range(3, 243))  # 240 tokens: 15 full blocks of 16
    tiers = TierConfig(disk_cache_dir=folder, exit_flush_timeout_s=timeout)
    engine = KVBoost(make_model("llama"), make_tokenizer(), config=EngineConfig(chunk_size=16, tiers=tiers))
    result = engine.generate(prompt, max_new_tokens=4, ignore_eos=True)
    print(json.dumps({"cached": result.cached_tokens, "exit_at": time.monotonic()}), flush=True)
    """
)


def _child(folder: Path, *, delay: float, timeout: float) -> tuple[dict, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(__file__).parent), str(folder), str(delay), str(timeout)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    end = time.monotonic()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report, end - report["exit_at"]


def _fresh(tokenizer, folder: Path) -> KVBoost:
    """Process B: the child's model (same seed; a fresh one, as its fingerprint sees it) on the same folder."""
    return engine(make_model("llama"), tokenizer, tiers=TierConfig(disk_cache_dir=folder))


def test_writes_queued_at_exit_are_flushed_without_close(tokenizer, tmp_path):
    report, _ = _child(tmp_path, delay=0.05, timeout=30)
    assert report["cached"] == 0
    fresh = _fresh(tokenizer, tmp_path)
    prompt = list(range(3, 243))
    got = fresh.generate(prompt, max_new_tokens=1).cached_tokens
    assert got >= 0.9 * len(prompt)


def test_the_exit_flush_is_bounded_by_its_timeout(tokenizer, tmp_path):
    # 15+ records at 4 s each: an unbounded flush would linger a minute. The margin is wide on purpose (the
    # interpreter's own teardown is slow on a loaded CI machine); what is tested is "bounded", not a speed.
    _, lingered = _child(tmp_path, delay=4.0, timeout=0.5)
    assert lingered < 30.0
    fresh = _fresh(tokenizer, tmp_path)
    assert fresh.generate(list(range(3, 243)), max_new_tokens=1).cached_tokens < 240 // 2


# ---------------------------------------------------------------------------------------- reset


def test_reset_cache_drops_ram_and_keeps_lower_tiers_unless_asked(llama, tokenizer, tmp_path):
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path))
    run(eng)
    eng.flush()  # the disk records are written behind: wait for them, or the lookup below races the writer
    dropped = eng.reset_cache()
    assert dropped["blocks_dropped"] >= 4
    assert dropped["chunks_dropped"] == 0 and dropped["lower_tier_records_dropped"] == 0
    assert eng.paged_stats().blocks_cached == 0
    assert run(eng).cached_tokens == 64  # promoted back from disk (full blocks only)
    eng.flush()
    records = eng.tiers.lower[0].tier.stats().entries
    dropped = eng.reset_cache(lower_tiers=True)
    assert dropped["lower_tier_records_dropped"] == records >= 4
    assert eng.tiers.lower[0].tier.stats().entries == 0
    assert run(eng).cached_tokens == 0


def test_reset_cache_without_tiers(llama, tokenizer):
    eng = engine(llama, tokenizer)
    run(eng)
    assert eng.reset_cache(lower_tiers=True)["lower_tier_records_dropped"] == 0
    assert run(eng).cached_tokens == 0


def test_reset_cache_lower_tiers_must_be_a_bool(llama, tokenizer, tmp_path):
    # "no" is truthy: it wiped the disk records of every process sharing the folder.
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path))
    run(eng)
    eng.flush()
    records = eng.tiers.lower[0].tier.stats().entries
    for bad in ("no", 1, None):
        with pytest.raises(InvalidRequestError, match="lower_tiers must be True or False"):
            eng.reset_cache(lower_tiers=bad)
    assert eng.tiers.lower[0].tier.stats().entries == records >= 4


def test_reset_cache_clears_the_stitching_store(llama, tokenizer):
    eng = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, stitching=StitchConfig(recompute_strategy="selective")),
    )
    run(eng)
    assert len(eng.store) > 0
    dropped = eng.reset_cache()
    assert dropped["chunks_dropped"] >= 4 and len(eng.store) == 0


def test_reset_cache_refuses_while_requests_hold_blocks(llama, tokenizer):
    eng = engine(llama, tokenizer)
    run(eng)
    rid = eng.add_request(PROMPT)
    eng.step()
    with pytest.raises(CacheBusyError, match="running") as err:
        eng.reset_cache()
    assert err.value.running == 1
    assert eng.paged_stats().blocks_cached + eng.paged_stats().blocks_used > 0  # nothing was dropped
    eng.abort(rid)
    assert eng.reset_cache()["blocks_dropped"] > 0
