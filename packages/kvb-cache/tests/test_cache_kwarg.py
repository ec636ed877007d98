"""Which keyword a forward takes its Cache under (transformers 5.24 renamed ``past_key_values`` to ``cache``)."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache

from kvb_cache.cache_kwarg import cache_argument, cache_kwargs


class _OwnState:  # a recurrent model's own state class (xLSTM's xLSTMCache)
    pass


class Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values: Cache | None = None): ...


class New(torch.nn.Module):
    def forward(self, input_ids=None, cache: Cache | None = None): ...


class NewPostponed(torch.nn.Module):
    def forward(self, input_ids=None, cache: "Cache | None" = None): ...  # noqa: UP037


class Recurrent(torch.nn.Module):
    def forward(self, input_ids=None, cache: _OwnState | None = None): ...


class RecurrentPostponed(torch.nn.Module):
    def forward(self, input_ids=None, cache: "xLSTMCache | None" = None): ...  # noqa: F821, UP037


class Stateful(torch.nn.Module):
    def forward(self, input_ids=None, state=None): ...


def test_the_keyword_each_forward_takes():
    assert cache_argument(Old()) == "past_key_values"
    assert cache_argument(New()) == "cache"
    assert cache_argument(NewPostponed()) == "cache"
    # 5.24 also calls recurrent models' own state `cache`: not a KV cache, so no keyword for ours.
    assert cache_argument(Recurrent()) is None
    assert cache_argument(RecurrentPostponed()) is None
    assert cache_argument(Stateful()) is None


def test_cache_kwargs_names_the_cache():
    cache = DynamicCache()
    assert cache_kwargs(Old(), cache) == {"past_key_values": cache}
    assert cache_kwargs(New(), cache) == {"cache": cache}


def test_output_cache_reads_whichever_field_the_output_has():
    import dataclasses

    from kvb_cache.cache_kwarg import output_cache

    @dataclasses.dataclass
    class OldOutput:
        logits: torch.Tensor | None = None
        past_key_values: Cache | None = None

    @dataclasses.dataclass
    class NewOutput:
        logits: torch.Tensor | None = None
        cache: Cache | None = None

    cache = DynamicCache()
    assert output_cache(OldOutput(past_key_values=cache)) is cache
    assert output_cache(NewOutput(cache=cache)) is cache
    assert output_cache(NewOutput()) is None


def test_a_real_forward_and_its_output_through_the_helpers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvb_cache.cache_kwarg import output_cache

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(model, cache))
    assert output_cache(out) is cache
    assert cache.get_seq_length() == 3
