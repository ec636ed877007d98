from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kvb_planner import ModelShape, PlannerConfigError
from kvb_planner.kv_layout import kv_cache_bytes


def test_from_config_reads_llama_dimensions():
    config = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    shape = ModelShape.from_config(config)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (shape.head_dim, shape.intermediate_size, shape.vocab_size) == (64, 1536, 49152)
    assert shape.dtype_bytes == 4 and shape.attn_implementation == "sdpa"
    # SmolLM2-135M has 134,515,008 parameters (tied embeddings): 49152*576 + 30*3,540,096 + 576.
    assert shape.weight_bytes == 134_515_008 * 4


def test_from_config_respects_dtype_untied_head_and_explicit_head_dim():
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        head_dim=32,
        tie_word_embeddings=False,
    )
    shape = ModelShape.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    assert shape.head_dim == 32 and shape.dtype_bytes == 2 and shape.attn_implementation == "eager"
    per_layer = 64 * 32 * (2 * 4 + 2 * 2) + 3 * 64 * 128 + 2 * 64
    assert shape.weight_bytes == 2 * (2 * 100 * 64 + 2 * per_layer + 64)


def test_from_model_counts_real_parameters(tiny_llama):
    shape = ModelShape.from_model(tiny_llama)
    expected = sum(p.numel() for p in tiny_llama.parameters()) * 4
    assert shape.weight_bytes == expected
    # The Llama-layout formula agrees with the real module (untied head, no biases).
    assert ModelShape.from_config(tiny_llama.config).weight_bytes == expected


def test_kv_bytes_per_token_is_gqa_aware(tiny_shape):
    assert (
        tiny_shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    )  # K+V, 2 layers, 2 KV heads (not 4), d=16, fp32


