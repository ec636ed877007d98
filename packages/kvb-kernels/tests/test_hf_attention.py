from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import kvb_kernels.hf_attention as hf
from kvb_kernels import (
    ATTN_IMPLEMENTATION,
    install_flash_attention,
    register_kvb_attention,
    uninstall_flash_attention,
)

LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the q_len of every call that reached the kernel (so a silent SDPA fallback cannot pass)."""
    calls: list[int] = []
    real = hf.flash_attention

    def spy(query, *args, **kwargs):
        calls.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(hf, "flash_attention", spy)
    return calls


def _prompt():
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left-padded second row
    return ids, mask


def test_greedy_tokens_and_logits_match_sdpa(device, kernel_calls):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval().to(device)
    ids, mask = (t.to(device) for t in _prompt())
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)

    assert install_flash_attention(model) == 2
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    valid = mask.bool()  # padded positions' logits are meaningless in both
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert 12 in kernel_calls and 1 in kernel_calls  # prefill and decode both ran in the kernel


def test_from_config_and_uninstall(device, kernel_calls):
    register_kvb_attention()
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**LLAMA), attn_implementation=ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with torch.no_grad():  # a forward that tracks gradients goes to SDPA
        model.eval().to(device)(torch.arange(8, device=device)[None])
    assert kernel_calls == [8, 8]
    assert uninstall_flash_attention(model) == 2
    assert model.config._attn_implementation == "sdpa"
    assert uninstall_flash_attention(model) == 0


def test_sliding_window_model_matches_sdpa(device, kernel_calls):
    """Mistral's sliding window reaches the kernel through the sdpa-style boolean mask."""
    cfg = MistralConfig(**LLAMA, sliding_window=5)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval().to(device)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3)).to(device)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref_logits = model(ids).logits
    install_flash_attention(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref)
    assert kernel_calls


def test_static_cache_generation_matches_sdpa(device, kernel_calls):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval().to(device)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(4)).to(device)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    install_flash_attention(model)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(out, ref)
    assert kernel_calls


def test_unserved_calls_fall_back_to_transformers_sdpa_once(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: the kernel cannot run
    hf._log_fallback_once.cache_clear()
    sdpa_calls: list[int] = []
    real_sdpa = hf.sdpa_attention_forward

    def sdpa_spy(module, query, *args, **kwargs):
        sdpa_calls.append(query.shape[2])
        return real_sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(hf, "sdpa_attention_forward", sdpa_spy)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    ids = torch.arange(6)[None]
    with torch.no_grad():
        ref = model(ids).logits
    with caplog.at_level(logging.WARNING, logger=hf.__name__):
        install_flash_attention(model)
        with torch.no_grad():
            out = model(ids).logits
            model(ids)
    assert torch.equal(out, ref)
    assert sdpa_calls == [6, 6, 6, 6]
    fallbacks = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(fallbacks) == 1 and "cpu" in fallbacks[0].getMessage()


def test_dropout_goes_to_sdpa(device, monkeypatch):
    reasons: list[str] = []
    monkeypatch.setattr(hf, "_log_fallback_once", reasons.append)
    q = torch.randn(1, 2, 4, 32, device=device)
    module = torch.nn.Module()
    hf.kvb_attention_forward(module, q, q, q, None, dropout=0.5)
    assert reasons == ["attention dropout > 0 (training)"]


def test_a_value_head_unlike_the_keys_goes_to_sdpa(device, monkeypatch):
    """DeepSeek-V3's multi-head latent attention has a narrower value head: the kernel raised ShapeError."""
    reasons: list[str] = []
    monkeypatch.setattr(hf, "_log_fallback_once", reasons.append)
    q = torch.randn(1, 2, 4, 24, device=device)
    v = torch.randn(1, 2, 4, 16, device=device)
    out, _ = hf.kvb_attention_forward(torch.nn.Module(), q, q, v, None)
    assert out.shape[-1] == 16 and reasons == ["head_dim 24 (key 24, value 16)"]


def test_training_goes_to_sdpa_and_keeps_gradients(device, kernel_calls):
    """The kernel is forward-only: a forward that needs gradients must not run it (its output has no grad_fn,
    so q/k/v projections silently got no gradient when fine-tuning with kvb_attention installed)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(device).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    model(ids, labels=ids).loss.backward()
    ref = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    install_flash_attention(model)
    model(ids, labels=ids).loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None
    torch.testing.assert_close(grad, ref)
    assert kernel_calls == []
    with torch.no_grad():  # inference still runs in the kernel
        model(ids)
    assert kernel_calls


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_gemma2_softcapping_goes_to_eager_and_matches_it(monkeypatch, interpret):
    """SDPA refuses soft-capping: installing the kernel must not make Gemma 2 fail (it used to raise on every
    forward). Both on CPU without a kernel and under the interpreter, softcap calls run the model's eager code."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    config = Gemma2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=128,
        sliding_window=5,
        attn_logit_softcapping=5.0,  # small, so the capping changes the scores
        final_logit_softcapping=30.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    ids, mask = _prompt()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        install_flash_attention(model)
        out = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=0)
    assert torch.equal(tokens, ref_tokens)


def test_eager_fallback_expands_a_skipped_causal_mask():
    """``None`` from sdpa_mask means plain causal: the eager fallback must apply it, not attend to the future."""
    q = torch.randn(1, 2, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    seen: dict = {}

    def eager(module, query, key, value, mask, *, dropout, scaling, **kwargs):
        seen["mask"] = mask
        return query, None

    module = torch.nn.Module()
    module.is_causal = True
    hf._call_eager(eager, module, q, k, v, None, 0.0, None, None, {"softcap": 2.0})
    mask = seen["mask"][0, 0]
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert (mask[future] < -1e30).all() and (mask[~future] == 0).all()
