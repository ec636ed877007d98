"""Re-positioned keys equal keys computed at the new position (no history, fp32), for every RoPE variant."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from conftest import VOCAB, gemma4_config, make_model

from kvb_cache.cache_kwarg import output_cache
from kvb_cache.rope import KeyRepositioner

_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def _llama(rope: dict) -> T.PretrainedConfig:
    return T.LlamaConfig(**_SMALL, rope_parameters={"rope_theta": 10000.0, **rope})


CONFIGS = {
    "llama-default": lambda: _llama({"rope_type": "default"}),
    "llama-linear": lambda: _llama({"rope_type": "linear", "factor": 2.0}),
    "llama-yarn": lambda: _llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    ),
    "llama3": lambda: _llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "qwen2": lambda: T.Qwen2Config(**_SMALL),
    "phi3-partial": lambda: T.Phi3Config(**_SMALL, partial_rotary_factor=0.5, pad_token_id=0),
    "gpt-neox-partial": lambda: T.GPTNeoXConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        initializer_range=0.2,
        rotary_pct=0.25,
    ),
    "gemma3-per-layer-rope": lambda: T.Gemma3TextConfig(**_SMALL, head_dim=16, sliding_window=512),
    # Split before apply_rotary_pos_emb (Phi, StableLM), inside it (GLM, interleaved), half-width tables
    # (gpt-oss), interleaved full rotary (Cohere).
    "phi-partial": lambda: T.PhiConfig(**_SMALL, partial_rotary_factor=0.5),
    "stablelm-partial": lambda: T.StableLmConfig(**_SMALL),
    "glm4-partial": lambda: T.Glm4Config(**_SMALL, head_dim=16, pad_token_id=0),
    "gpt-oss-yarn": lambda: T.GptOssConfig(
        **_SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=512
    ),
    "cohere-interleaved": lambda: T.CohereConfig(**_SMALL, pad_token_id=0),
    # One-tensor apply_rotary_pos_emb; the global layer's proportional RoPE rotates a quarter of a wider head
    # with tables as wide as the head (splitting by the factor, as for Phi, broke it).
    "gemma4-proportional": lambda: gemma4_config(sliding_window=512),
    # Every 4th layer has no RoPE (NoPE): its keys must not be rotated.
    "smollm3-nope": lambda: T.SmolLM3Config(**{**_SMALL, "num_hidden_layers": 4}, pad_token_id=0),
}


def _model(name: str) -> T.PreTrainedModel:
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()


def _kv_at(model, ids: list[int], start: int):
    """Per layer ``(keys, values)`` of ``ids`` computed alone at positions ``[start, start + len)``."""
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([ids]), position_ids=positions, use_cache=True))
    return tuple((layer.keys, layer.values) for layer in cache.layers)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("old", "new"), [(0, 37), (60, 3), (9, 101), (5, 5)])
def test_repositioned_keys_equal_keys_computed_there(name, old, new):
    model = _model(name)
    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    assert mover.support.supported, mover.support.reason
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    stored, expected = _kv_at(model, ids, old), _kv_at(model, ids, new)
    moved = mover.reposition(stored, old, new)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(moved, expected)):
        # 1e-5 absolute + 1e-5 relative: fp32 angles at position p carry ~p * 2**-24 rad of rounding in the
        # reference itself (HF computes cos/sin in fp32 even for fp64 models) and these random keys reach |5|.
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5, msg=f"{name} layer {layer} keys")
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5, msg=f"{name} layer {layer} values")
    if old != new:
        # Not vacuous: without the rotation the keys really differ.
        assert (stored[0][0] - expected[0][0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_many_pieces_at_once_equal_each_moved_alone(name):
    """``reposition_many`` (one rotation per layer over every piece of a stitch) gives each piece's keys bit
    for bit as ``reposition`` does, values untouched, NoPE layers and unmoved pieces passed through."""
    model = _model(name)
    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    gen = torch.Generator().manual_seed(2)
    # (length, stored at, moved to): pieces of several lengths moved both ways, one not moved at all.
    moves = [(16, 0, 40), (8, 70, 5), (24, 3, 3), (5, 9, 200), (11, 100, 64)]
    items = [
        (_kv_at(model, torch.randint(0, VOCAB, (n,), generator=gen).tolist(), old), old, new)
        for n, old, new in moves
    ]
    together = mover.reposition_many(items)
    assert len(together) == len(items)
    for (kv, old, new), got in zip(items, together):
        alone = mover.reposition(kv, old, new)
        assert len(got) == len(alone)
        for layer, ((k, v), (k_ref, _)) in enumerate(zip(got, alone)):
            assert torch.equal(k, k_ref), f"{name} piece at {old}->{new} layer {layer} keys"
            assert v is kv[layer][1], "values are passed through, not copied"
            assert k.dtype == kv[layer][0].dtype
    # Not vacuous: the moved pieces' keys really changed.
    assert not torch.equal(together[0][0][0], items[0][0][0][0])


def test_many_pieces_in_another_dtype_are_moved_one_by_one():
    model = _model("llama-default")
    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    a = _kv_at(model, [1, 2, 3, 4], 0)
    b = tuple((k.double(), v.double()) for k, v in _kv_at(model, [5, 6, 7], 10))
    got = mover.reposition_many([(a, 0, 20), (b, 10, 2)])
    assert got[1][0][0].dtype == torch.float64
    assert torch.equal(got[0][0][0], mover.reposition(a, 0, 20)[0][0])
    assert torch.equal(got[1][0][0], mover.reposition(b, 10, 2)[0][0])


def test_gpt2_is_declined_with_reason():
    mover = KeyRepositioner.for_model(make_model("gpt2"), absolute_positions=True)
    assert not mover.support.supported
    assert "absolute position" in mover.support.reason
    with pytest.raises(ValueError, match="absolute position"):
        mover.reposition(((torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)),), 0, 3)


def test_dynamic_ntk_is_declined_with_reason():
    torch.manual_seed(0)
    config = _llama({"rope_type": "dynamic", "factor": 2.0})
    model = T.AutoModelForCausalLM.from_config(config).eval()
    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    assert not mover.support.supported
    assert "dynamic" in mover.support.reason
