"""``kvboost.KVBoost.from_pretrained`` composes kvb-speculative; ``kvboost cache`` comes from kvb-cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from tokenizers import Tokenizer, models, pre_tokenizers

from kvboost import KVBoost
from kvboost.cli import main

VOCAB = 200


def _save_tiny_model(folder: Path, seed: int) -> Path:
    """A tiny random Llama and a word-level tokenizer (``w0 .. w194``), saved like a hub checkpoint."""
    specials = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    config = T.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=1,
        pad_token_id=0,
    )
    T.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("draft"), seed=1)


# A prompt that repeats itself, so prompt lookup finds n-grams to draft from.
PROMPT = " ".join(["w5 w6 w7 w8 w9 w10 w11 w12"] * 6)


def test_without_speculative_no_drafter(target):
    engine = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    assert engine.drafter is None
    assert engine.speculative_stats() is None
    assert "speculative" not in engine.cache_stats()


@pytest.mark.parametrize("mode", ["prompt_lookup", "draft_model"])
def test_speculative_output_equals_plain_greedy(target, other, mode):
    plain = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    expected = plain.generate(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True).output_ids
    draft = str(other) if mode == "draft_model" else None
    spec = KVBoost.from_pretrained(
        str(target), device="cpu", chunk_size=8, speculative=mode, draft_model=draft, gamma=4
    )
    got = spec.generate(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True).output_ids
    assert got == expected
    stats = spec.cache_stats()["speculative"]
    assert stats["gamma"] == 4
    assert stats["rounds"] + stats["plain_steps"] > 0
    assert stats["committed_tokens"] >= 24
    json.dumps(stats)


def test_speculation_is_logged_at_start(target, other, caplog):
    """kvboost serve's startup log said only "engine composed by kvboost"; nothing showed the flag took."""
    with caplog.at_level("INFO", logger="kvboost.compose"):
        KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8, speculative="prompt_lookup", gamma=4)
        KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8, draft_model=str(other), gamma=3)
        KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    said = [r.getMessage() for r in caplog.records if r.name == "kvboost.compose"]
    assert said == [
        "speculative decoding on: prompt_lookup, gamma 4",
        f"speculative decoding on: draft_model ({other}), gamma 3",
    ]


def test_a_loaded_draft_model_is_accepted(target, other):
    """draft_model may be a loaded model (documented): it always failed with VocabularyMismatchError
    ("pass both target_tokenizer and draft_tokenizer, or neither") because only the target's was passed."""
    plain = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    expected = plain.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True).output_ids
    draft = T.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    spec = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8, draft_model=draft, gamma=3)
    assert spec.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True).output_ids == expected
    assert spec.speculative_stats()["drafted_tokens"] > 0


@pytest.mark.parametrize("bad", [123, torch.nn.Linear(2, 2)])
def test_a_draft_model_of_the_wrong_type_is_a_typed_error(target, bad):
    """It failed inside kvb_speculative with AttributeError ('... has no attribute get_output_embeddings')."""
    from kvb_speculative import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="PreTrainedModel"):
        KVBoost.from_pretrained(str(target), device="cpu", draft_model=bad)


def test_draft_model_equal_to_target_accepts_every_draft(target):
    spec = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8, draft_model=str(target), gamma=3)
    spec.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    stats = spec.speculative_stats()
    assert stats["drafted_tokens"] > 0
    assert stats["acceptance_rate"] == 1.0


def test_unknown_speculative_mode_is_a_typed_error(target):
    from kvb_speculative import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="unknown"):
        KVBoost.from_pretrained(str(target), device="cpu", speculative="medusa")


def test_gamma_without_speculative_is_a_typed_error(target):
    """gamma alone was accepted and silently ignored (no drafter was built); streaming options without
    awq_streaming already raise the same way."""
    from kvb_speculative import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="gamma=3 has no effect"):
        KVBoost.from_pretrained(str(target), device="cpu", gamma=3)
    assert KVBoost.from_pretrained(str(target), device="cpu", gamma=5).drafter is None  # the default


