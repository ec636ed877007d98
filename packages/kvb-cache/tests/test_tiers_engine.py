"""The engine with quantized KV and a disk tier: restarts hit, corruption recomputes, fidelity measured."""

from __future__ import annotations

import pytest
import torch
from conftest import PATH_ARCHITECTURES, make_model, words

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.hashing import prefix_hash
from kvb_cache.tiers import TierConfig

PROMPTS = [list(range(s, s + 70)) for s in (3, 40, 90, 150, 200)]


def engine(model, tok, **config) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, **config))


def test_default_engine_has_no_tiers_and_codec_in_fingerprint(llama, tokenizer, tmp_path):
    plain = engine(llama, tokenizer)
    assert plain.tiers is None
    tiers = TierConfig(disk_cache_dir=tmp_path)
    assert engine(llama, tokenizer, kv_cache_bits=8, tiers=tiers).fingerprint != plain.fingerprint
    assert (
        engine(llama, tokenizer, kv_cache_bits=4, tiers=tiers).fingerprint
        != engine(llama, tokenizer, kv_cache_bits=8, tiers=tiers).fingerprint
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # Quantizing records with no tier to hold them did nothing (the pool keeps KV as computed).
        ({"kv_cache_bits": 8}, "quantizes disk/Redis records only"),
        ({"kv_group_size": 64}, "no effect with kv_cache_bits=16"),
        # 8.0 == 8 passed, then every tier write failed on a float shift count.
        ({"kv_cache_bits": 8.0, "tiers": "disk"}, "kv_cache_bits must be 16"),
        # 4-bit codes pack two per byte inside a group: an odd group failed or corrupted every write.
        ({"kv_cache_bits": 4, "kv_group_size": 5, "tiers": "disk"}, "must be even"),
        # Reuse off stores nothing: the tier was accepted and never written (found by an audit).
        ({"max_cache_bytes": 0, "tiers": "disk"}, "max_cache_bytes=0 turns reuse off"),
    ],
)
def test_engine_config_refuses_quantization_settings_that_cannot_work(options, match, tmp_path):
    from kvb_cache.errors import ConfigError

    if options.get("tiers") == "disk":
        options = {**options, "tiers": TierConfig(disk_cache_dir=tmp_path)}
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_tier_config_names_an_unknown_codec_at_once():
    from kvb_cache.errors import ConfigError

    for name in ("fp8", "kivi8-g1", "kivi4-g3"):
        with pytest.raises(ConfigError):
            TierConfig(remote_url="redis://127.0.0.1:6379/0", remote_codec=name)


def test_restart_with_disk_tier_gets_exact_hits_and_identical_output(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    a = first.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True)
    first.close()
    second = engine(llama, tokenizer, tiers=tiers)  # a new "process": empty RAM, same folder
    assert second.tiers is not None and second.paged_stats().blocks_cached == 0
    b = second.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True)
    assert a.cached_tokens == 0 and b.cached_tokens == 64
    assert b.output_ids == a.output_ids
    ref = llama(torch.tensor([PROMPTS[0]])).logits[0, -1]
    got = second.next_token_logits(PROMPTS[0]).logits
    assert torch.allclose(got, ref, atol=1e-5)


def test_a_prompt_the_tiers_never_saw_costs_one_probe_per_tier(llama, tokenizer, tmp_path):
    """The run of tier hits ends at the first miss: every block of a new prompt was looked up (a failed
    open per block on the disk tier); a cached chain is still fetched whole."""
    eng = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path), block_size=4)
    tier = eng.tiers.lower[0].tier
    probed: list[int] = []
    get_many = tier.get_many
    tier.get_many = lambda keys: probed.append(len(keys)) or get_many(keys)
    eng.generate(PROMPTS[1], max_new_tokens=2, ignore_eos=True)  # 70 tokens: 17 full blocks, none stored
    assert probed == [1]
    eng.flush()
    eng.clear_cache()  # RAM emptied: the chain comes back from the disk
    probed.clear()
    again = eng.generate(PROMPTS[1], max_new_tokens=2, ignore_eos=True)
    assert probed == [1, 16] and again.cached_tokens == 68