def test_gpt2_style_configs_give_their_mlp_width():
    """GPT-2 names its MLP width n_inner (None: 4 x hidden): the planner refused it ("no integer
    'intermediate_size'"), so a server on GPT-2 started with planning off."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256)
    assert ModelShape.from_config(config).intermediate_size == 256
    config.n_inner = 96
    assert ModelShape.from_config(config).intermediate_size == 96


def test_rejects_non_decoder_configs_and_bad_values():
    with pytest.raises(PlannerConfigError, match="intermediate_size"):
        ModelShape.from_config(
            type(
                "Cfg",
                (),
                {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10},
            )()
        )
    with pytest.raises(PlannerConfigError, match="multiple of num_kv_heads"):
        ModelShape(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=3,
            num_kv_heads=2,
            head_dim=4,
            intermediate_size=8,
            vocab_size=8,
            dtype_bytes=4,
            weight_bytes=0,
        )
    with pytest.raises(PlannerConfigError, match="unknown dtype"):
        ModelShape.from_config(LlamaConfig(), dtype="float17")


def test_from_config_reads_the_context_length():
    dims = dict(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=100
    )
    assert ModelShape.from_config(LlamaConfig(**dims, max_position_embeddings=4096)).context_length == 4096
    # GPT-2 style configs name it n_positions.
    assert ModelShape.from_config(SimpleNamespace(**dims, n_positions=1024)).context_length == 1024
    # A multimodal config keeps it in its text config.
    nested = SimpleNamespace(text_config=SimpleNamespace(**dims, max_position_embeddings=8192))
    assert ModelShape.from_config(nested).context_length == 8192
    # Absent (or not a positive int): unknown, no context check.
    assert ModelShape.from_config(SimpleNamespace(**dims)).context_length is None
    assert (
        ModelShape.from_config(SimpleNamespace(**dims, max_position_embeddings=None)).context_length is None
    )


def test_yarn_extends_the_context_length_as_the_engine_does():
    dims = dict(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=100
    )
    # Qwen2.5 / Qwen3 model cards add this block: the engine serves 131072 tokens, so a plan must too.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = LlamaConfig(**dims, max_position_embeddings=32768, rope_scaling=yarn)
    assert ModelShape.from_config(config).context_length == 131_072
    # Without original_max_position_embeddings the declared length is the base; a factor <= 1 changes nothing.
    plain = SimpleNamespace(**dims, max_position_embeddings=4096, rope_scaling={"type": "yarn", "factor": 2})
    assert ModelShape.from_config(plain).context_length == 8192
    shrink = SimpleNamespace(
        **dims, max_position_embeddings=4096, rope_scaling={"type": "yarn", "factor": 0.5}
    )
    assert ModelShape.from_config(shrink).context_length == 4096
    # Other scalings keep the declared length (linear already counts in max_position_embeddings).
    linear = LlamaConfig(
        **dims, max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    assert ModelShape.from_config(linear).context_length == 4096


def test_from_model_keeps_the_context_length_and_it_can_be_overridden(tiny_llama):
    shape = ModelShape.from_model(tiny_llama)
    assert shape.context_length == tiny_llama.config.max_position_embeddings
    assert replace(shape, context_length=512).context_length == 512


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4096"])
def test_context_length_must_be_a_positive_int_or_none(tiny_shape, bad):
    with pytest.raises(PlannerConfigError, match="context_length"):
        replace(tiny_shape, context_length=bad)


def test_a_multimodal_config_is_read_from_its_text_config():
    from transformers import Gemma3Config

    text = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 2048,
    }  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config={"hidden_size": 32, "num_hidden_layers": 1})
    shape = ModelShape.from_config(config)
    decoder = ModelShape.from_config(config.text_config)
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.head_dim) == (3, 64, 2, 16)
    assert (shape.vocab_size, shape.context_length) == (300, 2048)
    assert shape.kv_bytes_per_token == decoder.kv_bytes_per_token


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("num_layers", 1.5),
        ("num_layers", "2"),
        ("head_dim", True),
        ("dtype_bytes", 2.0),
        ("weight_bytes", None),
    ],
)
def test_sizes_must_be_ints(tiny_shape, field, bad):
    """A float size was accepted (fractional byte counts) and a string failed with a bare TypeError."""
    with pytest.raises(PlannerConfigError, match=f"{field} must be an int"):
        replace(tiny_shape, **{field: bad})


def test_multi_head_latent_attention_is_refused_not_misread():
    """A DeepSeek-V3 config was read as 128 per-head K/V of head_dim 64: 2.0 MB of KV per token where
    transformers caches a 576-element latent (70 KB), and the per-layer expansion was not counted."""
    from transformers import DeepseekV3Config

    with pytest.raises(PlannerConfigError, match=r"multi-head latent attention \(kv_lora_rank=512\)"):
        ModelShape.from_config(DeepseekV3Config())


def test_kv_shared_layers_hold_no_kv():
    """Gemma 3n / Gemma 4 E2B: the last ``num_kv_shared_layers`` layers attend to an earlier layer's keys and
    values and cache none, so only the other layers count (was: every layer, twice the real figure here)."""
    dims = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=100,
    )
    shape = ModelShape.from_config(SimpleNamespace(**dims, num_hidden_layers=30, num_kv_shared_layers=10))
    assert shape.kv_layer_channels == ((32, 32),) * 20
    assert shape.kv_bytes_per_token == 20 * 2 * 32 * 4
    plain = ModelShape.from_config(SimpleNamespace(**dims, num_hidden_layers=30))
    assert plain.kv_layer_channels is None and plain.kv_bytes_per_token == 30 * 2 * 32 * 4


def test_per_layer_channels_equal_the_uniform_formula_when_alike(tiny_shape):
    """Listing every layer's channels changes nothing when the layers are alike (every bit width); layers
    of other widths are each counted at their own."""
    width = tiny_shape.num_kv_heads * tiny_shape.head_dim
    listed = replace(tiny_shape, kv_layer_channels=((width, width),) * tiny_shape.num_layers)
    for bits in (16, 8, 4):
        for tokens in (5, 300):
            assert kv_cache_bytes(listed, tokens=tokens, batch_size=3, kv_bits=bits) == kv_cache_bytes(
                tiny_shape, tokens=tokens, batch_size=3, kv_bits=bits
            )
    wide = replace(tiny_shape, kv_layer_channels=((width, width), (4 * width, 4 * width)))
    one = replace(tiny_shape, num_layers=1)
    four = replace(tiny_shape, num_layers=1, head_dim=4 * tiny_shape.head_dim)
    for bits in (16, 4):
        assert kv_cache_bytes(wide, tokens=300, batch_size=1, kv_bits=bits) == kv_cache_bytes(
            one, tokens=300, batch_size=1, kv_bits=bits
        ) + kv_cache_bytes(four, tokens=300, batch_size=1, kv_bits=bits)


@pytest.mark.parametrize("bad", [(), ((0, 4),), ((4,),), [(4, 4)], ((4, 4.0),), ((True, 4),)])
def test_bad_layer_channels_are_refused(tiny_shape, bad):
    with pytest.raises(PlannerConfigError, match="kv_layer_channels"):
        replace(tiny_shape, kv_layer_channels=bad)


@pytest.mark.parametrize("source", ["transformers", "attributes"])
def test_gemma4_global_layers_and_shared_layers_are_counted_per_layer(source):
    """Gemma 4: wider heads (and, 31B-style, one KV head) on its full-attention layers, KV shared by the last
    layers in E2B. transformers 5.24 keeps those in ``per_layer_config`` and refuses a global ``head_dim``
    (from_config crashed on it); older releases have ``global_head_dim`` / ``num_global_key_value_heads``."""
    from transformers import Gemma4TextConfig

    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        intermediate_size=128,
        vocab_size=100,
        num_kv_shared_layers=2,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
    )
    config = Gemma4TextConfig(**kwargs) if source == "transformers" else SimpleNamespace(**kwargs)
    shape = ModelShape.from_config(config)
    assert shape.kv_layer_channels == ((32, 32),) * 3 + ((32, 32),) + ((32, 32),) * 2
    assert shape.head_dim == 32 and shape.kv_bytes_per_token == 6 * 64 * 4
    wide = ModelShape.from_config(
        SimpleNamespace(**{**kwargs, "attention_k_eq_v": False, "num_kv_shared_layers": 0})
    )
    assert wide.kv_layer_channels == (((32, 32),) * 3 + ((64, 64),)) * 2


def test_gemma3n_per_layer_mlp_widths_and_shared_kv():
    """Gemma 3n gives one MLP width per layer (a list: from_config refused it, so a server started with
    planning off) and shares its last layers' KV."""
    from transformers import Gemma3nTextConfig

    config = Gemma3nTextConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=[128, 256, 128, 128],
        vocab_size=100,
        vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        laurel_rank=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4,
    )
    shape = ModelShape.from_config(config)
    assert shape.intermediate_size == 256
    assert shape.kv_layer_channels == ((32, 32),) * 2 and shape.kv_bytes_per_token == 2 * 64 * 4


