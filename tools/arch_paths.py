"""The engine's other paths on one architecture, for ``tools/arch_matrix.py``: live KV quantization,
speculative decoding, the ``hf_bridge`` and the disk tier after RAM eviction.

Each check returns plain JSON-safe figures; :func:`path_problems` names what is wrong (an exactness check
that failed, or a crash). A path that raises a typed ``KVBoostError`` / ``SpeculativeError`` for an
unsupported combination is recorded as declined with its message, never as a wrong answer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as T

from kvb_cache import EngineConfig, KVBoost, KVBoostError
from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.live_quant import LiveQuantizedCache, quantize_live
from kvb_cache.pool_io import dense_cache
from kvb_cache.tiers import TierConfig
from kvb_speculative import SpeculativeError, make_decoder

#: Exact paths must reproduce no-cache fp32 logits within this (the engine's fidelity contract).
EXACT_ATOL = 2e-5
NEW = 12


def _greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def _teacher_forced(model, ids: list[int], continuation: list[int], cache) -> torch.Tensor:
    """``[len(continuation), V]`` logits over ``cache``: the prompt in one forward, then one token per step."""
    full = torch.tensor([ids + continuation])
    with torch.no_grad():
        rows = [model(full[:, : len(ids)], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]]
        for t in range(len(ids), full.shape[1] - 1):
            rows.append(model(full[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[0, -1])
    return torch.stack(rows)


def _greedy_loop(model, ids: list[int], cache, n: int = NEW) -> list[int]:
    out: list[int] = []
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out.append(
                int(model(tokens, **cache_kwargs(model, cache), use_cache=True).logits[0, -1].argmax())
            )
            tokens = torch.tensor([[out[-1]]])
    return out


def live_quant(model, tokenizer, ids: list[int]) -> dict:
    """Per-request ``kv_cache_bits`` 8/4 (a KIVI-quantized working cache), after a 32-token cached prefix.

    ``engine_equals_loop``: the engine's tokens equal a plain greedy loop over the same quantized cache
    (the wiring is exact); ``max_dev``: max |logit| deviation from the unquantized run over 12 teacher-forced
    steps; ``greedy_agree``: free-running greedy tokens equal to unquantized (of 12; a noise-level figure).
    """
    layers = model.config.get_text_config().num_hidden_layers
    expected = _greedy(model, ids)
    reference = _teacher_forced(model, ids, expected, T.DynamicCache())
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    engine.warm(ids[:32])
    with torch.no_grad():
        prefix = T.DynamicCache()
        model(torch.tensor([ids[:32]]), **cache_kwargs(model, prefix), use_cache=True)
    prefix_kv = [(layer.keys, layer.values) for layer in prefix.layers]
    row: dict = {"logit_scale": float(reference.abs().max())}
    for bits in (8, 4):
        out = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=bits).output_ids
        loop = _greedy_loop(
            model, ids[32:], quantize_live(dense_cache(prefix_kv), num_layers=layers, bits=bits)
        )
        quantized = _teacher_forced(model, ids, expected, LiveQuantizedCache(num_layers=layers, bits=bits))
        row[f"kv{bits}"] = {
            "engine_equals_loop": out == loop,
            "max_dev": float((quantized - reference).abs().max()),
            "greedy_agree": sum(a == b for a, b in zip(out, expected)),
        }
    return row


def speculative(model, draft, tokenizer) -> dict:
    """Greedy through the engine with a prompt-lookup drafter and with ``draft`` (same architecture, other
    weights: mostly rejected) against ``model.generate``; drafted / accepted counts show rollbacks ran."""
    # A repeated phrase, 56 tokens (past 24-token windows), ending with the phrase's start: prompt lookup drafts
    # from the first step whatever a random model generates (a check that drafts nothing checks nothing,
    # and path_problems flags it).
    prompt = [*range(20, 28)] * 5 + [*range(100, 114)] + [20, 21]
    expected = _greedy(model, prompt, 16)
    row: dict = {}
    for label, drafter in (
        ("prompt_lookup", make_decoder(model)),
        ("draft_model", make_decoder(model, draft_model=draft)),
    ):
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
        engine.warm(prompt[:32])
        out = engine.generate(prompt, max_new_tokens=16, ignore_eos=True).output_ids
        stats = drafter.speculative_stats()
        row[label] = {
            "equal": out == expected,
            "drafted": stats.drafted_tokens,
            "accepted": stats.accepted_tokens,
        }
    return row


def hf_bridge(model, tokenizer, ids: list[int]) -> dict:
    """``lookup_cache`` of a 40-token engine prefix into ``model.generate`` (every step's logits and the
    tokens against no cache), and ``store_cache`` of a plain forward's KV hit by the engine."""
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    engine.warm(ids[:40])
    hit = engine.lookup_cache(ids)
    x = torch.tensor([ids])
    kwargs = dict(
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones_like(x),
    )
    with torch.no_grad():
        cached = model.generate(x, **cache_kwargs(model, hit.cache), **kwargs)
        plain = model.generate(x, **kwargs)
    lookup_dev = max(float((a - b).abs().max()) for a, b in zip(cached.logits, plain.logits))
    stored = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    forward = T.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids[:40]]), **cache_kwargs(model, forward), use_cache=True)
    stored.store_cache(ids[:40], forward)
    got = stored.next_token_logits(ids)
    return {
        "lookup_cached": hit.cached_tokens,
        "lookup_generate_equal": torch.equal(cached.sequences, plain.sequences),
        "lookup_max_dev": lookup_dev,
        "store_cached": got.cached_tokens,
        "store_max_dev": float((got.logits - plain.logits[0][0]).abs().max()),
    }