def test_corrupted_disk_record_is_recomputed_with_unchanged_output(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    a = first.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    first.close()
    key0 = prefix_hash(first.root, PROMPTS[1][:16])
    victim = first.tiers.lower[0].tier._path(prefix_hash(key0, PROMPTS[1][16:32]))  # the 2nd chunk
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    second = engine(llama, tokenizer, tiers=tiers)
    b = second.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    second.flush()
    disk = second.tiers.lower[0].tier
    assert disk.stats().corrupt == 1
    assert b.output_ids == a.output_ids
    assert b.cached_tokens == 16  # the chain was used only up to the bad record


def test_a_chain_of_corrupt_disk_records_heals_in_one_request(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    a = first.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    first.close()
    files = sorted(first.tiers.lower[0].tier.directory.rglob("*.kvb"))
    assert len(files) == 4  # 70 prompt tokens: four full blocks of 16
    for path in files:
        path.write_bytes(b"not a record")
    second = engine(llama, tokenizer, tiers=tiers)
    b = second.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    second.close()
    assert b.cached_tokens == 0 and b.output_ids == a.output_ids
    third = engine(llama, tokenizer, tiers=tiers)
    c = third.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    assert c.cached_tokens == 64 and c.output_ids == a.output_ids  # it took one cached block per request


def _drop_layer(tensors, meta):
    meta["num_layers"] = "1"


def _widen_heads(tensors, meta):
    tensors["0.k"] = torch.cat([tensors["0.k"], tensors["0.k"]], dim=1)


def _narrow_values(tensors, meta):
    tensors["0.v"] = tensors["0.v"][..., :8].contiguous()


def _nan_keys(tensors, meta):
    tensors["1.k"] = torch.full_like(tensors["1.k"], float("nan"))


@pytest.mark.parametrize(
    "mutate",
    [lambda t, m: m.update(num_layers="x"), _drop_layer, _widen_heads, _narrow_values, _nan_keys],
    ids=["layers-not-int", "fewer-layers", "more-heads", "narrower-values", "nan-keys"],
)
def test_record_written_by_someone_else_is_a_miss_not_a_crash(llama, tokenizer, tmp_path, mutate):
    # A well-checksummed record whose KV does not fit the model's blocks (another program sharing the tier)
    # crashed the request inside torch (shape mismatch) or, with fewer layers, silently left the other
    # layers' blocks stale (a different answer). It is dropped as corrupt and recomputed.
    from test_records import _forge

    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    a = first.generate(PROMPTS[2], max_new_tokens=6, ignore_eos=True)
    first.close()
    key0 = prefix_hash(first.root, PROMPTS[2][:16])
    victim = first.tiers.lower[0].tier._path(prefix_hash(key0, PROMPTS[2][16:32]))  # the 2nd block
    victim.write_bytes(_forge(victim.read_bytes(), mutate))
    second = engine(llama, tokenizer, tiers=tiers)
    b = second.generate(PROMPTS[2], max_new_tokens=6, ignore_eos=True)
    second.flush()
    assert b.output_ids == a.output_ids
    assert b.cached_tokens == 16  # the chain was used up to the forged record
    assert second.tiers.lower[0].tier.stats().corrupt == 1


def test_quantized_reuse_agreement_with_uncompressed(llama, tokenizer, tmp_path):
    """First-token top-1 agreement and logit error of int8/int4 prefixes read back from a quantized disk tier
    (the pool holds KV as computed; ``kv_cache_bits`` is the precision of the records below it)."""
    results = {}
    for bits in (8, 4):
        tiers = TierConfig(disk_cache_dir=tmp_path / str(bits))
        writer = engine(llama, tokenizer, kv_cache_bits=bits, tiers=tiers)
        for prompt in PROMPTS:
            writer.warm(prompt[:64])
        writer.close()
        eng = engine(llama, tokenizer, kv_cache_bits=bits, tiers=tiers)
        agree, worst = 0, 0.0
        for prompt in PROMPTS:
            got = eng.next_token_logits(prompt)
            assert got.cached_tokens == 64
            ref = llama(torch.tensor([prompt])).logits[0, -1]
            agree += int(got.logits.argmax() == ref.argmax())
            worst = max(worst, (got.logits - ref).abs().max().item())
        results[bits] = (agree / len(PROMPTS), worst)
    assert (
        results[8][0] == 1.0 and results[8][1] < 0.15
    )  # measured 0.084 (logits of this random model span ~10)
    assert results[4][0] >= 0.6 and results[8][1] < results[4][1]


@pytest.mark.parametrize("arch", PATH_ARCHITECTURES)
def test_blocks_evicted_from_ram_come_back_from_disk_exactly(arch, tokenizer, tmp_path):
    """Store, evict from RAM (a 12-block pool), reload from the disk tier: the same logits as no cache on
    every structurally different architecture; quantized records (``kv_cache_bits`` 8/4) come back close.

    Measured (tools/arch_matrix.py): 16 bits within 4e-6; 8 bits 1e-4 to 0.35, 4 bits 3e-3 to 2.7 (MoE).
    """
    model = make_model(arch)
    ids = tokenizer(words(60, seed=1))["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    deviation = {}
    for bits in (16, 8, 4):
        tiers = TierConfig(disk_cache_dir=tmp_path / str(bits))
        eng = engine(model, tokenizer, num_blocks=12, kv_cache_bits=bits, tiers=tiers)
        eng.warm(ids[:48])
        eng.flush()  # the write-behind queue has reached the disk
        for seed in (5, 6, 7):
            eng.warm(tokenizer(words(80, seed=seed))["input_ids"])  # 15 blocks: the first prompt's go
        hits_before = eng.tiers.stats()[0].hits
        got = eng.next_token_logits(ids)
        assert got.cached_tokens == 48
        assert eng.tiers.stats()[0].hits - hits_before == 3  # all three blocks came back from disk
        deviation[bits] = float((got.logits - ref).abs().max())
        eng.close()
    assert deviation[16] <= 1e-5, deviation
    assert 0 < deviation[8] < deviation[4] < float(ref.abs().max()), deviation


def test_tiered_store_passed_as_store_checks_promoted_records_against_the_model(llama, tokenizer, tmp_path):
    # build_store knows no model: the engine given its TieredStore hands it the model's KV layout, so a
    # record of another layout in its disk tier is a counted miss instead of KV served to the stitcher.
    from kvb_cache.fingerprint import model_fingerprint
    from kvb_cache.hashing import content_hash, root_hash
    from kvb_cache.records import encode_record
    from kvb_cache.store import ChunkEntry
    from kvb_cache.tiers import TieredStore, build_store

    config = EngineConfig(chunk_size=16)
    fingerprint = model_fingerprint(llama, config)
    store = build_store(
        EngineConfig(chunk_size=16, tiers=TierConfig(disk_cache_dir=tmp_path)),
        fingerprint=fingerprint,
        root=root_hash(fingerprint),
    )
    assert isinstance(store, TieredStore) and store.shapes is None
    eng = KVBoost(llama, tokenizer, config=config, store=store)
    assert store.shapes == eng.kv.storage.shapes and len(store.shapes) == llama.config.num_hidden_layers

    def chunk(ids, heads):
        kv = tuple(
            (torch.randn(1, heads, len(ids), s.key_dim), torch.randn(1, heads, len(ids), s.value_dim))
            for s in store.shapes
        )
        key = prefix_hash(eng.root, ids)
        return ChunkEntry(
            key=key,
            parent=eng.root,
            content=content_hash(eng.root, ids),
            token_ids=tuple(ids),
            kv=kv,
            start=0,
        )

    heads = store.shapes[0].kv_heads
    good, bad = chunk(PROMPTS[3][:16], heads), chunk(PROMPTS[4][:16], 2 * heads)
    disk = store.lower[0]
    for e in (good, bad):
        disk.tier.put(e.key, encode_record(e, disk.format))
    assert store.get(bad.key) is None
    store.flush()
    assert disk.tier.stats().corrupt == 1 and not disk.tier.contains(bad.key)
    assert store.get(good.key) is not None
    eng.close()


def test_tiered_store_built_for_another_kv_layout_is_refused(llama, tokenizer, tmp_path):
    # Its shapes= would make it drop every record it promotes for this model: a ConfigError naming the fix.
    from dataclasses import replace

    from kvb_cache.core.kv_storage import probe_layer_shapes
    from kvb_cache.errors import ConfigError
    from kvb_cache.fingerprint import model_fingerprint
    from kvb_cache.hashing import root_hash
    from kvb_cache.tiers import build_store

    config = EngineConfig(chunk_size=16)
    fingerprint = model_fingerprint(llama, config)
    tiers = EngineConfig(chunk_size=16, tiers=TierConfig(disk_cache_dir=tmp_path))
    own = probe_layer_shapes(llama)
    other = tuple(replace(shape, kv_heads=2 * shape.kv_heads) for shape in own)
    store = build_store(tiers, fingerprint=fingerprint, root=root_hash(fingerprint), shapes=other)
    with pytest.raises(ConfigError, match="shapes=None"):
        KVBoost(llama, tokenizer, config=config, store=store)
    store.close()
    matching = build_store(tiers, fingerprint=fingerprint, root=root_hash(fingerprint), shapes=own)
    KVBoost(llama, tokenizer, config=config, store=matching).close()


def test_records_that_cannot_be_stored_are_counted_and_logged_once(
    llama, tokenizer, tmp_path, caplog, monkeypatch
):
    """A write-behind failing on every block (an encode error) used to log a traceback per block and leave
    the tier's stats at ``stores=0 errors=0``."""
    import kvb_cache.core.block_tiers as block_tiers

    def refuse(entry, fmt):
        raise ValueError("cannot encode this block")

    eng = engine(llama, tokenizer, kv_cache_bits=8, tiers=TierConfig(disk_cache_dir=tmp_path))
    monkeypatch.setattr(block_tiers, "encode_record", refuse)
    with caplog.at_level("WARNING", logger="kvb_cache.core.block_tiers"):
        eng.generate(PROMPTS[1], max_new_tokens=2, ignore_eos=True)
        eng.flush()
    disk = eng.tiers.stats()[0]
    assert disk.stores == 0 and disk.errors == 4  # 4 full 16-token blocks of a 70-token prompt
    logged = [r for r in caplog.records if "could not be stored" in r.getMessage()]
    assert len(logged) == 1 and "ValueError" in logged[0].getMessage()
    eng.close()


def test_engines_chunking_differently_share_the_block_records(llama, tokenizer, tmp_path):
    """Records are 16-token blocks keyed by their own prefix hash: an engine with stitching (other chunks)
    restores what a plain engine stored (chunk_size was in the namespace, so they shared nothing)."""
    from kvb_cache import StitchConfig

    tiers = TierConfig(disk_cache_dir=tmp_path)
    writer = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=128, tiers=tiers))
    expected = writer.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    writer.close()
    reader_config = EngineConfig(chunk_size=32, stitching=StitchConfig(), tiers=tiers)
    reader = KVBoost(llama, tokenizer, config=reader_config)
    assert reader.fingerprint == writer.fingerprint
    got = reader.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    assert got.cached_tokens == 64 and got.output_ids == expected.output_ids
    reader.close()


def test_a_prefix_hit_in_ram_keeps_its_disk_records_from_being_evicted_first(
    llama, tokenizer, tmp_path, monkeypatch
):
    # A shared system prompt is written to disk once and hit in RAM from then on; RAM hits never reached
    # the tier, so its records kept their first write's age and were evicted first, and every record after
    # them in a chain became unreachable: a new process asking for the system prompt and the newest
    # question reused nothing although the question's blocks were all on disk.
    from kvb_cache.core import block_tiers

    monkeypatch.setattr(block_tiers, "TOUCH_INTERVAL_S", 0.0)  # every hit bumps (the test runs in a second)
    system = list(range(5, 53))  # 3 full blocks
    prompts = [system + list(range(60 + 40 * i, 100 + 40 * i)) for i in range(6)]  # + 2 full blocks each
    probe = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / "probe"))
    probe.generate(prompts[0], max_new_tokens=1)
    probe.flush()
    (disk,) = probe.tiers.stats()
    record_bytes = disk.bytes // disk.entries
    probe.close()
    tiers = TierConfig(disk_cache_dir=tmp_path / "disk", disk_cache_bytes=8 * record_bytes)
    first = engine(llama, tokenizer, tiers=tiers)
    for prompt in prompts:
        first.generate(prompt, max_new_tokens=1)
    first.close()
    assert first.tiers.stats()[0].evictions > 0
    fresh = engine(llama, tokenizer, tiers=tiers)
    assert fresh.generate(prompts[-1], max_new_tokens=1).cached_tokens == 80  # before: 0


