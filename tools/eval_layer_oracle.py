"""Which layers' stitched-KV error decides the teacher-forced gap: exact KV substituted layer by layer.

For some of ``tools/eval_fidelity.py``'s prompts (same documents, warm-ups and test order), the default
``StitchConfig()`` with idle time after each warm-up (``--idle`` there) prepares the test prompt's KV
(stitched, averaged, seam-repaired). Then, per set of layers, those layers' KV is replaced by a plain
prefill's (no-cache) KV and the rest kept stitched, and the suffix plus the no-cache 32-token continuation
run over it (teacher forcing, as ``kvb_cache.fidelity.teacher_forced_logits`` does): top-1 agreement and mean
KL against no-cache. An oracle, not a strategy: it asks where a repair would have to be exact.

Making layers ``0..L`` exact is something a repair can buy cheaply (every stitched row through those layers
only, CacheBlend's check pass kept: ``(L + 1) / num_layers`` of a prefill of those rows); making upper layers
exact is not (a row's upper layers need its lower ones).

    python tools/eval_layer_oracle.py --pydoc 1 5 8 9 --humaneval 0 5
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fidelity as ef

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.cache_kwarg import cache_kwargs, output_cache
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits

NEW_TOKENS = 32


def layer_sets(n: int) -> dict[str, range]:
    """Named sets of layers made exact: none, all, the lowest ``L + 1``, the top ones, bands of 5."""
    sets = {"none (stitched)": range(0), "all": range(n)}
    sets |= {f"0..{last}": range(last + 1) for last in (1, 3, 7, 11, 15) if last < n - 1}
    sets |= {f"{first}..{n - 1}": range(first, n) for first in (10, 15, 20, 25) if 0 < first < n}
    sets |= {f"{a}..{min(a + 4, n - 1)}": range(a, min(a + 5, n)) for a in range(0, n, 5)}
    return sets


@torch.inference_mode()
def substitute(model, tokenizer, group: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """Per layer set: (top-1 agreement, mean KL) of the test prompt's continuation with those layers exact."""
    warmups, text, _ = ef.group_prompts(group)
    ids = tokenizer(text)["input_ids"]
    cold = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    continuation = cold.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).output_ids
    del cold
    reference = reference_continuation_logits(model, ids, continuation)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, stitching=StitchConfig()))
    for warmup in warmups:
        engine.next_token_logits(tokenizer(warmup)["input_ids"])
        engine.run_idle()
    prepared = engine._prepare(ids, max_reuse=len(ids) - 1, stitch=True, root=engine._salted_root(None))
    start = prepared.cached_tokens
    stitched = [(layer.keys, layer.values) for layer in prepared.cache.layers]
    exact = [(layer.keys, layer.values) for layer in output_cache(model(torch.tensor([ids[:start]]))).layers]
    tokens = torch.tensor([ids[start:] + list(continuation[:-1])])
    positions = torch.arange(start, start + tokens.shape[1]).unsqueeze(0)
    out = {}
    for name, layers in layer_sets(len(stitched)).items():
        kv = [
            (k.clone(), v.clone())
            for k, v in (exact[i] if i in layers else stitched[i] for i in range(len(stitched)))
        ]
        cache = DynamicCache(kv, config=model.config)
        logits = model(input_ids=tokens, position_ids=positions, **cache_kwargs(model, cache)).logits
        agreement = compare_distributions(reference, logits[0, -len(continuation) :])
        out[name] = (agreement.top1_agreement, agreement.mean_kl)
    return out


def main() -> None:
    model, tokenizer, chosen = ef.follow_up_setup(__doc__)
    groups = [group for _, _, group in chosen]
    results = [substitute(model, tokenizer, group) for group in groups]
    positions = NEW_TOKENS * len(results)
    print(f"| layers exact | TF top-1 ({len(results)} prompts, {positions} positions) | TF mean KL |")
    print("|---|---|---|")
    for name in results[0]:
        top1 = sum(r[name][0] for r in results) / len(results)
        kl = sum(r[name][1] for r in results) / len(results)
        print(f"| {name} | {top1:.1%} | {kl:.4f} |", flush=True)


if __name__ == "__main__":
    main()
