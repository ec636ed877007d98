"""Speculative decoding composed into the engine, on structurally different architectures: greedy output
equals plain greedy exactly, with a prompt-lookup drafter and with a draft model that is often wrong.

The engine prefills a cached prefix plus the prompt into its own cache and hands it to kvb-speculative's
decoder; a draft model keeps a ``DynamicCache(config=...)`` of its own, so sliding-window drafts (Mistral,
Gemma, gpt-oss) are cropped past their window (they raised ``CacheRollbackError`` before).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers as T
from test_compose import VOCAB
from tokenizers import Tokenizer, models, pre_tokenizers

from kvb_cache import EngineConfig
from kvb_speculative import make_decoder
from kvboost import KVBoost

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
#: name -> config: RoPE variants, (hybrid) sliding windows, sinks, fused / partial projections, NoPE layers,
#: absolute positions.
CONFIGS: dict[str, Callable[[], T.PretrainedConfig]] = {
    "llama": lambda: T.LlamaConfig(**_C),
    "qwen2": lambda: T.Qwen2Config(**_C),
    "mistral": lambda: T.MistralConfig(**_C, sliding_window=24),
    "gemma2": lambda: T.Gemma2Config(**_C, head_dim=16, sliding_window=24),
    "gemma3": lambda: T.Gemma3TextConfig(**_C, head_dim=16, sliding_window=24),
    "phi3": lambda: T.Phi3Config(**_C, pad_token_id=0),
    "gpt_neox": lambda: T.GPTNeoXConfig(
        **{k: v for k, v in _C.items() if k != "num_key_value_heads"}, rotary_pct=0.25
    ),
    "stablelm": lambda: T.StableLmConfig(**_C),
    "gpt_oss": lambda: T.GptOssConfig(
        **_C, head_dim=16, sliding_window=24, num_local_experts=4, num_experts_per_tok=2
    ),
    "smollm3": lambda: T.SmolLM3Config(**{**_C, "num_hidden_layers": 4}, pad_token_id=0),
    "cohere": lambda: T.CohereConfig(**_C, pad_token_id=0),
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=512),
}
#: No SDPA path in transformers (soft-capping, sinks).
_EAGER = frozenset({"gemma2", "gpt_oss"})
# A repeated phrase (prompt lookup finds n-grams) and a tail, 54 tokens: past the 24-token windows.
PROMPT = [*range(20, 28)] * 5 + [*range(100, 114)]
NEW = 20


def tiny(arch: str, seed: int) -> T.PreTrainedModel:
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    config.eos_token_id, config.pad_token_id = 1, 0
    impl = "eager" if arch in _EAGER else "sdpa"
    return T.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # 64-wide matmuls gain nothing from intra-op threads; on shared CI cores they oversubscribe (3x slower).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer() -> T.PreTrainedTokenizerFast:
    """Word-level ``w0 ..``: the engine only detokenizes here (prompts are ids)."""
    specials = ["<pad>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_speculative_greedy_equals_plain_greedy(arch, tokenizer):
    target, draft = tiny(arch, 0), tiny(arch, 1)  # a different draft: rejections every few tokens
    with torch.no_grad():
        plain = target.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    # min_ngram=1: the default 2-token n-grams may never recur in a random model's 20 tokens.
    for drafter in (make_decoder(target, min_ngram=1), make_decoder(target, draft_model=draft)):
        engine = KVBoost(target, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
        engine.warm(PROMPT[:32])  # the speculative request starts from a cached prefix
        # NOTE: counted from here: warm()'s one-token request drafted past its budget before the engine
        # passed max_new_tokens, which alone kept drafted_tokens > 0 for prompt lookup on some models.
        drafter.reset_stats()
        out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        assert out.cached_tokens == 32
        assert out.output_ids == plain, type(drafter.drafter).__name__
        assert drafter.speculative_stats().drafted_tokens > 0
    stats = drafter.speculative_stats()
    # The draft model's rejections were rolled back (past the window on Mistral and gpt-oss); Gemma's and
    # GPT-2's random drafts happen to agree with their targets on every drafted token here (GPT-2's one
    # rejection came from a last 1-token round, which the batched step's budget rule no longer drafts).
    assert stats.accepted_tokens < stats.drafted_tokens or arch.startswith(("gemma", "gpt2")), stats


@pytest.mark.parametrize(
    "bans",
    # Tokens of the unrestricted greedy reply (38 192 164 83 162 56 155 174 192 8 ...): both bans change it.
    [{"allowed_token_ids": [*range(20, 28), *range(100, 106)]}, {"bad_words_ids": [[192], [83, 162], [8]]}],
)
def test_speculative_decoding_keeps_vllm_token_bans(tokenizer, bans):
    """allowed_token_ids / bad_words_ids hold on every accepted draft token: speculative output equals the
    plain engine's (greedy), and no banned token appears."""
    target, draft = tiny("llama", 0), tiny("llama", 1)
    plain = KVBoost(target, tokenizer, config=EngineConfig(chunk_size=16))
    expected = plain.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, **bans).output_ids
    assert expected != plain.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).output_ids
    for drafter in (make_decoder(target, min_ngram=1), make_decoder(target, draft_model=draft)):
        engine = KVBoost(target, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
        out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, **bans)
        assert out.output_ids == expected, type(drafter.drafter).__name__
        assert drafter.speculative_stats().drafted_tokens > 0
    if "allowed_token_ids" in bans:
        assert set(expected) <= set(bans["allowed_token_ids"])
    else:
        assert {192, 8}.isdisjoint(expected)
        assert all(expected[i : i + 2] != [83, 162] for i in range(len(expected) - 1))


def test_a_target_drafting_for_itself_has_its_sampled_drafts_kept(tokenizer):
    """Unseeded sampled requests verify in the batched step; their drafts were read as point masses though
    the draft model sampled them, so a perfect draft had 1-23% of them kept (an audit, 2026-11-30). With the
    draft's distribution, ``min(1, p / q)`` keeps about all of them."""
    target = tiny("llama", 0)
    drafter = make_decoder(target, draft_model=target)
    engine = KVBoost(target, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    torch.manual_seed(0)
    outs = engine.generate_batch([PROMPT] * 4, temperature=1.0, max_new_tokens=NEW, ignore_eos=True)
    assert all(len(o.output_ids) == NEW for o in outs) and not engine.core.solo
    stats = drafter.speculative_stats()
    assert stats.drafted_tokens > 0 and stats.accepted_tokens / stats.drafted_tokens > 0.9, stats


def test_a_draft_whose_logits_overflow_costs_only_its_drafts(tokenizer):
    """A draft logit of +inf (fp16 overflow) made the draft's distribution NaN, and the p/q verdict then
    committed token 0 (72 of 80 tokens, a review, 2026-11-30): such drafts are verified as point masses."""
    target, draft = tiny("llama", 0), tiny("llama", 0)
    draft.lm_head.register_forward_hook(lambda m, i, out: out.index_fill(-1, torch.tensor([7]), float("inf")))
    engine = KVBoost(
        target, tokenizer, config=EngineConfig(chunk_size=16), drafter=make_decoder(target, draft_model=draft)
    )
    torch.manual_seed(0)
    outs = engine.generate_batch([PROMPT] * 4, temperature=1.0, max_new_tokens=NEW, ignore_eos=True)
    ids = [t for o in outs for t in o.output_ids]
    assert ids.count(0) <= 4, ids  # token 0 (<pad>) as often as plain sampling gives it: about never