def disk_tier(model, tokenizer, ids: list[int], filler: Callable[[int], list[int]]) -> dict:
    """Store 48 tokens, evict them from a 12-block pool with three other prompts, reload from the disk tier:
    max |logit| deviation from no cache at ``kv_cache_bits`` 16 (exact records) and 8/4 (KIVI records)."""
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    row: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        for bits in (16, 8, 4):
            tiers = TierConfig(disk_cache_dir=Path(folder) / str(bits))
            engine = KVBoost(
                model,
                tokenizer,
                config=EngineConfig(chunk_size=16, num_blocks=12, kv_cache_bits=bits, tiers=tiers),
            )
            engine.warm(ids[:48])
            engine.flush()
            for seed in (5, 6, 7):
                engine.warm(filler(seed))
            disk_hits = engine.tiers.stats()[0].hits
            got = engine.next_token_logits(ids)
            row[f"kv{bits}"] = {
                "cached": got.cached_tokens,
                "from_disk": engine.tiers.stats()[0].hits - disk_hits,
                "max_dev": float((got.logits - reference).abs().max()),
            }
            engine.close()
    return row


def run_paths(model, draft, tokenizer, ids: list[int], filler: Callable[[int], list[int]]) -> dict:
    """Every path's figures; a path that raised is recorded as ``declined`` (typed) or ``error`` (a crash)."""
    checks = {
        "live_quant": lambda: live_quant(model, tokenizer, ids),
        "speculative": lambda: speculative(model, draft, tokenizer),
        "hf_bridge": lambda: hf_bridge(model, tokenizer, ids),
        "disk_tier": lambda: disk_tier(model, tokenizer, ids, filler),
    }
    row: dict = {}
    for name, check in checks.items():
        try:
            row[name] = check()
        except (KVBoostError, SpeculativeError) as exc:
            row[name] = {"declined": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # a crash is a result here: it goes in the table
            row[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return row


def path_problems(row: dict) -> list[str]:
    """What is wrong on the exact paths (empty: all served as promised). Quantized figures are measured,
    not judged, apart from the sanity bound that 8-bit KV is closer than 4-bit."""
    problems = [f"{name}: {r['error']}" for name in _PATHS if "error" in (r := row.get(name, {}))]
    live, spec, bridge, disk = (row.get(name, {}) for name in _PATHS)
    if "kv8" in live and not (live["kv8"]["engine_equals_loop"] and live["kv4"]["engine_equals_loop"]):
        problems.append("live_quant: engine differs from a greedy loop over the quantized cache")
    for label in ("prompt_lookup", "draft_model"):
        if label in spec and not spec[label]["equal"]:
            problems.append(f"speculative ({label}): greedy differs from plain greedy")
        if label in spec and not spec[label]["drafted"]:
            problems.append(f"speculative ({label}): nothing drafted, so nothing was verified")
    if "lookup_max_dev" in bridge and not (
        bridge["lookup_generate_equal"]
        and bridge["lookup_max_dev"] <= EXACT_ATOL
        and bridge["store_max_dev"] <= EXACT_ATOL
    ):
        problems.append("hf_bridge: a prefix hit differs from no cache")
    if "kv16" in disk and not (disk["kv16"]["max_dev"] <= EXACT_ATOL and disk["kv16"]["from_disk"] == 3):
        problems.append("disk_tier: 16-bit records reloaded after eviction differ from no cache")
    if "kv8" in disk and not disk["kv8"]["max_dev"] <= disk["kv4"]["max_dev"]:
        problems.append("disk_tier: 8-bit records further from no cache than 4-bit ones")
    return problems


_PATHS = ("live_quant", "speculative", "hf_bridge", "disk_tier")


def _cell(r: dict, render: Callable[[dict], str]) -> str:
    if "error" in r:
        return f"**error**: {r['error'][:80]}"
    if "declined" in r:
        return f"declined: {r['declined'][:80]}"
    return render(r)


def paths_table(rows: list[dict]) -> str:
    """The second table of docs/architectures.md: one row per served architecture."""
    lines = [
        "| architecture | live KV 8 / 4 bits: max logit dev (greedy agree /12) | speculative: prompt lookup / "
        "draft model (accepted/drafted) | hf_bridge: lookup into generate / store then hit (max diff) | "
        "disk tier after eviction 16 / 8 / 4 bits: max logit dev |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if "paths" not in row:
            continue
        p = row["paths"]
        live = _cell(
            p["live_quant"],
            lambda r: (
                " / ".join(
                    f"{r[k]['max_dev']:.1e} ({r[k]['greedy_agree']})"
                    + ("" if r[k]["engine_equals_loop"] else " WRONG")
                    for k in ("kv8", "kv4")
                )
                + f" (scale {r['logit_scale']:.1f})"
            ),
        )
        spec = _cell(
            p["speculative"],
            lambda r: " / ".join(
                f"{'=' if r[k]['equal'] else 'DIFF'} ({r[k]['accepted']}/{r[k]['drafted']})"
                for k in ("prompt_lookup", "draft_model")
            ),
        )
        bridge = _cell(
            p["hf_bridge"],
            lambda r: (
                f"{'=' if r['lookup_generate_equal'] else 'DIFF'} {r['lookup_max_dev']:.1e} / "
                f"{r['store_max_dev']:.1e}"
            ),
        )
        disk = _cell(
            p["disk_tier"], lambda r: " / ".join(f"{r[k]['max_dev']:.1e}" for k in ("kv16", "kv8", "kv4"))
        )
        lines.append(f"| {row['arch']} | {live} | {spec} | {bridge} | {disk} |")
    return "\n".join(lines)