def test_a_config_naming_no_attention_is_planned_as_its_class_would_run():
    """A config fresh from AutoConfig names no attention implementation, and transformers builds Gemma 2 and
    gpt-oss with eager (their classes do not support SDPA): planned as SDPA, a Gemma 2 prefill's fp32
    scores went uncharged (0.08x of the measured peak)."""
    from transformers import Gemma2Config

    gemma2 = Gemma2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, head_dim=16,
    )  # fmt: skip
    assert getattr(gemma2, "_attn_implementation", None) is None
    planned = ModelShape.from_config(gemma2).attn_implementation
    # What transformers builds from the same config (eager from 5.18 on; 5.17's Gemma 2 class took SDPA).
    from transformers import Gemma2ForCausalLM

    assert planned == Gemma2ForCausalLM(gemma2).config._attn_implementation
    assert ModelShape.from_config(LlamaConfig()).attn_implementation == "sdpa"
    unknown = SimpleNamespace(
        hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8, vocab_size=10
    )
    assert ModelShape.from_config(unknown).attn_implementation == "eager"  # unresolved: the costlier rule


@pytest.mark.parametrize(
    ("field", "value"), [("head_dim", "32"), ("num_key_value_heads", 0), ("num_key_value_heads", 2.0)]
)
def test_optional_sizes_in_a_config_must_be_positive_ints(field, value):
    """A string head_dim (a hand-edited config.json) was a TypeError in the arithmetic; 0 KV heads was
    silently read as multi-head attention."""
    config = SimpleNamespace(  # transformers' own configs now refuse such values when set
        model_type="llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=256,
    )
    setattr(config, field, value)
    with pytest.raises(PlannerConfigError, match=field):
        ModelShape.from_config(config)


@pytest.mark.parametrize("value", [-1, 1.5, "8", True])
def test_weight_transient_bytes_is_a_non_negative_int(value):
    shape = ModelShape.from_config(LlamaConfig(), dtype="float32")
    with pytest.raises(PlannerConfigError, match="weight_transient_bytes"):
        replace(shape, weight_transient_bytes=value)
