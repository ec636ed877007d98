"""Newer architectures: chunked attention, Gemma 4 and KV shared across layers (Gemma 3n, Gemma 4 E2B) served
exactly, Cohere 2's NoPE layers kept in place when keys move, and the models the pool cannot serve (recurrent
state, a mask built inside the attention module, two attention calls per layer) declined when the engine is
built, naming why."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from conftest import MORE_ARCHITECTURES, VOCAB, bart_config, beam_config, gemma4_config, mllama_config, words

from kvb_cache import ContextLengthError, EngineConfig, KVBoost, UnsupportedModelError
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.core.attention_routing import check_attention_routing
from kvb_cache.core.kv_storage import probe_layer_shapes
from kvb_cache.core.paged_attention import install_paged_attention
from kvb_cache.kv_sharing import kv_sources
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
_SSM = dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, initializer_range=0.2)


def _llama4(**overrides) -> T.Llama4TextConfig:
    """Three chunked-attention layers (chunks of 24 tokens), the 4th full attention without RoPE (iRoPE)."""
    return T.Llama4TextConfig(
        **{**_SMALL, "num_hidden_layers": 4},
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=24,
        **overrides,
    )


def _build(config: T.PretrainedConfig) -> T.PreTrainedModel:
    torch.manual_seed(0)
    config.eos_token_id, config.pad_token_id = 1, 0
    return T.AutoModelForCausalLM.from_config(config).eval()


def _generate(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def test_chunked_attention_is_served_exactly(tokenizer):
    """Before, Llama 4 was declined; served without the chunk mask its logits were off by ~5: every query
    attended across its chunk's start (the mask transformers builds never reaches a paged call)."""
    # The cached prefix ends inside the second 24-token chunk; decoding crosses the chunk boundary at 72, solo
    # and batched with other requests.
    _assert_served_exactly(_build(_llama4(attn_temperature_tuning=False)), tokenizer, solo=16, batched=14)


def _assert_served_exactly(model, tokenizer, *, solo: int, batched: int) -> None:
    """A 60-token prompt after a 40-token warm prefix: logits equal a plain forward (2e-5); ``solo`` greedy
    tokens equal ``model.generate``'s, and ``batched`` for each of three prompts decoded together."""
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    ids = tokenizer(words(60, seed=1))["input_ids"]
    engine.warm(ids[:40])
    result = engine.next_token_logits(ids)
    assert result.cached_tokens >= 32
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(result.logits, reference, atol=2e-5, rtol=0)
    assert engine.generate(ids, max_new_tokens=solo, ignore_eos=True).output_ids == _generate(
        model, ids, solo
    )
    prompts = [words(40, seed=1), words(12, seed=2), words(45, seed=3)]
    outs = engine.generate_batch(prompts, max_new_tokens=batched, ignore_eos=True)
    for out, prompt in zip(outs, prompts):
        assert out.output_ids == _generate(model, tokenizer(prompt)["input_ids"], batched)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        # 31B-style: the global layers' values are their (unrotated, normalised) keys, one KV head.
        {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
        # 26B-A4B-style: a mixture-of-experts block beside each MLP.
        {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    ],
    ids=["dense", "k-eq-v", "moe"],
)
def test_gemma4_is_served_exactly(variant, tokenizer):
    """Gemma 4's layers differ by type (a wider head and proportional RoPE on its global layers, a sliding
    window on the others): exact prefix reuse, decoding past the window solo and in a batch."""
    _assert_served_exactly(_build(gemma4_config(**variant)), tokenizer, solo=12, batched=10)


