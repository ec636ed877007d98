"""Tiny random Llama models and the reference decoding loop shared by the tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvb_speculative import LogitsTokenProcessor, SamplingParams, extend, prefill
from kvb_speculative.sampling import sample_token


def tiny_llama(
    seed: int, *, vocab_size: int = 128, initializer_range: float = 0.02, **overrides
) -> LlamaForCausalLM:
    """A 2-layer random Llama; ``initializer_range`` > 0.02 gives peaked next-token distributions."""
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def plain_decode(model, input_ids: torch.Tensor, processor, num_tokens: int) -> list[int]:
    """The target's own token-by-token loop with the same processor (the exactness reference)."""
    cache, logits = prefill(model, input_ids)
    history = input_ids[0]
    out: list[int] = []
    for _ in range(num_tokens):
        scores = processor.process(history, logits)
        if processor.greedy:
            token = int(torch.argmax(scores))
        else:
            token = sample_token(torch.softmax(scores, -1), processor.generator)
        out.append(token)
        history = torch.cat([history, torch.tensor([token])])
        logits = extend(model, cache, torch.tensor([token]))[-1]
    return out


def greedy() -> LogitsTokenProcessor:
    return LogitsTokenProcessor(SamplingParams(temperature=0.0))
