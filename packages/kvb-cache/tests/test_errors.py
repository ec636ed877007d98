"""Bad input raises typed errors that say what to change; a failed request leaves the cache usable."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, words
from transformers.utils import is_flash_attn_2_available

from kvb_cache import (
    ConfigError,
    ContextLengthError,
    EngineConfig,
    InvalidRequestError,
    KVBoost,
    KVBoostError,
    ModelLoadError,
    PromptTypeError,
    StitchConfig,
    UnsupportedModelError,
)


@pytest.fixture()
def engine(llama, tokenizer):
    return KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate("")
    with pytest.raises(InvalidRequestError):
        engine.generate([])


@pytest.mark.parametrize("prompt", [None, 42, {"text": "w1"}, [1, "2"], [True]])
def test_non_string_prompt(engine, prompt):
    with pytest.raises(PromptTypeError, match="prompt must be"):
        engine.generate(prompt)


def test_token_id_tensors_and_numpy_ints_are_prompts_like_lookup_cache_takes(engine, tokenizer):
    """``tokenizer(text, return_tensors="pt")["input_ids"]`` (a [1, S] tensor) and lists of numpy ints were
    refused ("got Tensor", "got list": the list itself named as the problem) while lookup_cache took them."""
    text = words(20)
    expected = engine.generate(text, max_new_tokens=4).output_ids
    as_tensor = tokenizer(text, return_tensors="pt")["input_ids"]
    as_numpy = tokenizer(text, return_tensors="np")["input_ids"]
    for prompt in (as_tensor, as_tensor[0], as_numpy, list(as_numpy[0])):
        assert engine.generate(prompt, max_new_tokens=4).output_ids == expected
    with pytest.raises(PromptTypeError, match=r"prompt\[0\] is float"):
        engine.generate(as_tensor.float())
    with pytest.raises(PromptTypeError, match=r"1-D or \[1, S\].*generate_batch"):
        engine.generate(torch.cat([as_tensor, as_tensor]))


def test_rows_of_a_padded_batch_are_refused_naming_the_fix(engine, tokenizer):
    """A row of ``tokenizer(texts, padding=True, return_tensors="pt")`` fed its pad tokens as text (the answer
    changed, no error; ``model.generate`` masks them): refused, left or right padded, tensor or array. Plain
    lists of ids stay raw ids (the server's token-id prompts), and a tokenizer whose pad token is its EOS
    token is not second-guessed."""
    texts = [words(12, seed=1), words(4, seed=2)]
    for side, match in (("left", "starts with 8 padding"), ("right", "ends with 8 padding")):
        tokenizer.padding_side = side
        try:
            batch = tokenizer(texts, padding=True, return_tensors="pt")
            numpy_batch = tokenizer(texts, padding=True, return_tensors="np")
        finally:
            tokenizer.padding_side = "right"
        for prompt in (batch["input_ids"][1:2], batch["input_ids"][1], numpy_batch["input_ids"][1]):
            with pytest.raises(PromptTypeError, match=match + r".*attention_mask\.bool\(\)"):
                engine.generate(prompt, max_new_tokens=2)
        with pytest.raises(PromptTypeError, match="padding"):
            engine.generate_batch(list(batch["input_ids"]), max_new_tokens=2)
        row = batch["input_ids"][1][batch["attention_mask"][1].bool()]
        assert (
            engine.generate(row, max_new_tokens=4).output_ids
            == engine.generate(texts[1], max_new_tokens=4).output_ids
        )
        assert engine.generate(batch["input_ids"][1].tolist(), max_new_tokens=2).prompt_tokens == 12
    # A pad token the generation config names as an end-of-sequence id (Qwen2.5's <|endoftext|>) may be
    # content: transformers' generate does not mask it either.
    ends_in_pad = torch.tensor([*tokenizer(texts[1])["input_ids"], tokenizer.pad_token_id])
    config_eos = engine.model.generation_config.eos_token_id
    engine.model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    try:
        assert engine.generate(ends_in_pad, max_new_tokens=2).prompt_tokens == 5
    finally:
        engine.model.generation_config.eos_token_id = config_eos
    eos_padded = torch.tensor([tokenizer.eos_token_id, *tokenizer(texts[1])["input_ids"]])
    pad = tokenizer.pad_token
    tokenizer.pad_token = tokenizer.eos_token
    try:
        assert engine.generate(eos_padded, max_new_tokens=2).prompt_tokens == 5
    finally:
        tokenizer.pad_token = pad


def test_out_of_vocabulary_token_ids(engine):
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.generate([1, 2, 10_000])


def test_context_overflow_says_how_much_fits(engine, tokenizer):
    prompt = words(500)
    with pytest.raises(ContextLengthError) as info:
        engine.generate(prompt, max_new_tokens=100)
    assert info.value.context_length == 512 and info.value.prompt_tokens == 500
    assert "lower max_new_tokens to 12" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVBoostError)


def test_context_overflow_by_the_prompt_alone_names_a_fix_that_works(engine):
    # The prompt alone fills the context: lowering max_new_tokens cannot help (it must be >= 1), so the
    # message must not say "lower max_new_tokens to 0".
    with pytest.raises(ContextLengthError) as info:
        engine.generate([5] * 600, max_new_tokens=8)
    assert "max_new_tokens to 0" not in str(info.value)
    assert "shorten the prompt to at most 504 tokens" in str(info.value)
    with pytest.raises(ContextLengthError) as info:
        engine.prompt_logprobs([5] * 600)
    assert "shorten the prompt to at most 512 tokens" in str(info.value)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_wider_than_64_bits_is_a_typed_error(engine, seed):
    # torch.Generator.manual_seed raised a bare ValueError ("Overflow when unpacking long long").
    with pytest.raises(InvalidRequestError, match="seed must fit in 64 bits") as info:
        engine.generate("w1 w2", max_new_tokens=2, temperature=1.0, seed=seed)
    assert info.value.param == "seed"
    # The 64-bit extremes are valid seeds.
    for ok in (2**64 - 1, -(2**63)):
        assert (
            len(
                engine.generate(
                    "w1 w2", max_new_tokens=2, temperature=1.0, seed=ok, ignore_eos=True
                ).output_ids
            )
            == 2
        )


def test_stop_must_be_strings(engine):
    with pytest.raises(PromptTypeError):
        engine.generate("w1 w2", stop=3)
    with pytest.raises(InvalidRequestError):
        engine.generate("w1 w2", stop=[""])


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        KVBoost.from_pretrained(str(tmp_path / "no-such-model"), device="cpu")


def test_a_path_that_is_no_model_folder_says_why(tmp_path):
    """transformers' own messages misled: a folder without config.json read "Couldn't instantiate the backend
    tokenizer", a GGUF file "the config file ... is not a valid JSON file"."""
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        KVBoost.from_pretrained(str(tmp_path), device="cpu")
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"is a GGUF file.*gguf_file="):
        KVBoost.from_pretrained(str(gguf), device="cpu")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        KVBoost.from_pretrained(str(tmp_path / "weights.bin"), device="cpu")