@pytest.mark.parametrize(
    ("arch", "own_layers"), [("gemma4_kv_shared", 6), ("gemma3n", 2)], ids=["gemma4-e2b-style", "gemma3n"]
)
def test_kv_shared_layers_are_served_exactly_from_their_producers_slots(arch, own_layers, tokenizer):
    """Gemma 3n and Gemma 4 E2B / E4B: the last two layers attend to an earlier layer's keys/values. The pool
    holds the producer layers only (as transformers' cache does) and the shared layers read their producer's
    slots: exact prefix reuse, solo and batched greedy equal to ``model.generate`` (these models were declined)."""
    model = _build(MORE_ARCHITECTURES[arch]())
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    assert engine.traits.kv_layers == own_layers
    assert engine.core.kv.storage.num_layers == own_layers
    assert len(engine.core.kv.storage.shared) == 2
    _assert_served_exactly(model, tokenizer, solo=12, batched=10)


@pytest.mark.parametrize("arch", ["gemma4_kv_shared", "gemma3n"])
def test_kv_shared_layers_stay_exact_across_prefill_chunks_and_preemption(arch, tokenizer):
    """Prompts prefilled over several steps (a shared layer reads producer slots written in earlier steps)
    in a pool too small for all of them at once (requests preempted and resumed): greedy still equals
    ``model.generate`` for every prompt."""
    model = _build(MORE_ARCHITECTURES[arch]())
    config = EngineConfig(chunk_size=16, num_blocks=12, block_size=8, max_num_batched_tokens=24)
    engine = KVBoost(model, tokenizer, config=config)
    shared = words(30, seed=7)
    prompts = [
        f"{shared} {words(5 + 4 * s, seed=s)}" if s % 2 else words(10 + 6 * s, seed=s) for s in range(6)
    ]
    outs = engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
    assert engine.core.scheduler.preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert out.output_ids == _generate(model, tokenizer(prompt)["input_ids"], 10)


def test_gemma4_multimodal_wrapper_with_shared_kv_is_served_exactly_on_text(tokenizer):
    """The released Gemma 4 E2B loads as ``Gemma4ForConditionalGeneration`` (a vision tower beside the text
    decoder): text prompts through it are served exactly, its text config's KV sharing included."""
    text = MORE_ARCHITECTURES["gemma4_kv_shared"]()
    vision = T.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    config = T.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.text_config.eos_token_id, config.text_config.pad_token_id = 1, 0
    model = _build(config)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    _assert_served_exactly(model, tokenizer, solo=8, batched=6)


def test_kv_sources_follow_transformers_producers():
    """Each shared layer reads the last earlier layer of its type: the layers transformers marks to store
    their full-length keys/values for sharing (Gemma 4 E2B's pattern, four sliding layers then a full one)."""
    config = gemma4_config(
        num_hidden_layers=10,
        num_kv_shared_layers=4,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
    )
    sources = kv_sources(config, 10)
    assert sources == (0, 1, 2, 3, 4, 5, 5, 5, 5, 4)
    assert kv_sources(gemma4_config(), 6) == tuple(range(6))
    modes = getattr(config, "kv_sharing_modes", None)  # transformers' own marking, newer than 5.17
    if modes is not None:
        assert set(sources[6:]) == {i for i, mode in enumerate(modes) if mode == "store"}


def test_a_shared_layer_passed_other_keys_than_its_producers_is_declined():
    """The routing probe checks that a shared layer really is passed its producer's keys/values (a
    transformers version computing them otherwise would read the wrong slots): told that layer 6 shares
    layer 4's, while the model passes it layer 5's, the engine declines."""
    model = _build(MORE_ARCHITECTURES["gemma4_kv_shared"]())
    shapes = probe_layer_shapes(model)
    install_paged_attention(model)
    check_attention_routing(model, shapes, (0, 1, 2, 3, 4, 5, 5, 3))
    with pytest.raises(UnsupportedModelError, match="declares layer 6 to share layer 4"):
        check_attention_routing(model, shapes, (0, 1, 2, 3, 4, 5, 4, 3))


