"""Loading a model folder: damaged weights, ``~`` paths, a folder named like the embedded model, the
``--tokenizer`` errors, and the embedded conversion's housekeeping (modes, lock, temp folders, writability)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import transformers as T

from kvb_cache import ModelLoadError, embedded
from kvb_cache.loading import load_model_and_tokenizer, load_own_tokenizer


@pytest.fixture()
def model_dir(llama: T.PreTrainedModel, tokenizer: T.PreTrainedTokenizerFast, tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_weights_are_a_model_load_error_not_a_traceback(model_dir: Path) -> None:
    """safetensors' SafetensorError is no OSError/ValueError: it escaped as a traceback, exit 1."""
    _truncate(model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt .* again"):
        load_model_and_tokenizer(str(model_dir), device="cpu")


def test_a_damaged_embedded_folder_names_the_folder_to_delete(model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(embedded.CACHE_DIR_ENV, str(tmp_path / "cache"))
    target = embedded.embedded_model_folder()
    target.parent.mkdir(parents=True)
    model_dir.rename(target)
    _truncate(target / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"converted folder {target} is damaged.*delete that folder"):
        load_model_and_tokenizer("smollm2-135m", device="cpu")


def test_a_home_relative_path_loads(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """transformers does not expand '~': "~/llama" was taken for a hub id and refused as missing."""
    monkeypatch.setenv("HOME", str(tmp_path))
    loaded = load_model_and_tokenizer("~/llama", device="cpu")
    assert loaded.model.config.vocab_size == T.AutoConfig.from_pretrained(model_dir).vocab_size


def test_a_local_folder_named_like_the_embedded_model_is_that_folder(
    model_dir, tmp_path, monkeypatch
) -> None:
    """`hf download ... --local-dir SmolLM2-135M-Instruct` then `--model SmolLM2-135M-Instruct` silently served
    the embedded GGUF conversion instead of the downloaded weights."""
    monkeypatch.chdir(tmp_path)
    model_dir.rename(tmp_path / "SmolLM2-135M-Instruct")
    assert not embedded.is_embedded_name("SmolLM2-135M-Instruct")
    assert embedded.is_embedded_name("smollm2-135m")  # no such folder here: the embedded model
    loaded = load_model_and_tokenizer("SmolLM2-135M-Instruct", device="cpu")
    assert loaded.model.config.hidden_size == 64  # the tiny folder, not SmolLM2's 576


def test_tokenizer_option_errors_say_what_to_pass(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="is a file; pass the folder"):
        load_own_tokenizer(str(model_dir / "model.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="holds no tokenizer"):
        load_own_tokenizer(str(empty))
    with pytest.raises(
        ModelLoadError, match=r"neither a local folder nor a hub id .*\(nothing is downloaded\)"
    ) as info:
        load_own_tokenizer("some-org/not-cached")
    assert "internet" not in str(info.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(load_own_tokenizer("~/llama")) == len(T.AutoTokenizer.from_pretrained(model_dir))


def test_a_converted_folder_is_readable_by_other_users(tmp_path: Path) -> None:
    """mkdtemp makes 0700 and safetensors writes 0600: a cache converted as root (a Docker image) failed
    for any other user with a bare EACCES."""
    folder = tmp_path / "tmp"
    folder.mkdir(mode=0o700)
    (folder / "model.safetensors").write_bytes(b"x")
    os.chmod(folder / "model.safetensors", 0o600)
    old = os.umask(0o022)
    try:
        embedded._share(folder)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644


def test_temp_folders_of_dead_conversions_are_removed(tmp_path: Path) -> None:
    """kill -9 or docker stop during the first conversion left a hidden ~520 MB folder behind for good."""
    dead = tmp_path / ".smollm2-999999999-abc"  # no such process
    mine = tmp_path / f".smollm2-{os.getpid()}-def"  # a conversion still running
    for folder in (dead, mine):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    embedded._remove_dead_temps(tmp_path)
    assert not dead.exists() and mine.exists()


def test_an_unwritable_cache_is_refused_before_converting_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(ModelLoadError, match=f"not writable .*set {embedded.CACHE_DIR_ENV}"):
        embedded._check_writable(blocker / "kvboost")


def test_the_conversion_lock_excludes_a_second_holder(tmp_path: Path) -> None:
    import fcntl

    with (
        embedded._conversion_lock(tmp_path),
        open(tmp_path / ".smollm2.lock", "a") as other,
        pytest.raises(BlockingIOError),
    ):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / ".smollm2.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free again