def test_pickle_only_weights_are_refused_never_unpickled(tmp_path, llama, tokenizer, monkeypatch):
    """A folder with only pytorch_model.bin was loaded through torch.load (weights_only, still an
    unpickler): refused before anything is read, naming the conversion to safetensors."""
    llama.save_pretrained(tmp_path)  # transformers 5 writes safetensors only: make it an old checkpoint
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    torch.save(llama.state_dict(), tmp_path / "pytorch_model.bin")
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "pytorch_model.bin").exists() and not list(tmp_path.glob("*.safetensors"))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ModelLoadError, match=r"pickle files \(pytorch_model\.bin\).*safetensors"):
        KVBoost.from_pretrained(str(tmp_path), device="cpu")


def test_a_hub_id_missing_from_the_local_cache_is_not_fetched(monkeypatch):
    """The documented contract is "a hub id already in the local cache": the loader went to the hub
    (offline: five retries, ~45 s) and then blamed the internet connection."""
    import transformers

    seen = []

    def tokenizer_from_pretrained(path, **kwargs):
        seen.append(kwargs)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from_pretrained)
    with pytest.raises(ModelLoadError, match="neither a local folder nor a hub id in the local") as info:
        KVBoost.from_pretrained("some-org/some-model", device="cpu")
    assert seen == [{"local_files_only": True, "trust_remote_code": False}]
    assert "huggingface.co" not in str(info.value)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_a_device_this_torch_lacks_is_a_config_error_before_loading():
    """device='mps' on a torch without MPS used to load the weights, then fail in model.to() with an untyped
    RuntimeError; the path is not even read now."""
    with pytest.raises(ConfigError, match="no mps support; use device='cpu'"):
        KVBoost.from_pretrained("/nonexistent", device="mps")


