"""A bigram language model behind the Hugging Face interface: thousands of decodes per second.

Statistical tests need many samples; a forward of this model is one embedding lookup, yet it goes through
the same ``PreTrainedModel`` call, ``DynamicCache`` growth and ``crop`` as a real model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class BigramConfig(PretrainedConfig):
    model_type = "kvb-test-bigram"

    def __init__(self, vocab_size: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.num_hidden_layers = 1


class BigramLM(PreTrainedModel):
    """``logits[t] = table[token_t]``: the next-token distribution depends on the last token only."""

    config_class = BigramConfig

    def __init__(self, config: BigramConfig) -> None:
        super().__init__(config)
        self.table = nn.Embedding(config.vocab_size, config.vocab_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.table

    def forward(self, input_ids, past_key_values=None, position_ids=None, use_cache=True, logits_to_keep=0):
        n = input_ids.shape[1]
        if past_key_values is not None:
            # One fake KV column per token, so the cache length tracks the sequence like a real model's.
            past_key_values.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        logits = self.table(input_ids)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def bigram(seed: int, vocab_size: int = 6, scale: float = 2.0) -> BigramLM:
    """A bigram model with ``N(0, scale)`` logits (peaked enough that p and another seed's q differ)."""
    config = BigramConfig(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = BigramLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.table.weight.copy_(torch.randn(vocab_size, vocab_size, generator=generator) * scale)
    return model


def empty_cache(model: BigramLM) -> DynamicCache:
    return DynamicCache(config=model.config)
