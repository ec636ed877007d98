"""Per-request ``kv_cache_bits`` on the embedded SmolLM2-135M-Instruct (fp32, CPU): memory, fidelity, time.

For each setting (16 = the exact path, 8, 4) one request of ``--prompt-tokens`` tokens of real text
(CPython's ``pydoc_data.topics``) plus ``--new-tokens`` greedy tokens runs through ``KVBoost.generate``
with an empty chunk store (nothing reused). Reported per setting:

- ``live_kv_mib``: bytes the request's working cache holds at the end (codes + scales + residual window);
- ``tensor_peak_mib``: peak of live CPU tensor bytes during the request (torch.profiler memory events,
  on top of what existed before), the quantity kvb-planner's memory model predicts;
- ``predicted_mib``: kvb-planner's prediction for the same request and ``kv_bits`` (single-shot prefill);
- ``agreement``: greedy tokens equal to the no-cache Hugging Face ``generate`` (same run);
- ``ms``: median wall time over ``--repeats`` runs (1 torch thread; noisy on a shared machine).

Also prints the 413 body the planner gate would send for a prompt that does not fit a small budget.
Run: ``python tools/bench_live_kv.py`` (writes docs/planner_server_bench.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvb_planner import tensor_peak

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def prompt_ids(tokenizer, length: int) -> list[int]:
    from pydoc_data.topics import topics

    parts: list[str] = []
    for key in sorted(topics):
        parts.append(topics[key])
        if sum(map(len, parts)) > 6 * length:
            break
    ids = tokenizer("\n\n".join(parts))["input_ids"][:length]
    if len(ids) < length:
        raise SystemExit(f"only {len(ids)} tokens of text available")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "planner_server_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvb_cache import EngineConfig, KVBoost
    from kvb_cache.cache_kwarg import cache_kwargs
    from kvb_cache.embedded import embedded_model_path
    from kvb_cache.live_quant import cache_kv_bytes
    from kvb_planner import DeviceProfile, LadderStep, ModelShape, PlanRequest, estimate_memory, plan

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    shape = ModelShape.from_config(model.config, dtype=torch.float32)
    request = PlanRequest(prompt_tokens=len(ids), max_new_tokens=args.new_tokens)

    rows = []
    for bits in (16, 8, 4):
        engine = KVBoost(model, tokenizer, config=EngineConfig(max_cache_bytes=0))  # nothing stored or reused
        caches: list = []
        original = engine.store_sequence

        def spy(seq, cache, _original=original, _caches=caches, **kw):
            _caches.append(cache)
            return _original(seq, cache, **kw)

        engine.store_sequence = spy  # type: ignore[method-assign]

        def run(bits=bits, engine=engine):
            return engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True, kv_cache_bits=bits)

        times, out = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = run()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = tensor_peak(run)
        if not caches:
            # NOTE: 16 bits runs in the engine loop's paged pool (no per-request cache to spy on, so
            # store_sequence is never called): its live KV is the dense KV of the tokens it held.
            dense = DynamicCache()
            with torch.no_grad():
                model(input_ids=torch.tensor([ids + list(out.output_ids[:-1])]), **cache_kwargs(model, dense))
            caches.append(dense)
        predicted = estimate_memory(
            request, LadderStep(prefill_chunk_size=None, kv_bits=bits), shape, device="cpu"
        ).peak_bytes
        agree = sum(a == b for a, b in zip(out.output_ids, ref))
        rows.append(
            {
                "kv_bits": bits,
                "live_kv_mib": round(cache_kv_bytes(caches[-1]) / MIB, 2),
                "tensor_peak_mib": round(peak / MIB, 2),
                "predicted_mib": round(predicted / MIB, 2),
                "agreement": f"{agree}/{len(ref)}",
                "first_divergence": next(
                    (i for i, (a, b) in enumerate(zip(out.output_ids, ref)) if a != b), None
                ),
                "ms": round(statistics.median(times), 1),
            }
        )
        print(rows[-1], flush=True)

    # What the gate answers for a 8x longer prompt when only 64 MiB are free (numbers from the same model).
    profile = DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=64 * MIB)
    refusal = plan(
        PlanRequest(prompt_tokens=8 * len(ids), max_new_tokens=args.new_tokens), profile, shape
    ).refusal
    result = {
        "model": "SmolLM2-135M-Instruct fp32",
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "machine": f"{platform.machine()} {platform.system()}, 1 torch thread, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        "rows": rows,
        "example_413": refusal.to_dict() if refusal else None,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| kv bits | live KV MiB | tensor peak MiB | predicted MiB | greedy = no-cache | ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kv_bits']} | {r['live_kv_mib']} | {r['tensor_peak_mib']} | {r['predicted_mib']} | "
            f"{r['agreement']} | {r['ms']} |"
        )
    print(json.dumps(result["example_413"], indent=1))


if __name__ == "__main__":
    main()
