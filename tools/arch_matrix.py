"""Which transformers architectures the engine serves, checked on tiny random models (CPU, ~5 minutes).

For every architecture: exact prefix reuse (fp32 logits vs a plain forward, greedy tokens vs
``model.generate``), a batch of three requests through the engine loop (greedy vs ``generate``), and
stitched reuse (reordered documents; recomputing every stitched token must equal no-cache); then the
engine's other paths (``tools/arch_paths.py``): live KV quantization at 8/4 bits, speculative decoding,
the ``hf_bridge`` and the disk tier after RAM eviction. An architecture the engine cannot serve must be
declined when the engine is built, with a reason: never a wrong answer or a crash mid-request.

    python tools/arch_matrix.py [--out docs] [name ...]

Writes ``architectures.json`` and ``architectures.md`` (a table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "kvb-cache" / "tests"))
from arch_paths import path_problems, paths_table, run_paths  # noqa: E402
from conftest import (  # noqa: E402
    MORE_ARCHITECTURES,
    VOCAB,
    bart_config,
    beam_config,
    gemma4_config,
    make_tokenizer,
    mllama_config,
    rag_prompts,
    words,
)

from kvb_cache import EngineConfig, KVBoost, StitchConfig, UnsupportedModelError  # noqa: E402
from kvb_cache.cache_kwarg import output_cache  # noqa: E402
from kvb_cache.kv_sharing import own_kv_layers  # noqa: E402
from kvb_cache.rope import KeyRepositioner  # noqa: E402

_C = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
)
_MHA = {k: v for k, v in _C.items() if k != "num_key_value_heads"}
_MOE = dict(num_experts_per_tok=2)
#: Multi-head latent attention (DeepSeek and its descendants).
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
#: Pure state-space / recurrent models (no attention).
_SSM = dict(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, initializer_range=0.2)
#: The Mamba-2 mixer of the hybrids.
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
#: Qwen2-VL's multimodal RoPE (sections of the rotary half: temporal, height, width), used on text only.
#: The gated-DeltaNet (linear attention) layers of Qwen3-Next and Qwen3.5.
_GATED_DELTANET = dict(
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MROPE = dict(text_config=dict(**_C, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}))


def _llama4(**overrides) -> T.Llama4TextConfig:
    return T.Llama4TextConfig(
        **{**_C, "num_hidden_layers": 4},
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=24,
        **overrides,
    )


#: name -> (config factory, what makes it interesting)
ARCHS: dict[str, tuple[Callable[[], T.PretrainedConfig], str]] = {
    "llama": (lambda: T.LlamaConfig(**_C), "GQA, RoPE"),
    "llama3-rope": (
        lambda: T.LlamaConfig(
            **_C,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        "scaled RoPE",
    ),
    "qwen2": (lambda: T.Qwen2Config(**_C), "QKV bias"),
    "qwen3": (lambda: T.Qwen3Config(**_C, head_dim=16), "q/k norm"),
    "qwen2_moe": (
        lambda: T.Qwen2MoeConfig(
            **_C, **_MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
        "MoE + shared expert",
    ),
    "qwen3_moe": (
        lambda: T.Qwen3MoeConfig(**_C, **_MOE, head_dim=16, num_experts=4, moe_intermediate_size=32),
        "MoE",
    ),
    "mistral": (lambda: T.MistralConfig(**_C, sliding_window=24), "sliding window"),
    "mixtral": (lambda: T.MixtralConfig(**_C, **_MOE, num_local_experts=4), "MoE"),
    "gemma": (lambda: T.GemmaConfig(**_C, head_dim=16), "scaled embeddings"),
    "gemma2": (
        lambda: T.Gemma2Config(**_C, head_dim=16, sliding_window=24),
        "soft-capping, alternating sliding window",
    ),
    "gemma3": (
        lambda: T.Gemma3TextConfig(**_C, head_dim=16, sliding_window=24),
        "per-layer-type RoPE, sliding window",
    ),
    "phi": (lambda: T.PhiConfig(**_C, partial_rotary_factor=0.5), "partial rotary (split in the module)"),
    "phi3": (lambda: T.Phi3Config(**_C, pad_token_id=0), "fused QKV"),
    "stablelm": (lambda: T.StableLmConfig(**_C), "decoder layer drops attention kwargs; partial rotary"),
    "gpt_neox": (lambda: T.GPTNeoXConfig(**_MHA, rotary_pct=0.25), "no num_key_value_heads; partial rotary"),
    "olmo2": (lambda: T.Olmo2Config(**_C), "post-norm, q/k norm"),
    "granite": (lambda: T.GraniteConfig(**_C), "multipliers"),
    "starcoder2": (lambda: T.Starcoder2Config(**_C), "sliding window, bias"),
    "cohere": (lambda: T.CohereConfig(**_C, pad_token_id=0), "interleaved RoPE, parallel block"),
    "glm4": (lambda: T.Glm4Config(**_C, head_dim=16, pad_token_id=0), "partial interleaved RoPE"),
    "smollm3": (
        lambda: T.SmolLM3Config(**{**_C, "num_hidden_layers": 4}, pad_token_id=0),
        "NoPE every 4th layer",
    ),
    "exaone4": (lambda: T.Exaone4Config(**_C), "hybrid sliding window"),
    "gpt_oss": (
        lambda: T.GptOssConfig(**_C, **_MOE, head_dim=16, num_local_experts=4, sliding_window=24),
        "attention sinks, YaRN, MoE",
    ),
    "gpt2": (
        lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=512),
        "absolute positions",
    ),
    "opt": (
        lambda: T.OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            vocab_size=VOCAB,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
        ),
        "learned positions (offset 2)",
    ),
    # Newer plain decoders.
    "olmo3": (lambda: T.Olmo3Config(**_C, sliding_window=24), "post-norm, q/k norm, sliding window"),
    "olmoe": (lambda: T.OlmoeConfig(**_C, **_MOE, num_experts=4), "MoE, q/k norm"),
    "dbrx": (
        lambda: T.DbrxConfig(
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=512,
            vocab_size=VOCAB,
            initializer_range=0.2,
            attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        ),
        "fused QKV with clipping, MoE",
    ),
    "phimoe": (lambda: T.PhimoeConfig(**_C, **_MOE, num_local_experts=4), "MoE (sparsemixer)"),
    "glm4_moe": (
        lambda: T.Glm4MoeConfig(
            **_C,
            **_MOE,
            head_dim=16,
            n_routed_experts=4,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "partial RoPE, grouped MoE",
    ),
    "ernie4_5": (lambda: T.Ernie4_5Config(**_C, head_dim=16), "interleaved RoPE"),
    "ernie4_5_moe": (
        lambda: T.Ernie4_5_MoeConfig(**_C, **_MOE, head_dim=16, moe_num_experts=4, moe_intermediate_size=32),
        "interleaved RoPE, MoE",
    ),
    "hunyuan_v1_dense": (lambda: T.HunYuanDenseV1Config(**_C, head_dim=16), "q/k norm after RoPE"),
    "seed_oss": (lambda: T.SeedOssConfig(**_C, head_dim=16), "QKV bias"),
    "apertus": (lambda: T.ApertusConfig(**_C), "xIELU activation, q/k norm"),
    "arcee": (lambda: T.ArceeConfig(**_C), "ReLU-squared MLP"),
    "helium": (lambda: T.HeliumConfig(**_C, head_dim=16), "interleaved RoPE"),
    "ministral": (lambda: T.MinistralConfig(**_C, head_dim=16, sliding_window=24), "sliding window"),
    "ministral3": (lambda: T.Ministral3Config(**_C), "Ministral 3"),
    "gpt_bigcode": (
        lambda: T.GPTBigCodeConfig(**_MHA),
        "multi-query attention, absolute positions (StarCoder)",
    ),
    "granitemoe": (lambda: T.GraniteMoeConfig(**_C, **_MOE, num_local_experts=4), "multipliers, MoE"),
    "nemotron": (lambda: T.NemotronConfig(**_C), "partial rotary, LayerNorm1P"),
    "bitnet": (lambda: T.BitNetConfig(**_C), "ternary weights, sub-norm"),
    "doge": (lambda: T.DogeConfig(**_C, keep_window_size=24), "dynamic mask attention"),
    "diffllama": (lambda: T.DiffLlamaConfig(**_C), "differential attention (two attention calls per layer)"),
    "dots1": (
        lambda: T.Dots1Config(
            **_C,
            **_MOE,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "q/k norm, grouped MoE",
    ),
    "minimax_m2": (
        lambda: T.MiniMaxM2Config(**_C, **_MOE, head_dim=16, rotary_dim=8, num_local_experts=4),
        "q/k norm, partial rotary, MoE",
    ),
    # Attention variants.
    "llama4": (lambda: _llama4(), "chunked attention + NoPE layers (iRoPE), attention temperature tuning"),
    "llama4-no-tuning": (
        lambda: _llama4(attn_temperature_tuning=False),
        "chunked attention + NoPE layers (iRoPE), complex RoPE",
    ),
    "gemma3n": (
        MORE_ARCHITECTURES["gemma3n"],
        "AltUp, per-layer inputs, KV shared across layers, sliding window",
    ),
    "gemma4": (
        lambda: gemma4_config(),
        "per-layer head size, proportional RoPE on global layers, per-layer inputs",
    ),
    "gemma4_k_eq_v": (
        lambda: gemma4_config(attention_k_eq_v=True, num_global_key_value_heads=1),
        "Gemma 4 31B-style: values are the keys on global layers",
    ),
    "gemma4_moe": (
        lambda: gemma4_config(
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
        ),
        "Gemma 4 26B-A4B-style: MoE block",
    ),
    "gemma4_kv_shared": (
        lambda: gemma4_config(num_hidden_layers=8, num_kv_shared_layers=2),
        "Gemma 4 E2B/E4B-style: KV shared across layers",
    ),
    "cohere2": (
        lambda: T.Cohere2Config(**{**_C, "num_hidden_layers": 4}, sliding_window=24, pad_token_id=0),
        "sliding window + NoPE full layers",
    ),
    "qwen2_vl": (
        lambda: T.Qwen2VLConfig(**_MROPE, vision_config=dict(depth=1, embed_dim=32, num_heads=2)),
        "multimodal RoPE, text only",
    ),
    "qwen2_5_vl": (
        lambda: T.Qwen2_5_VLConfig(
            **_MROPE,
            vision_config=dict(
                depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64
            ),
        ),
        "multimodal RoPE, text only",
    ),
    "deepseek_v2": (
        lambda: T.DeepseekV2Config(
            **_C,
            **_MOE,
            **_MLA,
            n_routed_experts=4,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "multi-head latent attention",
    ),
    "longcat_flash": (
        lambda: T.LongcatFlashConfig(
            **{k: v for k, v in _C.items() if k not in ("num_hidden_layers", "intermediate_size")},
            **_MLA,
            num_layers=2,
            head_dim=8,
            ffn_hidden_size=128,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
        ),
        "multi-head latent attention, zero experts",
    ),
    # State-space, recurrent and linear-attention models (pure and hybrid).
    "mamba": (lambda: T.MambaConfig(**_SSM, state_size=8), "selective state space (SSM)"),
    "mamba2": (
        lambda: T.Mamba2Config(**_SSM, num_heads=8, head_dim=16, n_groups=1, state_size=8, chunk_size=16),
        "state space duality (SSM)",
    ),
    "falcon_mamba": (lambda: T.FalconMambaConfig(**_SSM, state_size=8), "SSM"),
    "rwkv": (
        lambda: T.RwkvConfig(**_SSM, attention_hidden_size=64, intermediate_size=128, context_length=512),
        "recurrent (RWKV-4)",
    ),
    "xlstm": (
        lambda: T.xLSTMConfig(
            **_SSM,
            embedding_dim=64,
            num_blocks=2,
            num_heads=4,
            qk_dim_factor=1.0,
            v_dim_factor=1.0,
            mode="inference",
            chunkwise_kernel="chunkwise--native_autograd",
            sequence_kernel="native_sequence__native",
            step_kernel="native",
        ),
        "recurrent (mLSTM)",
    ),
    "jamba": (
        lambda: T.JambaConfig(
            **_C,
            **_MOE,
            num_experts=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            use_mamba_kernels=False,
        ),
        "Mamba + attention layers, MoE",
    ),
    "bamba": (lambda: T.BambaConfig(**_C, **_MAMBA2, attn_layer_indices=[1]), "Mamba-2 + attention layers"),
    "falcon_h1": (
        lambda: T.FalconH1Config(**_C, **_MAMBA2, mamba_d_ssm=128),
        "Mamba-2 parallel to attention",
    ),
    "zamba2": (
        lambda: T.Zamba2Config(
            **_C,
            layers_block_type=["mamba", "hybrid"],
            mamba_d_state=8,
            n_mamba_heads=8,
            mamba_ngroups=1,
            chunk_size=16,
            use_mamba_kernels=False,
        ),
        "Mamba-2 + shared attention block",
    ),
    "granitemoehybrid": (
        lambda: T.GraniteMoeHybridConfig(
            **_C,
            **_MOE,
            **_MAMBA2,
            num_local_experts=4,
            shared_intermediate_size=32,
            layer_types=["mamba", "attention"],
        ),
        "Mamba-2 + attention layers, MoE",
    ),
    "nemotron_h": (
        lambda: T.NemotronHConfig(
            **{k: v for k, v in _C.items() if k != "num_hidden_layers"},
            layers_block_type=["mamba", "attention"],
            head_dim=16,
            ssm_state_size=8,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=1,
            chunk_size=16,
            use_mamba_kernels=False,
        ),
        "Mamba-2 + attention layers",
    ),
    "lfm2": (
        lambda: T.Lfm2Config(**_C, layer_types=["conv", "full_attention"]),
        "short convolutions + attention",
    ),
    "qwen3_next": (
        lambda: T.Qwen3NextConfig(
            **_C,
            **_MOE,
            **_GATED_DELTANET,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "gated DeltaNet + gated attention, MoE",
    ),
    "qwen3_5": (
        lambda: T.Qwen3_5TextConfig(**_C, **_GATED_DELTANET),
        "Qwen3.5: gated DeltaNet + gated attention",
    ),
    "recurrent_gemma": (
        lambda: T.RecurrentGemmaConfig(
            **{k: v for k, v in _C.items() if k not in ("initializer_range", "max_position_embeddings")},
            lru_width=64,
            attention_window_size=24,
            block_types=["recurrent", "attention"],
        ),
        "RG-LRU recurrence + local attention",
    ),
    "minimax": (
        lambda: T.MiniMaxConfig(
            **_C,
            **_MOE,
            head_dim=16,
            num_local_experts=4,
            layer_types=["linear_attention", "full_attention"],
            block_size=16,
        ),
        "lightning (linear) attention + attention, MoE",
    ),
    "kimi_linear": (
        lambda: T.KimiLinearConfig(
            **{**_C, "num_key_value_heads": 4},
            **_MOE,
            **_MLA,
            num_local_experts=4,
            moe_intermediate_size=32,
            linear_head_dim=16,
            linear_num_heads=4,
            layer_types=["linear_attention", "full_attention"],
            pad_token_id=0,
        ),
        "Kimi delta attention + MLA",
    ),
    "gptj": (
        lambda: T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, rotary_dim=8),
        "rotary keys inside its own module (AttentionInterface since transformers 5.24)",
    ),
    "falcon": (
        lambda: T.FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
        "attention outside AttentionInterface",
    ),
    "bloom": (
        lambda: T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB),
        "ALiBi, attention outside AttentionInterface",
    ),
    "bart": (
        bart_config,
        "decoder counting positions from its cache",
    ),
    "bert": (
        lambda: T.BertConfig(**_MHA),
        "bidirectional encoder (is_decoder=False)",
    ),
    "gemma3-bidirectional": (
        lambda: T.Gemma3TextConfig(**_C, head_dim=16, use_bidirectional_attention=True),
        "bidirectional attention (embedding models)",
    ),
    "beam": (
        beam_config,
        "NoPE full-attention layers (no RoPE parameters for them)",
    ),
    "mllama": (
        mllama_config,
        "cross-attention layers (Llama 3.2 Vision)",
    ),
    "deepseek_v3": (
        lambda: T.DeepseekV3Config(
            **_C,
            **_MOE,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "multi-head latent attention (latent cache)",
    ),
}
#: Architectures whose SDPA path transformers lacks.
_EAGER = {"gemma2", "gpt_oss"}
#: Architectures without a causal-LM auto class: their text path is the full model's (vision tower unused).
_AUTO = {"qwen2_vl": T.AutoModelForImageTextToText, "qwen2_5_vl": T.AutoModelForImageTextToText}


def _model(name: str, seed: int = 0) -> T.PreTrainedModel:
    torch.manual_seed(seed)
    config = ARCHS[name][0]()
    config.eos_token_id, config.pad_token_id = 1, 0
    impl = "eager" if name in _EAGER else None
    auto = _AUTO.get(name, T.AutoModelForCausalLM)
    return auto.from_config(config, attn_implementation=impl).eval()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _moved_key_error(model, ids: list[int], old: int = 5, new: int = 61) -> float:
    """Max abs difference between keys computed at ``old`` and moved to ``new`` and keys computed at ``new``
    (every layer): a relative-position model's KV of a lone chunk depends on its position only through RoPE."""

    def kv_at(start: int):
        positions = torch.arange(start, start + len(ids)).unsqueeze(0)
        with torch.no_grad():
            cache = output_cache(model(torch.tensor([ids]), position_ids=positions, use_cache=True))
        return tuple((layer.keys, layer.values) for layer in own_kv_layers(cache))

    mover = KeyRepositioner.for_model(model, absolute_positions=False)
    moved = mover.reposition(kv_at(old), old, new)
    return max(float((k - ref).abs().max()) for (k, _), (ref, _) in zip(moved, kv_at(new)))