def _record_bytes(llama, tokenizer, tmp_path) -> int:
    """The size of one block's record of the tiny Llama (all blocks of a dense codec have this size)."""
    probe = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / "probe"))
    probe.generate(PROMPTS[0], max_new_tokens=1)
    probe.flush()
    (disk,) = probe.tiers.stats()
    probe.close()
    return disk.bytes // disk.entries


def test_a_disk_budget_below_one_record_is_a_config_error(llama, tokenizer, tmp_path):
    """Such a budget stored nothing, in silence (stores=0, errors=0), and the process refused the records
    other processes had written into the shared folder as larger than its budget, deleting them."""
    import re

    from kvb_cache.errors import ConfigError

    size = _record_bytes(llama, tokenizer, tmp_path)
    with pytest.raises(ConfigError, match=r"cannot hold one KV record of this model \(\d+ bytes") as err:
        engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / "d", disk_cache_bytes=size - 1))
    needed = int(re.search(r"\((\d+) bytes", str(err.value)).group(1))
    # a block deep in a long context writes its position in more digits: the estimate is that record's size
    assert size <= needed <= size + 64
    fits = engine(llama, tokenizer, tiers=TierConfig(disk_cache_dir=tmp_path / "d", disk_cache_bytes=needed))
    fits.generate(PROMPTS[1], max_new_tokens=1)
    fits.close()
    assert fits.tiers.stats()[0].entries == 1