def test_an_attention_implementation_whose_package_is_missing_is_a_model_load_error(
    llama, tokenizer, tmp_path
):
    """flash_attention_2 without flash-attn escaped as transformers' bare ImportError."""
    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="attn_implementation='sdpa'"):
        KVBoost.from_pretrained(str(tmp_path), device="cpu", attn_implementation="flash_attention_2")


def test_a_checkpoint_that_needs_its_own_code_is_refused_without_asking(
    llama, tokenizer, tmp_path, monkeypatch
):
    """transformers asked on stdin whether to run a checkpoint's auto_map code (a server start waited 15 s
    on it; answering y ran the code) and then said to pass trust_remote_code=True, which KVBoost does not
    take."""
    import json

    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "not_in_transformers"
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.X"}
    (tmp_path / "config.json").write_text(json.dumps(config))

    def no_prompt(*args):
        raise AssertionError("the load asked on stdin")

    monkeypatch.setattr("builtins.input", no_prompt)
    with pytest.raises(ModelLoadError, match=r"needs its own modeling code.*never runs") as info:
        KVBoost.from_pretrained(str(tmp_path), device="cpu")
    assert "trust_remote_code=True" not in str(info.value)


def _saved(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_broken_checkpoints_are_model_load_errors_naming_the_problem(tokenizer, tmp_path):
    """From an audit of bad folders: weights of other shapes (a traceback), missing layers (served with
    random weights), no tokenizer files (a hint to install sentencepiece), a tokenizer that is not the
    weights' (every request a 400 blaming the client)."""
    import json

    from safetensors.torch import load_file, save_file

    shapes = _saved(make_model("llama"), tokenizer, tmp_path / "shapes")
    config = json.loads((tmp_path / "shapes" / "config.json").read_text())
    config["intermediate_size"] += 8
    (tmp_path / "shapes" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"do the weights match its config.json"):
        KVBoost.from_pretrained(shapes, device="cpu")

    missing = _saved(make_model("llama"), tokenizer, tmp_path / "missing")
    weights = tmp_path / "missing" / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if ".layers.1." not in k}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack \d+ of the model's tensors \(model.layers.1"):
        KVBoost.from_pretrained(missing, device="cpu")

    bare = tmp_path / "bare"
    make_model("llama").save_pretrained(bare)
    with pytest.raises(ModelLoadError, match=r"holds no tokenizer.*--tokenizer"):
        KVBoost.from_pretrained(str(bare), device="cpu")

    small = make_model("llama")
    small.resize_token_embeddings(64)
    with pytest.raises(ModelLoadError, match=r"tokenizer has \d+ tokens and the model embeds only 64"):
        KVBoost.from_pretrained(_saved(small, tokenizer, tmp_path / "small"), device="cpu")


