"""How much could a smarter split of the seam budget between stitched runs buy? An oracle bound.

The shipped ``selective`` rule recomputes the same ``overlap_k`` tokens after every seam. A rule that gave
each run its own length (more where the foreign history still shows, less where it has faded) would need a
signal; before building one, this tool asks what the *best* split could buy at all: starting from 32 seam
tokens per run, it repeatedly extends by 32 tokens the one run whose extension lowers the teacher-forced
mean KL most (every candidate measured against no-cache: an oracle), until the budget of ``seam-k64``
(64 per run) is spent, and reports it beside uniform ``seam-k32``, ``seam-k64`` and ``seam-k128``.

The cache state is the harness's default with idle time (``tools/eval_fidelity.py --idle``): two warm-ups,
each followed by ``engine.run_idle()``, so each document has two averaged copies. Model: the embedded
SmolLM2-135M-Instruct, fp32, CPU, one thread. Prints each group's raw row as a JSON line, then a markdown table of the means.

    python tools/eval_seam_allocation.py --pydoc 0 3 6 --humaneval 0 5
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence

from eval_fidelity import CACHE_BYTES, follow_up_setup, group_prompts

import kvb_cache.stitching as stitching
from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits

STEP = 32
NEW_TOKENS = 32

#: Seam tokens per run for the rule in force, keyed by the run's start position (runs of one prompt are
#: fixed by its cache state, so the same keys come back on every preparation).
LENGTHS: dict[int, int] = {}
#: The runs the last preparation saw.
SEEN: list[tuple[int, int]] = []


def _rule(pieces: Sequence[tuple[int, int]], **_) -> list[int]:
    SEEN[:] = list(pieces)
    return sorted({p for a, b in pieces for p in range(a, min(b, a + LENGTHS.get(a, 0)))})


def run_group(model, tokenizer, group: list[tuple[str, str]]) -> dict:
    """One group's uniform seam lengths and the oracle split of the ``seam-k64`` budget."""
    warmups, text, _ = group_prompts(group)
    ids = tokenizer(text)["input_ids"]
    config = EngineConfig(chunk_size=32, max_cache_bytes=CACHE_BYTES)
    cold = KVBoost(model, tokenizer, config=config).generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reference = reference_continuation_logits(model, ids, cold.output_ids)
    engine = KVBoost(
        model,
        tokenizer,
        config=EngineConfig(chunk_size=32, stitching=StitchConfig(), max_cache_bytes=CACHE_BYTES),
    )
    for w in warmups:
        engine.next_token_logits(tokenizer(w)["input_ids"])
        engine.run_idle()
    engine.next_token_logits(ids)

    def measure(lengths: dict[int, int]) -> tuple[float, float, int]:
        LENGTHS.clear()
        LENGTHS.update(lengths)
        forced = teacher_forced_logits(engine, ids, cold.output_ids)
        agreement = compare_distributions(reference, forced.logits)
        return agreement.mean_kl, agreement.top1_agreement, forced.recomputed_tokens

    measure({})
    runs = list(SEEN)
    uniform = {k: measure({a: k for a, _ in runs}) for k in (32, 64, 128)}
    budget = sum(min(64, b - a) for a, b in runs)
    lengths = {a: min(32, b - a) for a, b in runs}
    best = uniform[32]
    while sum(lengths.values()) + STEP <= budget:
        trials = []
        for a, b in runs:
            if lengths[a] < b - a:
                trial = {**lengths, a: min(b - a, lengths[a] + STEP)}
                trials.append((measure(trial), trial))
        if not trials:
            break
        best, lengths = min(trials, key=lambda t: t[0][0])
    return {
        "runs": [b - a for a, b in runs],
        "oracle_lengths": [lengths[a] for a, _ in runs],
        "prompt_tokens": len(ids),
        **{f"k{k}": {"kl": v[0], "top1": v[1], "recomputed": v[2] / len(ids)} for k, v in uniform.items()},
        "oracle": {"kl": best[0], "top1": best[1], "recomputed": best[2] / len(ids)},
    }


def main() -> None:
    model, tokenizer, groups = follow_up_setup(__doc__)
    # NOTE: swapping the module's rule is this ablation's whole point; the engine has no public hook for it.
    stitching.selective_positions = _rule  # type: ignore[assignment]
    rows = []
    for set_name, index, group in groups:
        row = {"set": set_name, "group": index, **run_group(model, tokenizer, group)}
        rows.append(row)
        print(json.dumps(row), flush=True)  # one raw row per line (docs/fidelity_seam_allocation.json)
    print("| rule | groups | recomputed | TF top-1 | TF mean KL |")
    print("|---|---|---|---|---|")
    for name in ("k32", "k64", "oracle", "k128"):
        print(
            f"| {name} | {len(rows)} | {statistics.mean(r[name]['recomputed'] for r in rows):.0%} "
            f"| {statistics.mean(r[name]['top1'] for r in rows):.1%} "
            f"| {statistics.mean(r[name]['kl'] for r in rows):.4f} |"
        )


if __name__ == "__main__":
    main()