def test_a_block_a_tier_failed_to_take_is_written_again_on_a_ram_hit(llama, tokenizer, tmp_path, monkeypatch):
    """A block whose write was skipped (the disk paused while full, a full write queue, Redis down) was never
    written later: RAM hits only bumped records the tier held, so a restart reused nothing of the prompt."""
    import time

    from kvb_cache.core import block_tiers

    monkeypatch.setattr(block_tiers, "TOUCH_INTERVAL_S", 0.0)  # a failed block is due again at once
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    disk = first.tiers.lower[0].tier
    encoded = []
    encode = block_tiers.encode_record
    monkeypatch.setattr(block_tiers, "encode_record", lambda *a: encoded.append(1) or encode(*a))
    disk._full_until = time.monotonic() + 3600  # stores paused, as after the file system filled up
    expected = first.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    first.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)  # a RAM hit while still paused
    first.flush()
    assert (disk.stats().stores, disk.stats().dropped) == (0, 4)
    assert not encoded  # a paused tier costs no encoding, and its misses wait for it to take writes
    disk._full_until = 0.0  # the disk has room again
    assert first.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True).cached_tokens >= 64  # a RAM hit
    first.close()
    assert disk.stats().stores == 4
    fresh = engine(llama, tokenizer, tiers=tiers)
    got = fresh.generate(PROMPTS[2], max_new_tokens=4, ignore_eos=True)
    assert got.cached_tokens == 64 and got.output_ids == expected.output_ids  # before: 0