def test_added_tokens_past_the_embeddings_are_warned_and_refused_per_prompt(tokenizer, tmp_path, caplog):
    import copy

    extended = copy.deepcopy(tokenizer)
    extended.add_tokens(["brandnew"])
    assert len(extended) == len(tokenizer) + 1 and extended.vocab_size == make_model("llama").vocab_size
    folder = _saved(make_model("llama"), extended, tmp_path / "added")
    with caplog.at_level("WARNING", logger="kvb_cache.loading"):
        engine = KVBoost.from_pretrained(folder, device="cpu", chunk_size=16)
    assert "1 of them added past the model's" in caplog.text
    assert engine.generate("w1 w2", max_new_tokens=1).output_ids  # prompts without it are served
    with pytest.raises(InvalidRequestError, match=r"'brandnew'.*no embedding") as info:
        engine.generate("w1 brandnew", max_new_tokens=1)  # a bare IndexError from the embedding before
    assert info.value.param == "prompt"


def test_a_model_whose_forward_fails_is_a_model_load_error(tokenizer):
    model = make_model("llama")

    def broken(*args, **kwargs):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    model.forward = broken
    with pytest.raises(ModelLoadError, match=r"failed a one-token forward \(RuntimeError: The size"):
        KVBoost(model, tokenizer)


def test_bad_config_values():
    with pytest.raises(ConfigError, match="chunk_size"):
        EngineConfig(chunk_size=0)
    with pytest.raises(ConfigError, match="boundary_window"):
        EngineConfig(chunk_size=16, boundary_window=12)
    with pytest.raises(ConfigError, match="dtype"):
        KVBoost.from_pretrained("/nonexistent", dtype="float8")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"store_partial_tail": "false"}, "store_partial_tail must be True or False"),  # truthy: stayed on
        ({"store_partial_tail": None}, "store_partial_tail must be True or False"),  # falsy: turned it off
        ({"store_outputs": "no"}, "store_outputs must be True or False"),
        ({"max_cache_bytes": True}, "max_cache_bytes"),  # was a 1-byte pool and a 32-token context
        ({"boundary_window": True}, "boundary_window"),
    ],
)
def test_flags_and_sizes_of_the_wrong_type_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_what_the_constructor_is_given_is_checked_naming_the_fix(llama, tokenizer, tmp_path):
    """Each was a bare AttributeError / TypeError from inside the engine (tokenizer=None only after a forward
    had run): an audit, 2026-12-01."""
    from kvb_cache import EngineArgs

    with pytest.raises(ConfigError, match="from_pretrained"):
        KVBoost("smollm2", tokenizer)
    with pytest.raises(ConfigError, match="from_pretrained"):
        KVBoost(tmp_path, tokenizer)
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module"):
        KVBoost(object(), tokenizer)
    with pytest.raises(ConfigError, match="tokenizer object"):
        KVBoost(llama, str(tmp_path))
    with pytest.raises(ConfigError, match="tokenizer"):
        KVBoost(llama, None)
    with pytest.raises(ConfigError, match=r"args\.engine_config\(\)"):
        KVBoost(llama, tokenizer, config=EngineArgs(chunk_size=16))
    with pytest.raises(ConfigError, match=r"EngineConfig\(\*\*options\)"):
        KVBoost(llama, tokenizer, config={"chunk_size": 16})
    with pytest.raises(UnsupportedModelError, match="AutoModelForCausalLM"):
        KVBoost(llama.model, tokenizer)  # the base model: hidden states, no logits
    with torch.device("meta"):
        skeleton = type(llama)(llama.config)
    with pytest.raises(ModelLoadError, match="meta device"):
        KVBoost(skeleton, tokenizer)


def test_encoder_decoder_is_declined(tokenizer):
    import transformers as T

    model = T.T5ForConditionalGeneration(
        T.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=300)
    )
    with pytest.raises(UnsupportedModelError, match="decoder-only"):
        KVBoost(model, tokenizer)


_TINY = dict(hidden_size=32, num_attention_heads=2, vocab_size=300)