def test_llama4_temperature_tuning_is_served_below_its_floor_scale(tokenizer):
    """Llama 4 (as released) scales its NoPE layers' queries by a factor of the position it counts from
    past_key_values; a packed forward passes none, so the model takes each token's index in the packed batch
    for its position. Below floor_scale the factor is 1: the engine caps the context and every step's packed
    tokens there and is exact (was declined). Without the packed cap, a batch whose first step packs more than
    floor_scale - 1 prompt tokens scales the later ones' queries (the third prompt's first-token logprob moved
    by 0.02)."""
    model = _build(_llama4(floor_scale=40, attn_scale=2.0))  # a large attn_scale makes a wrong scale visible
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, max_num_batched_tokens=512))
    assert engine.context_length == 39 and engine.core.scheduler.max_num_batched_tokens == 39
    prompts = [words(20, seed=s) for s in (1, 2, 3)]  # 60 prompt tokens: more than one step may pack
    outs = engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True, logprobs=0)
    for out, prompt in zip(outs, prompts):
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) + 10 <= 39
        assert out.output_ids == _generate(model, ids, 10)
        with torch.no_grad():
            first = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)[out.output_ids[0]]
        assert abs(out.logprobs[0].logprob - float(first)) < 1e-4
    with pytest.raises(ContextLengthError):
        engine.generate(words(30, seed=4), max_new_tokens=12)


def test_longrope_is_served_exactly_up_to_its_switch_and_refused_past_it(tokenizer):
    """LongRoPE (Phi-3-128k, Phi-3.5) picks short or long frequencies from each forward's longest position.
    Served to max_position_embeddings, a 40-token prefix cached by a short request and reused by a 100-token
    one (past the 64-token switch) gave logits off by ~6.5, and a packed step rotated a short request's keys
    with a long one's factors. Now the context stops at the switch, where every forward is exact."""
    config = T.Phi3Config(
        **{**_SMALL, "max_position_embeddings": 256},
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [3.0] * 8},
    )
    model = _build(config)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, block_size=8))
    assert engine.context_length == 64
    ids = tokenizer(words(60, seed=2))["input_ids"]
    engine.warm(ids[:40])
    result = engine.next_token_logits(ids)
    assert result.cached_tokens >= 32
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(result.logits, reference, atol=2e-5, rtol=0)
    prompts = [words(20, seed=s) for s in (3, 4)] + [words(50, seed=2)]
    for out, prompt in zip(engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True), prompts):
        assert out.output_ids == _generate(model, tokenizer(prompt)["input_ids"], 10)
    with pytest.raises(ContextLengthError, match="LongRoPE"):
        engine.generate(words(100, seed=2), max_new_tokens=4)


def test_yarn_extends_the_context_by_its_factor_and_stays_exact(tokenizer):
    """Qwen2.5 / Qwen3 model cards add a YaRN block (factor 4 over 32768 positions) for long prompts; vLLM
    serves original x factor. Capped at max_position_embeddings, a prompt past it was refused. YaRN's rotation
    does not depend on the request's length, so a prefix cached by a short request is reused exactly by a
    long one past the declared window."""
    config = T.Qwen2Config(
        **{**_SMALL, "max_position_embeddings": 64},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = _build(config)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, block_size=8))
    assert engine.context_length == 256
    ids = tokenizer(words(120, seed=2))["input_ids"]
    assert len(ids) > 64
    engine.warm(ids[:40])
    result = engine.next_token_logits(ids)
    assert result.cached_tokens >= 32
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(result.logits, reference, atol=2e-5, rtol=0)