def test_a_finished_request_leaves_its_chain_to_be_evicted_from_its_end(llama, tokenizer, tmp_path):
    """Blocks are written head first, so a chain's head was its oldest record and the first evicted: the
    blocks after it stayed on disk, unreachable (a lookup stops at the first missing block), and a restart
    reused nothing of a prompt whose last three quarters were on disk. What is left of a chain now is a
    prefix of it: every record on disk can be reached."""
    size = _record_bytes(llama, tokenizer, tmp_path)
    prompts = [list(range(s, s + 66)) for s in (1, 70, 140, 210)]  # 4 full blocks each, nothing shared
    tiers = TierConfig(disk_cache_dir=tmp_path / "disk", disk_cache_bytes=6 * size)
    e = engine(llama, tokenizer, tiers=tiers)
    for prompt in prompts:
        e.generate(prompt, max_new_tokens=1)
    e.close()
    disk = e.tiers.lower[0].tier
    present = []
    for prompt in prompts:
        key, held = e.root, []
        for i in range(4):
            key = prefix_hash(key, prompt[16 * i : 16 * (i + 1)])
            held.append(disk._path(key).exists())
        present.append(held)
    assert sum(map(sum, present)) == 6 and any(0 < sum(held) < 4 for held in present)
    for held in present:  # before: [[F, F, T, T], [F, F, F, F], [T, T, T, T], ...] (the heads went first)
        assert held == sorted(held, reverse=True), present