def test_cache_status_cli_reads_a_disk_tier(target, tmp_path, capsys):
    engine = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8, disk_cache_dir=tmp_path)
    engine.generate(PROMPT, max_new_tokens=2, temperature=0.0)
    engine.flush()  # write-behind: wait for the disk writes
    assert main(["cache", "status", "--disk-cache-dir", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    namespaces = report["disk"]["namespaces"]
    assert len(namespaces) == 1
    (entry,) = namespaces.values()
    # Every full block the request computed was written behind to disk (partial tails stay in RAM).
    assert entry["entries"] == engine.kv.pool.registrations >= len(PROMPT.split()) // 16


def test_cache_status_without_a_tier_is_an_error_exit(capsys):
    assert main(["cache", "status"]) == 2
    assert "--disk-cache-dir" in capsys.readouterr().err


def test_recompute_strategy_turns_stitching_on(target):
    from kvboost import ConfigError

    assert KVBoost.from_pretrained(str(target), device="cpu").config.stitching is None
    engine = KVBoost.from_pretrained(str(target), device="cpu", recompute_strategy="selective")
    assert engine.config.stitching.recompute_strategy == "selective"
    from kvb_cache import StitchConfig

    with pytest.raises(ConfigError, match="contradicts"):
        KVBoost.from_pretrained(
            str(target),
            device="cpu",
            recompute_strategy="none",
            stitching=StitchConfig(recompute_strategy="cacheblend"),
        )
    with pytest.raises(ConfigError, match="recompute_strategy"):
        KVBoost.from_pretrained(str(target), device="cpu", recompute_strategy="bogus")


def test_a_draft_model_path_that_cannot_load_is_named_before_the_target_loads(target, monkeypatch, tmp_path):
    """The draft's load error read like the target's and came only after the target had loaded."""
    import kvb_cache

    def no_target_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the draft path was checked")

    monkeypatch.setattr(kvb_cache.KVBoost, "from_engine_args", classmethod(no_target_load))
    with pytest.raises(
        kvb_cache.ModelLoadError, match=r"^draft_model \(--draft-model\): model path .* does not exist"
    ):
        KVBoost.from_pretrained(
            target, device="cpu", speculative="draft_model", draft_model=str(tmp_path / "nope")
        )


def test_draft_model_mode_without_a_draft_is_refused_before_the_target_loads(target, monkeypatch):
    import kvb_cache
    from kvb_speculative import SpeculativeConfigError

    def no_target_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the missing draft was noticed")

    monkeypatch.setattr(kvb_cache.KVBoost, "from_engine_args", classmethod(no_target_load))
    with pytest.raises(SpeculativeConfigError, match=r"needs draft_model \(--draft-model\)"):
        KVBoost.from_pretrained(target, device="cpu", speculative="draft_model")
    # Also said only after the target (and the draft) had loaded: gamma past 64, a draft with prompt_lookup.
    with pytest.raises(SpeculativeConfigError, match=r"gamma=1000 \(--gamma, .*\) must be in 1\.\.64"):
        KVBoost.from_pretrained(target, device="cpu", speculative="prompt_lookup", gamma=1000)
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup' uses no draft model"):
        KVBoost.from_pretrained(target, device="cpu", speculative="prompt_lookup", draft_model=target)
    with pytest.raises(SpeculativeConfigError, match="'foo' is unknown"):
        KVBoost.from_pretrained(target, device="cpu", speculative="foo")


def test_vllms_speculative_config_sets_the_speculative_options(target, other):
    """vLLM's ``--speculative-config`` JSON (refused before): ngram is prompt lookup, num_speculative_tokens
    gamma, prompt_lookup_max / _min the n-gram lengths, model a draft model."""
    from kvboost.args import SpeculativeArgs

    args = SpeculativeArgs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 1}'
    )
    assert (args.speculative, args.gamma, args.prompt_lookup_max, args.prompt_lookup_min) == (
        "prompt_lookup",
        4,
        5,
        1,
    )
    draft = SpeculativeArgs(speculative_config={"model": str(other), "num_speculative_tokens": 3})
    assert (draft.speculative, draft.draft_model, draft.gamma) == ("draft_model", str(other), 3)
    assert SpeculativeArgs(speculative_config={"model": "[ngram]"}).speculative == "prompt_lookup"
    engine = KVBoost.from_pretrained(
        str(target),
        device="cpu",
        chunk_size=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    plain = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    want = plain.generate(PROMPT, max_new_tokens=16, ignore_eos=True).output_ids
    assert engine.generate(PROMPT, max_new_tokens=16, ignore_eos=True).output_ids == want
    stats = engine.cache_stats()["speculative"]
    assert stats["gamma"] == 3 and stats["drafted_tokens"] > 0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "eagle", "model": "x"}, "method 'eagle' is not served here"),
        (
            {"method": "ngram", "disable_by_batch_size": 4},
            "key 'disable_by_batch_size' .* is refused: speculation inside the batched step is not turned off",
        ),
        ({"method": "ngram", "draft_tensor_parallel_size": 2}, r"one device \(accepted: 1\)"),
        ({"method": "ngram", "foo": 1}, "'foo' .* not one of vLLM's keys served here"),
        ({"method": "NGRAM"}, r"'NGRAM' is not served here \(unknown method\)"),
        ({"method": ["ngram"]}, r"\(not a string\)"),  # was a TypeError traceback (unhashable list)
        ({"method": "ngram", "enforce_eager": False}, r"runs eagerly \(accepted: true\)"),
        ({"method": "suffix"}, "suffix decoding"),
        ({"method": "ngram", "model": "/x"}, "takes no model"),
        (
            {"num_speculative_tokens": 100},
            r"num_speculative_tokens in --speculative-config\) must be in 1..64",
        ),
        (
            {"prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "prompt_lookup_min=4 is above prompt_lookup_max=3",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "5"}, "num_speculative_tokens must be an int >= 1"),
    ],
)
def test_a_speculative_config_this_server_cannot_serve_is_refused_naming_why(config, match):
    from kvb_speculative import SpeculativeConfigError
    from kvboost.args import SpeculativeArgs

    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeArgs(speculative_config=config)


