"""``seed`` and ``tokenizer`` (vLLM's ``--seed`` / ``--tokenizer``): from_pretrained seeds torch's global
generators after the load, and loads the tokenizer from another folder, refusing one the model cannot
embed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T
from conftest import make_tokenizer

from kvb_cache import ConfigError, EngineArgs, KVBoost, ModelLoadError


@pytest.fixture()
def model_dir(llama: T.PreTrainedModel, tokenizer: T.PreTrainedTokenizerFast, tmp_path: Path) -> Path:
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def sampled(engine: KVBoost) -> list[int]:
    # No request seed: the draw comes from torch's global generator.
    return engine.generate("w1 w2 w3", max_new_tokens=12, temperature=1.5).output_ids


def test_a_seeded_load_samples_the_same_tokens_after_every_load(model_dir: Path) -> None:
    first = sampled(KVBoost.from_pretrained(str(model_dir), device="cpu", seed=7))
    torch.manual_seed(123)  # whatever happened to the generator before the load
    again = sampled(KVBoost.from_pretrained(str(model_dir), device="cpu", seed=7))
    other = sampled(KVBoost.from_pretrained(str(model_dir), device="cpu", seed=8))
    assert first == again
    assert first != other  # 12 tokens at temperature 1.5 over 64 words: equal only by a fluke


@pytest.mark.parametrize("seed", [True, 1.5, "1", 2**64, -(2**63) - 1])
def test_a_seed_torch_would_not_take_is_a_config_error_before_loading(seed: object) -> None:
    with pytest.raises(ConfigError, match=r"seed must be an int in \[-2\*\*63, 2\*\*64\)"):
        KVBoost.from_pretrained("/nonexistent", device="cpu", seed=seed)  # type: ignore[arg-type]


def test_the_tokenizer_is_loaded_from_its_own_folder(
    llama: T.PreTrainedModel, tokenizer: T.PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    llama.save_pretrained(tmp_path / "weights-only")
    tokenizer.save_pretrained(tmp_path / "tok")
    with pytest.raises(ModelLoadError):  # the model folder alone has no tokenizer
        KVBoost.from_pretrained(str(tmp_path / "weights-only"), device="cpu")
    engine = KVBoost.from_pretrained(
        str(tmp_path / "weights-only"), device="cpu", tokenizer=str(tmp_path / "tok")
    )
    assert engine.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert engine.generate("w1 w2", max_new_tokens=3).completion_tokens == 3


def test_a_missing_tokenizer_folder_names_the_option(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer \(--tokenizer\) path .* does not exist"):
        KVBoost.from_pretrained(str(model_dir), device="cpu", tokenizer=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"tokenizer \(--tokenizer\) .* holds no tokenizer"):
        KVBoost.from_pretrained(str(model_dir), device="cpu", tokenizer=str(tmp_path / "empty"))


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(model_dir: Path, tmp_path: Path) -> None:
    """Its extra ids would index past the embedding table in the first forward (a bare IndexError)."""
    bigger = make_tokenizer()
    bigger.add_tokens([f"extra{i}" for i in range(8)])
    bigger.save_pretrained(tmp_path / "bigger")
    with pytest.raises(ModelLoadError, match=r"has \d+ tokens and the model embeds only \d+"):
        KVBoost.from_pretrained(str(model_dir), device="cpu", tokenizer=str(tmp_path / "bigger"))


def test_an_empty_tokenizer_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tokenizer must be a folder or a hub id"):
        EngineArgs(tokenizer=" ").engine_config()