def check(name: str, tokenizer) -> dict:
    row: dict = {"arch": name, "what": ARCHS[name][1]}
    model = _model(name)
    try:
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    except UnsupportedModelError as exc:
        return row | {"status": "declined", "reason": str(exc)}
    ids = tokenizer(words(60, seed=1))["input_ids"]
    engine.warm(ids[:40])
    result = engine.next_token_logits(ids)
    row["exact_cached"] = result.cached_tokens
    row["exact_max_abs_diff"] = float((result.logits - _logits(model, ids)).abs().max())
    row["exact_greedy_equal"] = engine.generate(
        ids, max_new_tokens=12, ignore_eos=True
    ).output_ids == _greedy(model, ids, 12)
    batched = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, max_num_batched_tokens=32))
    prompts = [words(40, seed=1), words(12, seed=2), words(40, seed=1) + " w7 w8"]
    outs = batched.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    row["batch_greedy_equal"] = all(
        o.output_ids == _greedy(model, tokenizer(p)["input_ids"], 8) for o, p in zip(outs, prompts)
    )
    first, second = rag_prompts(tokenizer)
    stitch = StitchConfig(recompute_strategy="selective", overlap_k=10_000)
    stitched = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, stitching=stitch))
    stitched.next_token_logits(first)
    warm = stitched.next_token_logits(second)
    declined = stitched.cache_stats().get("stitching", {}).get("declined_reason")
    row["stitch"] = "declined" if declined else "yes"
    row["stitch_reason"] = declined
    row["stitch_recomputed"] = warm.recomputed_tokens
    row["stitch_all_max_abs_diff"] = float((warm.logits - _logits(model, second)).abs().max())
    row["moved_key_max_abs_diff"] = None if declined else _moved_key_error(model, first[:20])
    moved_ok = declined or row["moved_key_max_abs_diff"] <= 1e-4
    exact = row["exact_max_abs_diff"] <= 2e-5 and row["stitch_all_max_abs_diff"] <= 2e-5 and moved_ok
    ok = exact and row["exact_greedy_equal"] and row["batch_greedy_equal"]
    # The other paths; the draft model is the same architecture with other weights (mostly rejected).
    row["paths"] = run_paths(
        model, _model(name, seed=1), tokenizer, ids, lambda seed: tokenizer(words(80, seed=seed))["input_ids"]
    )
    row["path_problems"] = path_problems(row["paths"])
    ok = ok and not row["path_problems"]
    return row | {"status": "served" if ok else "WRONG"}


