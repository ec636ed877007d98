"""Tiny random models and a local tokenizer: no hub, no embedded model, seconds per test."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tokenizers import Tokenizer, models, pre_tokenizers

from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.store import ChunkEntry

VOCAB = 300
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
)
ARCHITECTURES = {
    "llama": lambda: T.LlamaConfig(**_COMMON),
    "qwen2": lambda: T.Qwen2Config(**_COMMON),
    "mistral": lambda: T.MistralConfig(**_COMMON, sliding_window=24),
    "gemma2": lambda: T.Gemma2Config(**_COMMON, head_dim=16, sliding_window=24),
    "gemma3": lambda: T.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=24),
    # The decoder layer drops extra keyword arguments on the way to attention; partial rotary.
    "stablelm": lambda: T.StableLmConfig(**_COMMON),
    # Attention sinks (a learned per-head logit in every softmax), alternating sliding/full layers, MoE.
    "gpt_oss": lambda: T.GptOssConfig(
        **_COMMON, head_dim=16, sliding_window=24, num_local_experts=4, num_experts_per_tok=2
    ),
    # No num_key_value_heads in the config; rotary on a quarter of the channels.
    "gpt_neox": lambda: T.GPTNeoXConfig(
        **{k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}, rotary_pct=0.25
    ),
    "gpt2": lambda: T.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=1,
    ),
}


def gemma4_config(**overrides) -> T.Gemma4TextConfig:
    """Six layers, five sliding (window 24) and a global one with a wider head (Gemma 4's pattern), tiny; any
    field can be overridden."""
    return T.Gemma4TextConfig(
        **{
            **_COMMON,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "global_head_dim": 32,
            "sliding_window": 24,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": VOCAB,
            **overrides,
        }
    )


def bart_config() -> T.BartConfig:
    """A tiny BART; ``AutoModelForCausalLM`` builds its decoder alone (``BartForCausalLM``), which counts
    positions from its cache (the engine declines it)."""
    return T.BartConfig(
        d_model=64,
        decoder_layers=2,
        encoder_layers=2,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=128,
        encoder_ffn_dim=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        init_std=0.2,
    )


def beam_config() -> T.BeamConfig:
    """Beam: five sliding-window layers and a full-attention one without RoPE parameters (NoPE), MoE MLPs."""
    return T.BeamConfig(
        **{**_COMMON, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=24,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 5,
    )


def mllama_config() -> T.MllamaConfig:
    """Llama 3.2 Vision, tiny: four text layers, the second a cross-attention layer (no keys for text)."""
    return T.MllamaConfig(
        text_config=dict(
            **{**_COMMON, "num_hidden_layers": 4}, cross_attention_layers=[1], pad_token_id=0, eos_token_id=1
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_global_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vision_output_dim=64,
            image_size=56,
            patch_size=14,
            intermediate_layers_indices=[0],
        ),
    )


#: More structurally different configs, for the per-path checks (live quantization, hf_bridge, disk tier):
#: kept out of ``ARCHITECTURES`` so the suites parametrized over it do not grow.
MORE_ARCHITECTURES = {
    # Fused QKV projection.
    "phi3": lambda: T.Phi3Config(**_COMMON, pad_token_id=0),
    # Interleaved RoPE, parallel attention/MLP block, a LayerNorm without bias.
    "cohere": lambda: T.CohereConfig(**_COMMON, pad_token_id=0),
    # No RoPE on every 4th layer (NoPE).
    "smollm3": lambda: T.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4}, pad_token_id=0),
    # Five sliding layers and a global one with its own head size and proportional RoPE (a quarter of the
    # channels rotate, tables span the whole head), per-layer input embeddings, a one-tensor
    # apply_rotary_pos_emb.
    "gemma4": lambda: gemma4_config(),
    # Gemma 4 E2B / E4B: the last two layers attend to the keys/values of the last earlier layer of their
    # type (no cache of their own).
    "gemma4_kv_shared": lambda: gemma4_config(
        num_hidden_layers=8,
        num_kv_shared_layers=2,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
    ),
    # Gemma 3n: KV shared the same way, AltUp and LAuReL blocks, per-layer inputs.
    "gemma3n": lambda: T.Gemma3nTextConfig(
        **{**_COMMON, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=24,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,
        laurel_rank=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4,
    ),
}
#: A representative subset for the per-path checks: RoPE variants, sliding/hybrid windows, sinks, fused
#: and partial projections, NoPE layers and absolute positions.
PATH_ARCHITECTURES = (
    "llama",
    "qwen2",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt_neox",
    "stablelm",
    "gpt_oss",
    "smollm3",
    "cohere",
    "gemma4",
    "gemma4_kv_shared",
    "gemma3n",
    "gpt2",
)

#: Architectures whose SDPA path transformers lacks (soft-capping, sinks).
_EAGER = frozenset({"gemma2", "gpt_oss"})


def make_tokenizer() -> T.PreTrainedTokenizerFast:
    """Word-level tokenizer: ``w0 .. w{N}`` plus a few specials; decodes with spaces."""
    specials = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = [f"w{i}" for i in range(VOCAB - len(specials))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": specials[2:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(arch: str, seed: int = 0) -> T.PreTrainedModel:
    torch.manual_seed(seed)
    config = {**ARCHITECTURES, **MORE_ARCHITECTURES}[arch]()
    config.eos_token_id = 1
    config.pad_token_id = 0
    model = T.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager" if arch in _EAGER else "sdpa"
    )
    return model.eval()


def words(n: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 10, (n,), generator=g))


def reply_text(
    tokenizer: T.PreTrainedTokenizerBase, prompt: str, ids: list[int], *, skip_special_tokens: bool = True
) -> str:
    """The text of the reply ``ids`` as it reads after ``prompt`` (what the engine returns): with this
    word-level tokenizer, a space before each word, the first included."""
    context = tokenizer(prompt)["input_ids"]
    full = tokenizer.decode(context + list(ids), skip_special_tokens=skip_special_tokens)
    return full[len(tokenizer.decode(context, skip_special_tokens=skip_special_tokens)) :]


def rag_prompts(tokenizer: T.PreTrainedTokenizerFast) -> tuple[list[int], list[int]]:
    """The same three documents in two orders after a shared system prompt, then different questions: the
    second prompt stitches the first one's chunks."""
    docs = [tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3)]
    system = tokenizer(words(20, seed=9))["input_ids"]
    first = system + docs[0] + docs[1] + docs[2] + tokenizer(words(6, seed=7))["input_ids"]
    second = system + docs[2] + docs[0] + docs[1] + tokenizer(words(6, seed=8))["input_ids"]
    return first, second


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # 64-wide matmuls gain nothing from intra-op threads; on shared CI cores they oversubscribe (measured:
    # a speculative test 6-12 s with the default threads, 0.5-0.8 s with one).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer() -> T.PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama() -> T.PreTrainedModel:
    return make_model("llama")


class ListedStore:
    """A store stand-in whose ``by_content`` lists copies in insertion order (the test controls which comes
    first)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, list[ChunkEntry]] = {}

    def add(self, root, tokens, key, parent, *, derived=False):
        entry = ChunkEntry(
            key=ChunkHash(key),
            parent=ChunkHash(parent),
            content=content_hash(root, tokens),
            token_ids=tuple(tokens),
            start=0,
            derived=derived,
        )
        self.entries.setdefault(entry.content, []).append(entry)
        return entry

    def by_content(self, content):
        return list(self.entries.get(content, ()))

    def touch(self, entry):
        pass
