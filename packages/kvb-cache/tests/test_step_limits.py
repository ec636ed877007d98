"""KVBoost.step_limits: what bounds one engine step's memory beside the pool (a memory planner's input)."""

from __future__ import annotations

import pytest
from conftest import make_model

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.core.paged_attention import DECODE_GATHER_TOKENS, PREFILL_MASK_ELEMENTS
from kvb_cache.step_limits import decode_gather_tokens, eager_loop_attention


def test_the_limits_follow_the_engine_config(llama, tokenizer) -> None:
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(max_num_batched_tokens=96, max_num_seqs=3, max_model_len=256)
    )
    limits = engine.step_limits
    assert (limits.step_tokens, limits.sampled_rows) == (96, 3)
    assert limits.logits_rows is None  # Llama keeps only the sampled rows' logits
    assert limits.mask_elements == PREFILL_MASK_ELEMENTS
    assert limits.decode_gather_tokens == 3 * 256  # three whole 256-token contexts, below the sub-batch cap
    assert not limits.eager_attention and not limits.solo_paths


def test_requests_that_may_leave_the_pool_are_flagged(llama, tokenizer) -> None:
    stitched = KVBoost(llama, tokenizer, config=EngineConfig(stitching=StitchConfig()))
    assert stitched.step_limits.solo_paths  # stitched prompts are assembled on a cache of their own


def test_decode_gather_bound() -> None:
    assert decode_gather_tokens(512, 2) == 1024
    assert decode_gather_tokens(8192, 32) == DECODE_GATHER_TOKENS  # sub-batches of at most 65536 positions
    assert decode_gather_tokens(200_000, 4) == 200_000  # one row longer than a sub-batch goes alone


@pytest.mark.parametrize(("arch", "eager"), [("llama", False), ("gemma2", True), ("gpt_oss", True)])
def test_eager_formula_models(arch: str, eager: bool) -> None:
    assert eager_loop_attention(make_model(arch)) is eager


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # GQA: masked blocks; MHA: the unmasked fast path
def test_a_prefills_gathered_context_is_freed_before_the_decoding_rows_gather(
    arch, tokenizer, monkeypatch
) -> None:
    """The step bound charges max(prefill gather, decode gather), not their sum: in a step that prefills one
    request while another decodes, every tensor the prefill's attention gathered from the pool (its context)
    must be gone when the decoding rows gather theirs. Its position mask may stay (kept for the step's other
    layers), within one block's bound: the budget charges a mask beside the gather."""
    from conftest import words
    from torch.multiprocessing.reductions import StorageWeakRef

    from kvb_cache import SamplingParams
    from kvb_cache.core import paged_attention as pa

    # Storage-level weak references: the engine runs in inference mode, where a view does not keep its base's
    # Python object, only its storage, alive.
    prefill_refs: list[StorageWeakRef] = []
    mask_refs: list[tuple[StorageWeakRef, int]] = []
    checked: list[int] = []
    in_prefill = [False]
    original_attend, original_prefill, original_decode = pa.attend, pa._prefill_rows, pa._decode_rows

    def recording_attend(q, k, v, mask, **kwargs):
        if in_prefill[0]:
            prefill_refs.extend(StorageWeakRef(t.untyped_storage()) for t in (k, v))
            if mask is not None:
                mask_refs.append((StorageWeakRef(mask.untyped_storage()), mask.numel()))
        return original_attend(q, k, v, mask, **kwargs)

    def prefill(*args, **kwargs):
        in_prefill[0] = True
        try:
            return original_prefill(*args, **kwargs)
        finally:
            in_prefill[0] = False

    def decode(*args, **kwargs):
        alive = [ref for ref in prefill_refs if not ref.expired()]
        assert not alive, f"{len(alive)} tensors of this step's prefill attention are still referenced"
        kept = sum(n for ref, n in mask_refs if not ref.expired())
        assert kept <= pa.PREFILL_MASK_ELEMENTS
        checked.append(len(prefill_refs))
        return original_decode(*args, **kwargs)

    monkeypatch.setattr(pa, "attend", recording_attend)
    monkeypatch.setattr(pa, "_prefill_rows", prefill)
    monkeypatch.setattr(pa, "_decode_rows", decode)
    model = make_model(arch)
    engine = KVBoost(model, tokenizer, config=EngineConfig(max_num_batched_tokens=256, max_num_seqs=4))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.add_request(words(60), params)
    engine.step()  # the first request's whole prompt and its first token
    engine.add_request(words(80, seed=3), params)
    prefill_refs.clear()
    mask_refs.clear()
    engine.step()  # the second request prefills while the first decodes, on every layer
    assert checked and all(n > 0 for n in checked)  # the check ran after a prefill, so it could fail