@pytest.mark.parametrize(
    ("make_config", "match"),
    [
        # Attention computed inside the module, not through transformers' AttentionInterface.
        (lambda T: T.FalconConfig(num_hidden_layers=1, **_TINY), "AttentionInterface"),
        (lambda T: T.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=300), "AttentionInterface"),
        # Multi-head latent attention: the cache holds the compressed latent, not per-head keys/values.
        (
            lambda T: T.DeepseekV3Config(
                **_TINY,
                num_hidden_layers=1,
                num_key_value_heads=2,
                intermediate_size=64,
                kv_lora_rank=16,
                q_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                n_group=1,
                topk_group=1,
            ),
            "latent",
        ),
    ],
    ids=["falcon", "bloom", "deepseek-v3-mla"],
)
def test_models_the_paged_pool_cannot_serve_are_declined(make_config, match, tokenizer):
    """Served anyway, these gave wrong logits (GPT-J, Falcon: the pool was never written) or crashed
    mid-request (Bloom, DeepSeek-V3): the engine now refuses them when it is built, naming why."""
    import transformers as T

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(make_config(T)).eval()
    with pytest.raises(UnsupportedModelError, match=match):
        KVBoost(model, tokenizer)


def test_gptj_is_declined_or_served_exactly(tokenizer):
    """GPT-J computed attention inside its module until transformers 5.24, which routes it through the
    AttentionInterface: declined before (the pool was never written: wrong logits), served exactly since."""
    import transformers as T

    torch.manual_seed(0)
    config = T.GPTJConfig(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tokenizer), rotary_dim=8)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    try:
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    except UnsupportedModelError as exc:
        assert "AttentionInterface" in str(exc)
        return
    ids = list(range(5, 60))
    engine.warm(ids[:40])
    got = engine.next_token_logits(ids)
    assert got.cached_tokens >= 32
    with torch.no_grad():
        torch.testing.assert_close(got.logits, model(torch.tensor([ids])).logits[0, -1], atol=1e-5, rtol=0)
    # Stitching is declined: its keys rotate (rotary_dim) inside its own module, which cannot re-position
    # them; the reason said "absolute position embeddings" (its config carries n_positions).
    stitched = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig()))
    reason = stitched.cache_stats()["stitching"]["declined_reason"]
    assert "rotary" in reason and "absolute" not in reason


def test_failure_midway_leaves_cache_consistent(tokenizer, monkeypatch):
    model = make_model("llama")
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    prompt = words(40)
    calls = {"n": 0}
    original = model.model.layers[1].forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated out of memory in layer 1")
        return original(*args, **kwargs)

    monkeypatch.setattr(model.model.layers[1], "forward", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(prompt, max_new_tokens=4)
    # Layer 0 wrote new KV into the pool, layer 1 did not: no block was indexed, every block was returned.
    stats = engine.paged_stats()
    assert (stats.blocks_cached, stats.blocks_used, engine.has_unfinished()) == (0, 0, False)
    monkeypatch.undo()
    reference = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        prompt, max_new_tokens=6, ignore_eos=True
    )
    assert engine.generate(prompt, max_new_tokens=6, ignore_eos=True).output_ids == reference.output_ids
    with torch.no_grad():
        assert engine.next_token_logits(prompt).cached_tokens == 39