def _short_reason(reason: str | None) -> str:
    """``"GPT2LMHeadModel uses absolute position embeddings: ..."`` -> ``"uses absolute position embeddings"``."""
    return (reason or "positions cannot move").split(" ", 1)[-1].split(":")[0].split(";")[0]


def _table(rows: list[dict]) -> str:
    lines = [
        "| architecture | what it exercises | status | exact: max abs logit diff | greedy (solo / batch) | "
        "stitching: recompute-all max diff | stitching: moved keys vs computed there |",
        "|---|---|---|---|---|---|---|",
    ]
    # Served (or wrong) first, then declined; each group in ``ARCHS`` order.
    for r in sorted(rows, key=lambda r: r["status"] == "declined"):
        if r["status"] == "declined" or r["status"].startswith("error"):
            reason = r.get("reason", r["status"]).split(";")[0].split(" (")[0]
            lines.append(f"| {r['arch']} | {r['what']} | **{r['status'].split(':')[0]}**: {reason} | | | | |")
            continue
        greedy = (
            f"{'=' if r['exact_greedy_equal'] else 'DIFF'} / {'=' if r['batch_greedy_equal'] else 'DIFF'}"
        )
        stitch = (
            f"declined: {_short_reason(r.get('stitch_reason'))}"
            if r["stitch"] == "declined"
            else f"{r['stitch_all_max_abs_diff']:.1e} ({r['stitch_recomputed']} recomputed)"
        )
        moved = "" if r["moved_key_max_abs_diff"] is None else f"{r['moved_key_max_abs_diff']:.1e}"
        lines.append(
            f"| {r['arch']} | {r['what']} | {r['status']} | {r['exact_max_abs_diff']:.1e} | {greedy} | {stitch} "
            f"| {moved} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures to check (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write architectures.{json,md} here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    rows = []
    for name in args.names or list(ARCHS):
        try:
            row = check(name, tokenizer)
        except Exception as exc:  # a crash is a result here: it goes in the table
            row = {"arch": name, "what": ARCHS[name][1], "status": f"error: {type(exc).__name__}: {exc}"}
        rows.append(row)
        print(f"{name:14s} {row['status'][:160]}", flush=True)
    table = _table(rows) + "\n\n" + _PATHS_HEADER + paths_table(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"transformers": T.__version__, "torch": torch.__version__}
        (args.out / "architectures.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
        )
        served = sum(r["status"] == "served" for r in rows)
        declined = sum(r["status"] == "declined" for r in rows)
        header = _HEADER.format(**meta, served=served, declined=declined)
        (args.out / "architectures.md").write_text(header + table + "\n")


_HEADER = """# Architectures

What `python tools/arch_matrix.py --out docs` printed (transformers {transformers}, torch {torch}, CPU,
fp32, tiny random models: 2 layers, hidden 64; 4 to 8 layers where the layer pattern needs them). For each
architecture: exact prefix reuse (40 of 61 tokens cached) against a plain forward, greedy tokens solo and in a
batch of three through the engine loop against `model.generate`, stitched reuse with every stitched token
recomputed (which must equal no-cache: it checks the repair forward), and the keys of a lone 20-token chunk
computed at position 5 and moved to 61 against the keys computed at 61 (every layer; the check of
re-rotation, RoPE variants and NoPE layers included). *Declined* architectures raise `UnsupportedModelError`
when the engine is built, with the reason shown; none is served with a wrong answer.

**Served, exact** ({served} rows): every decoder whose layers are all attention over per-token
keys/values computed through transformers' `AttentionInterface`: full, sliding-window (Mistral, Gemma 2/3/4,
Cohere 2, OLMo 3, Ministral) and chunked attention (Llama 4's local layers: the paged mask keeps each query
inside its `attention_chunk_size` chunk), with RoPE of any layout, NoPE layers (SmolLM3, Llama 4, Cohere 2's
full layers, found by a one-token probe: a layer whose keys at positions 0 and 1 are equal is not rotated when
a chunk moves), sinks, soft-capping, the MoE routers in the table (top-k, grouped, sparsemixer, shared
experts), layers of different shapes in one model (Gemma 4's global layers: a wider head, one KV head
whose values are its keys in the 31B style, proportional RoPE that rotates a quarter of the head with tables
as wide as the head), keys/values shared across layers (Gemma 3n, Gemma 4 E2B / E4B: the last
`num_kv_shared_layers` layers attend to the last earlier layer of their type; the pool, chunk store and tiers
hold the other layers only, as transformers' cache does, and a shared layer's attention reads its producer's
slots; the routing probe checks that the model passes each shared layer exactly its producer's keys/values;
checked on tiny random configs and a tiny multimodal Gemma 4 wrapper, not on the released checkpoints: no hub access here),
and the text path of the multimodal-RoPE models (Qwen2-VL, Qwen2.5-VL). Llama 4 as released (attention
temperature tuning, row `llama4`: its NoPE layers' queries are scaled by a factor of the position, counted
from `past_key_values`, which the packed forward does not pass, so the model would take a token's index in
the packed batch for its position) is served with its context capped at `floor_scale - 1` (8191) tokens and
every step's packed tokens kept below that, where the factor is exactly 1 (a warning says so when the engine
is built; `test_architectures_extra.py` shows a larger packed step moving a logprob by 0.02). Stitching (non-prefix reuse) is declined, with the reason in the table, where
keys cannot be moved: learned absolute positions (GPT-2, OPT), RoPE applied by other code than a rotary
module plus `apply_rotary_pos_emb(q, k, cos, sin)` or its one-tensor form `(x, cos, sin)` (Gemma 3n/4) (Llama 4's complex rotation, Qwen2-VL's three-section
multimodal RoPE, GPT-J's sinusoidal table) and chunked attention (the repair forward's masks are causal or sliding only).

**Declined** ({declined} rows), by reason:
- *A recurrent state instead of, or beside, per-token keys/values*: state-space models (Mamba, Mamba-2,
  Falcon-Mamba), RWKV and xLSTM (their own state objects), and the hybrids (Jamba, Bamba, Falcon-H1, Zamba2,
  Granite 4 hybrid, Nemotron-H, LFM2, Qwen3-Next, Qwen3.5, RecurrentGemma, MiniMax, Kimi Linear). The state after a
  prefix summarises all of it in a fixed-size tensor, so a cached prefix cannot be reused block by block nor
  a chunk moved; serving them needs a snapshot of every recurrent layer's state per cached block, which the
  per-token pool does not hold.
- *A cache that is not per-head keys/values*: multi-head latent attention (DeepSeek-V2/V3, LongCat-Flash)
  caches the compressed latent.
- *A mask built inside the attention module*: Doge (its dynamic mask is computed from every cached token's
  values; the paged attention builds masks from positions).
- *Attention called more than once per layer*: DiffLlama (differential attention attends once per half of
  the values; each call would overwrite the other's values in the layer's one pool slot per token). Served
  before the routing probe counted calls, its logits were off by ~4.
- *Attention outside `AttentionInterface`*: Falcon, Bloom; GPT-J before transformers 5.24 (which routes it
  through the interface: served exactly since).
- *Not causal, or positions not taken from `position_ids`* (a probe of three two-token forwards when the
  engine is built, `check_causal_positions`): bidirectional encoders (BERT / ELECTRA without
  `is_decoder=True`, Gemma 3 / Gemma 4 unified text with `use_bidirectional_attention`), whose first token's
  logits change with the token after it, and the BART-family decoders (`BartForCausalLM`, mBART, Marian,
  Pegasus, PLBart, Blenderbot, Blenderbot-small, BigBird-Pegasus), which count positions from their cache and
  ignore the `position_ids` the packed forward passes. Served before the probe, both were wrong (logits off
  by 0.9-4 with nothing cached; BART's every cached prefix, decode step and batched request).
- *Cross-attention layers*: Mllama (Llama 3.2 Vision), whose cross-attention layers keep no keys/values for a
  text prompt (was a bare `AttributeError` when the engine was built).
- *No transformers `Cache` at all*: OpenAI GPT, XLNet, Reformer (their forwards take no cache argument, or
  a `cache` of their own type).

**Served with a capped context**: LongRoPE models (Phi-3-128k, Phi-3.5) up to their
`original_max_position_embeddings`. LongRoPE takes its short or long frequencies from the longest position of
each forward call, so a prefix cached by a short request is not what a long one computes (a 40-token prefix
reused by a 100-token prompt past a 64-token switch: logits off by ~6.5) and one packed step would rotate a short
request's keys with the long factors. Below the switch every forward uses the short factors and the engine is
exact; longer prompts get a `ContextLengthError` that says why. Llama 4 with attention temperature tuning is
capped below its `floor_scale` the same way.

Beyond the table, a one-off sweep (2026-11-28) built tiny models of 66 causal-LM model types that
transformers 5.24 registers and the table lacked (generic configs; Gemma 4, Qwen3.5 and Ministral 3 have rows
since; encoder-decoders and the multimodal Emu3 left out) and ran the
same checks. Nothing is served with a wrong answer since DiffLlama and Dory (looped layers) are declined for
calling attention more than once per layer (served, they were off by ~4 and 0.013). 38 were served exactly
(among them ExaONE and ExaONE-MoE, GLM, OLMo, Granite SWA, Hunyuan v1 MoE and v3, InternLM 3, Persimmon, VaultGemma,
FlexOlmo, Cohere 2 MoE, Cohere Compass, CodeGen, GPTBigCode, CTRL, BioGPT), 28 declined with one of the reasons above (MLA:
MiniCPM3, Youtu, DeepSeek-V3.2/V4; recurrent or hybrid layers: Qwen3.5, Zaya, Bailing hybrid, OLMo hybrid,
LFM2-MoE, LFM3; attention outside the interface: GPT-Neo, MPT, XGLM; no transformers `Cache`: OpenAI GPT; layers whose cache is not
plain keys/values: dots3's `indexed_attention`, a sparse-attention indexer's keys beside them; ...). Cohere
Compass and dots3, first left unchecked because the generic tiny config did not run in plain transformers,
were checked with configs that do (Cohere Compass needs `rope_parameters` per layer type, dots3 as many KV
heads as query heads).

A second sweep (2026-11-29, transformers 5.24, 139 variants of the 123 causal-LM model types the table
still lacked, the same checks; per variant in
[architectures_sweep_2026-11-29.md](architectures_sweep_2026-11-29.md)) found 53 served exactly, 58
declined, 14 wrong or crashing and 14 whose generic tiny config does not run in plain transformers; the 14
wrong or crashing are fixed since: the BART family and the bidirectional configs are declined by the causal / position probe (rows
`bart`, `bert`, `gemma3-bidirectional`), Mllama's cross-attention layers are declined (row `mllama`), and
Beam, whose full-attention layers carry no RoPE parameters, no longer crashes the key re-rotation's set-up
and is served exactly (row `beam`). Ernie with `is_decoder=True` and the RoBERTa family stay declined:
their forwards annotate `cache` as a list of tensors (Ernie) or a tuple of tuples (RoBERTa), not a
transformers `Cache`, and RoBERTa's own forward and `generate` take different positions.

The unit tests cover Llama, Qwen2, Mistral, Gemma 2/3, StableLM, gpt-oss, GPT-NeoX and GPT-2 (exactness,
batching, stitching), chunked attention (Llama 4), Gemma 4 (dense, 31B-style, MoE: exactness and batching;
stitching, moved keys), KV shared across layers (Gemma 3n, Gemma 4 E2B-style: exactness, batching, stitching,
the producer map against transformers' own, a probe that declines a shared layer passed other keys) and
Cohere 2's NoPE layers (`test_architectures_extra.py`),
and a representative of every decline reason; the paths of the second table are tested on those plus Phi-3,
SmolLM3, Cohere, Gemma 4 and both KV-shared models (kvb-cache: live KV, hf_bridge, disk tier; kvboost: speculative through the engine;
kvb-speculative: sliding-window rollback).

"""

_PATHS_HEADER = """## Other engine paths

Per served architecture (`tools/arch_paths.py`). **Live KV**: a request with `kv_cache_bits=8` / `4` after a
32-token cached prefix (its working cache KIVI-quantized through transformers' `QuantizedLayer`): the max
|logit| deviation from the unquantized run over 12 teacher-forced decode steps, the free-running greedy
tokens that match unquantized (of 12; small logit margins of random models make this noisy), and the logit
scale; every engine run equals a plain greedy loop over the same quantized cache (else *WRONG*). A MoE
router that picks another expert at one step shows as a jump (Qwen2-MoE, PhiMoE, Llama 4 at 8 bits); StableLM's free-running
tokens part at a step whose top-2 logits are 0.002 apart (teacher-forced, 11 of 12 agree). **Speculative**: greedy
through the engine with a prompt-lookup drafter and with a draft model of the same architecture and other
weights, against `model.generate` (16 tokens, from a cached prefix; the prompt ends with the start of its
repeated phrase, so prompt lookup drafts from the first step; accepted/drafted shows that rollbacks ran, and a
check that drafted nothing is a problem). **hf_bridge**: `lookup_cache` of a 40-token engine prefix into `model.generate` (tokens and the max
logit difference over its 12 steps), then `store_cache` of a plain forward's KV hit by the engine.
**Disk tier**: 48 tokens stored, evicted from a 12-block pool by three other prompts and reloaded from the
disk tier; `kv_cache_bits` 16 records must be exact, 8 / 4 are KIVI records (the pool itself holds KV as
computed).

"""

if __name__ == "__main__":
    main()
