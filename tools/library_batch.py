"""Library phase of tools/bench_server.py: ``KVBoost.generate_batch`` against transformers' own
continuous batching (``model.generate_batch``), in one process, one torch thread, on one model folder.

Every prompt is the same ~800-token system prompt plus a different short chit-chat question, through the
chat template. Both APIs decode greedily and stop at EOS or ``max_new_tokens``; each row is compared
with plain ``model.generate`` greedy on that prompt alone (batch of one, no padding).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRun:
    """One timed batch call: its generated ids per prompt (EOS included when reached) and wall time."""

    outputs: list[list[int]]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def build_prompts(tokenizer, document: str, questions: list[str], system_tokens: int) -> list[list[int]]:
    """Chat-templated token ids: a system prompt of the document cut to ``system_tokens`` tokens, then one
    question per prompt."""
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"][:system_tokens]
    system = "Answer questions using this Python reference.\n\n" + tokenizer.decode(doc_ids)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in questions
    ]


def until_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    """``ids`` up to and including the first EOS (greedy outputs are compared in this form)."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return list(ids)


def kvboost_batch(engine, prompts: list[list[int]], max_new_tokens: int) -> BatchRun:
    t0 = time.perf_counter()
    results = engine.generate_batch(prompts, max_new_tokens=max_new_tokens, temperature=0)
    wall = time.perf_counter() - t0
    return BatchRun(outputs=[list(r.output_ids) for r in results], wall_s=wall)


def hf_generation_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    base = model.generation_config
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        bos_token_id=base.bos_token_id,
    )


def hf_continuous_batch(
    model, prompts: list[list[int]], max_new_tokens: int, cb_max_memory_percent: float | None = None
) -> BatchRun:
    """``model.generate_batch``: returns ``{request_id: GenerationOutput}`` in input order; a failed or
    missing request is logged there, not raised, so it is checked here.

    ``cb_max_memory_percent``: its paged cache's share of free memory, as ``transformers serve
    --cb-max-memory-percent`` (NOTE: its default share took 13.6 GB of RSS on the shared 2-core machine
    and the OOM killer ended the whole benchmark, server numbers included)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb_config = None
    if cb_max_memory_percent is not None:
        cb_config = ContinuousBatchingConfig(max_memory_percent=cb_max_memory_percent)
    t0 = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts,
        generation_config=hf_generation_config(model, max_new_tokens),
        progress_bar=False,
        continuous_batching_config=cb_config,
    )
    wall = time.perf_counter() - t0
    outputs = list(results.values())
    failed = [o.request_id for o in outputs if o.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(
            f"transformers generate_batch returned {len(outputs)}/{len(prompts)} results, failed: {failed}"
        )
    return BatchRun(outputs=[list(o.generated_tokens) for o in outputs], wall_s=wall)


def hf_reference(model, prompts: list[list[int]], max_new_tokens: int) -> BatchRun:
    """Plain ``model.generate`` greedy, one prompt at a time (the no-batching, no-reuse reference)."""
    config = hf_generation_config(model, max_new_tokens)
    outputs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            outputs.append(out[0, len(ids) :].tolist())
    return BatchRun(outputs=outputs, wall_s=time.perf_counter() - t0)


def run_library_phase(
    *,
    model_path: str,
    document: str,
    questions: list[str],
    system_tokens: int,
    max_new_tokens: int,
    cb_max_memory_percent: float | None = None,
) -> dict:
    """Both batch APIs on the same prompts (each warmed once on two unrelated short prompts first), then
    the per-prompt greedy reference. Returns JSON-safe raw numbers and the comparison."""
    from transformers import AutoModelForCausalLM

    from kvb_cache import KVBoost

    torch.set_num_threads(1)
    engine = KVBoost.from_pretrained("smollm2-135m", device="cpu")
    tokenizer = engine.tokenizer
    # A separate instance: the engine registers its own attention on its model; transformers' CB sets its own.
    model = AutoModelForCausalLM.from_pretrained(model_path, device_map="cpu").eval()
    eos = frozenset(engine.eos_token_ids)
    prompts = build_prompts(tokenizer, document, questions, system_tokens)
    warm_prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in ("Say hello.", "Count to three.")
    ]
    warm_kvb = kvboost_batch(engine, [list(p) for p in warm_prompts], 4)
    warm_hf = hf_continuous_batch(model, [list(p) for p in warm_prompts], 4, cb_max_memory_percent)

    kvb = kvboost_batch(engine, prompts, max_new_tokens)
    hf = hf_continuous_batch(model, prompts, max_new_tokens, cb_max_memory_percent)
    ref = hf_reference(model, prompts, max_new_tokens)

    rows = []
    for i, ids in enumerate(prompts):
        r, k, h = (until_eos(run.outputs[i], eos) for run in (ref, kvb, hf))
        rows.append(
            {
                "prompt_tokens": len(ids),
                "question": questions[i],
                "reference_ids": r,
                "kvboost_ids": k,
                "transformers_cb_ids": h,
                "kvboost_identical": k == r,
                "transformers_cb_identical": h == r,
            }
        )
    return {
        "prompts": len(prompts),
        "system_tokens": system_tokens,
        "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
        "max_new_tokens": max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "kvboost": {
            "wall_s": kvb.wall_s,
            "tokens": kvb.tokens,
            "tokens_per_s": kvb.tokens_per_s,
            "warmup_s": warm_kvb.wall_s,
        },
        "transformers_cb": {
            "wall_s": hf.wall_s,
            "tokens": hf.tokens,
            "tokens_per_s": hf.tokens_per_s,
            "warmup_s": warm_hf.wall_s,
        },
        "reference_generate": {"wall_s": ref.wall_s, "tokens": ref.tokens, "tokens_per_s": ref.tokens_per_s},
        "speedup_kvboost_over_transformers_cb": kvb.tokens_per_s / hf.tokens_per_s,
        "kvboost_identical_to_generate": sum(r["kvboost_identical"] for r in rows),
        "transformers_cb_identical_to_generate": sum(r["transformers_cb_identical"] for r in rows),
        "rows": rows,
    }