def test_cohere2_nope_layers_keep_their_keys_when_moved():
    """Cohere 2's full-attention layers skip RoPE (its config does not say so; its modeling code does): the
    mover used to rotate their keys anyway (off by ~5 at the moved position)."""
    model = _build(T.Cohere2Config(**{**_SMALL, "num_hidden_layers": 4}, sliding_window=24))
    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    assert mover.support.supported, mover.support.reason
    ids = torch.randint(2, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()

    def kv_at(start: int):
        positions = torch.arange(start, start + len(ids)).unsqueeze(0)
        with torch.no_grad():
            cache = output_cache(model(torch.tensor([ids]), position_ids=positions, use_cache=True))
        return tuple((layer.keys, layer.values) for layer in cache.layers)

    moved = mover.reposition(kv_at(5), 5, 61)
    for layer, ((k, _), (k_ref, _)) in enumerate(zip(moved, kv_at(61))):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")


def test_beam_nope_full_attention_layers_are_served_exactly(tokenizer):
    """Beam's full-attention layers have no RoPE parameters (``rope_parameters["full_attention"] = None``):
    building the engine raised a bare AttributeError while reading them."""
    if not hasattr(T, "BeamConfig"):
        pytest.skip("this transformers has no Beam (5.17 and older)")
    config = beam_config()
    _assert_served_exactly(_build(config), tokenizer, solo=12, batched=10)


@pytest.mark.parametrize(
    ("make_config", "match"),
    [
        # Pure state space: every layer's cache is a recurrent state.
        (lambda: T.MambaConfig(**_SSM, state_size=8), "recurrent state"),
        # Mamba-2 in parallel with attention in every layer ("hybrid" cache layers).
        (
            lambda: T.FalconH1Config(
                **_SMALL,
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=8,
                mamba_chunk_size=16,
                mamba_d_ssm=128,
            ),
            "recurrent state",
        ),
        # Its own recurrent state object, no transformers Cache at all.
        (
            lambda: T.RwkvConfig(**_SSM, attention_hidden_size=32, intermediate_size=64, context_length=128),
            "keeps no transformers Cache",
        ),
        # The mask is computed inside the attention module from every cached token's values.
        (lambda: T.DogeConfig(**_SMALL, keep_window_size=24), "builds its own attention mask"),
        # Differential attention: two attention calls per layer, one per half of the values.
        (lambda: T.DiffLlamaConfig(**_SMALL), "calls attention 2 times in one forward of layer 0"),
        # No cache of any kind (was told "recurrent state").
        (
            lambda: T.OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB),
            "takes no `past_key_values`",
        ),
        # BartForCausalLM counts positions from its cache: served, every cached prefix, decode step and
        # batched request was wrong (logits off by up to 6.7).
        (
            bart_config,
            "ignores the position_ids",
        ),
        # Bidirectional encoders served with causal attention: logits off by 0.9-4 with nothing cached.
        (
            lambda: T.BertConfig(**{k: v for k, v in _SMALL.items() if k != "num_key_value_heads"}),
            "bidirectionally",
        ),
        # A masked-LM checkpoint at BERT's default initialisation (std 0.02): its logits move by 1.4e-2 of
        # their scale, under the probe's first tolerance (1e-2 of max(|logits|, 1)); served, it answered noise.
        (
            lambda: T.BertConfig(
                **{k: v for k, v in _SMALL.items() if k not in ("num_key_value_heads", "initializer_range")},
                initializer_range=0.02,
            ),
            "bidirectionally",
        ),
        (
            lambda: T.Gemma3TextConfig(**_SMALL, head_dim=16, use_bidirectional_attention=True),
            "bidirectionally",
        ),
        # Cross-attention layers keep no keys for a text prompt (was a bare AttributeError).
        (
            mllama_config,
            "keep no keys/values",
        ),
    ],
    ids=[
        "mamba",
        "falcon-h1-hybrid",
        "rwkv",
        "doge",
        "diffllama",
        "openai-gpt",
        "bart",
        "bert",
        "bert-default-init",
        "gemma3-bidirectional",
        "mllama",
    ],
)
def test_models_the_pool_cannot_serve_are_declined(make_config, match, tokenizer):
    """Served anyway, these crashed when the engine was built (RWKV) or gave wrong
    logits (Doge: off by ~6, DiffLlama: ~4); the recurrent ones were declined with a reason that did not say
    why."""
    model = _build(make_config())
    with pytest.raises(UnsupportedModelError, match=match):
        KVBoost(model, tokenizer)