def test_speculative_config_and_its_own_flags_are_given_once(target):
    from kvb_speculative import SpeculativeConfigError
    from kvboost.args import SpeculativeArgs

    with pytest.raises(
        SpeculativeConfigError, match=r"sets \['gamma', 'speculative'\], which were also given"
    ):
        SpeculativeArgs(
            speculative="prompt_lookup", gamma=3, speculative_config={"num_speculative_tokens": 4}
        )
    with pytest.raises(SpeculativeConfigError, match="apply to speculative='prompt_lookup' only"):
        KVBoost.from_pretrained(str(target), device="cpu", draft_model=str(target), prompt_lookup_max=5)
    # Said in the names typed (kvb-speculative's own message named its max_ngram / min_ngram parameters).
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_min=4 is above prompt_lookup_max=3"):
        KVBoost.from_pretrained(str(target), device="cpu", speculative="prompt_lookup", prompt_lookup_min=4)


def test_speculative_config_follows_vllm_where_it_says_nothing_against():
    """vLLM: one n-gram bound given, the other equals it; keys asking for what is done anyway are accepted;
    kvb-speculative's own method name is taken."""
    from kvboost.args import SpeculativeArgs

    only_max = SpeculativeArgs(speculative_config={"method": "ngram", "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeArgs(speculative_config={"prompt_lookup_min": 4})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (4, 4)
    kept = SpeculativeArgs(prompt_lookup_min=1, speculative_config={"prompt_lookup_max": 4})
    assert (kept.prompt_lookup_min, kept.prompt_lookup_max) == (1, 4)  # the flag given stays
    satisfied = SpeculativeArgs(
        speculative_config={
            "method": "prompt_lookup",
            "draft_tensor_parallel_size": 1,
            "enforce_eager": True,
            "acceptance_method": "rejection_sampler",
        }
    )
    assert satisfied.speculative == "prompt_lookup" and satisfied.gamma == 5


def test_kvboost_serve_takes_vllms_speculative_config_flag():
    from kvb_cache.options import from_namespace
    from kvboost.args import SpeculativeArgs
    from kvboost.cli import build_parser

    argv = ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    args = from_namespace(SpeculativeArgs, build_parser().parse_args(argv))
    assert (args.speculative, args.gamma) == ("prompt_lookup", 4)