def test_a_pool_smaller_than_the_context_is_said_at_load_time(llama, tokenizer, caplog):
    """The pool caps every request (and max_model_len) below the model's context; that was found out only
    from the first refusal."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kvb_cache.engine"):
        KVBoost(llama, tokenizer, config=EngineConfig(num_blocks=2, block_size=16))
    assert "the KV block pool holds 32 tokens, less than the context a request may take" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvb_cache.engine"):
        KVBoost(llama, tokenizer)
    assert "block pool holds" not in caplog.text


def test_max_model_len_holds_requests_below_the_models_context(llama, tokenizer):
    """vLLM's max_model_len: the engine's context (what the server reports as max_model_len) is the
    option's, a longer request gets a ContextLengthError naming the option, and a shorter one runs as
    without it (same tokens)."""
    plain = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    capped = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_model_len=64))
    assert plain.context_length == 512 and capped.context_length == 64
    prompt = words(40)
    assert (
        capped.generate(prompt, max_new_tokens=8).output_ids
        == plain.generate(prompt, max_new_tokens=8).output_ids
    )
    with pytest.raises(ContextLengthError, match="max_model_len=64") as info:
        capped.generate(prompt, max_new_tokens=40)
    assert info.value.context_length == 64


@pytest.mark.parametrize("value", [0, 1, -5, 2.5, True, "64"])
def test_max_model_len_must_be_a_length(value):
    with pytest.raises(ConfigError, match="max_model_len must be an int >= 2"):
        EngineConfig(max_model_len=value)


def test_max_model_len_above_the_models_context_is_refused(llama, tokenizer):
    """Positions past the model's window were never trained; vLLM refuses that too."""
    with pytest.raises(
        ConfigError, match=r"max_model_len=1024 \(--max-model-len\) exceeds the model's context of 512"
    ):
        KVBoost(llama, tokenizer, config=EngineConfig(max_model_len=1024))
    assert KVBoost(llama, tokenizer, config=EngineConfig(max_model_len=512)).context_length == 512


def test_max_model_len_above_the_declared_context_is_refused_before_the_weights_load(
    llama, tokenizer, tmp_path, monkeypatch
):
    """from_pretrained reads config.json first: a 70B checkpoint took minutes to load before the engine
    refused the option."""
    import transformers

    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before max_model_len was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(
        ConfigError, match=r"max_model_len=1024 \(--max-model-len\) exceeds the model's context of 512"
    ):
        KVBoost.from_pretrained(str(tmp_path), max_model_len=1024)
    monkeypatch.undo()
    assert KVBoost.from_pretrained(str(tmp_path), max_model_len=512).context_length == 512


def test_vllm_call_shapes_are_refused_naming_the_equivalent(engine):
    from kvb_cache import SamplingParams, UnknownOptionError

    with pytest.raises(UnknownOptionError, match="add_request"):
        engine.generate_batch(["w1 w2"], sampling_params=SamplingParams(max_new_tokens=2))
    with pytest.raises(PromptTypeError, match="generate_batch"):
        engine.generate(["w1 w2", "w3"], max_new_tokens=2)


def test_generate_and_stream_take_a_sampling_params_as_vllm_does(engine):
    """``llm.generate(prompt, SamplingParams(...))`` (vLLM's shape) was Python's TypeError (positionally) or
    an error naming add_request (by name)."""
    from kvb_cache import InvalidRequestError, SamplingParams

    params = SamplingParams(max_new_tokens=5, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    keywords = engine.generate(
        "w1 w2 w3", max_new_tokens=5, temperature=0.8, top_k=20, seed=7, ignore_eos=True
    )
    assert engine.generate("w1 w2 w3", params).output_ids == keywords.output_ids
    assert engine.generate("w1 w2 w3", sampling_params=params, priority=0).output_ids == keywords.output_ids
    events = list(engine.stream("w1 w2 w3", params))
    assert events[-1].result.output_ids == keywords.output_ids
    with pytest.raises(InvalidRequestError, match=r"not both \(got \['max_new_tokens'\]") as err:
        engine.generate("w1 w2", params, max_new_tokens=3)
    assert err.value.param == "sampling_params"
    with pytest.raises(InvalidRequestError, match=r"not both \(got \['temperature'\]"):
        engine.stream("w1 w2", params, temperature=0.5)
    import numpy as np

    with pytest.raises(InvalidRequestError, match=r"not both \(got \['top_k'\]"):  # compared without ==
        engine.generate("w1 w2", params, top_k=np.array([40, 50]))
    with pytest.raises(InvalidRequestError, match=r"must be a kvb_cache\.SamplingParams, got builtins\.dict"):
        engine.generate("w1 w2", {"max_new_tokens": 2})
