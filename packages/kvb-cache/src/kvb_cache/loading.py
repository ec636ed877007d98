"""Loading a model and tokenizer by name, with errors that say what to do."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvb_cache.embedded import embedded_model_folder, is_embedded_name, resolve_model_path
from kvb_cache.errors import ConfigError, ModelLoadError
from kvb_cache.model_traits import context_exceeded, declared_context

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,  # vLLM's --dtype float
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    #: The name users gave (the embedded short name stays as given).
    name: str


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ConfigError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or a torch dtype, got {dtype!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must look like 'cpu', 'cuda' or 'cuda:0', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was requested but CUDA is not available; use device='cpu'")
    # Checked here, not left to model.to(): that fails only after the weights are loaded, with an untyped
    # RuntimeError ("PyTorch is not linked with support for mps devices").
    probes = (getattr(torch.backends, resolved.type, None), getattr(torch, resolved.type, None))
    available = next((p.is_available for p in probes if callable(getattr(p, "is_available", None))), None)
    if resolved.type != "cpu" and available is not None and not available():
        raise ConfigError(
            f"device={str(device)!r} was requested but this torch build or machine has no {resolved.type} "
            "support; use device='cpu'"
        )
    return resolved


def _path_like(name: str) -> bool:
    """Whether ``name`` can only mean a local path (a hub id is ``org/name``, never absolute or relative)."""
    return Path(name).expanduser().is_absolute() or name.startswith((".", "~")) or name.count("/") > 1


def check_local_model(name_or_path: str) -> None:
    """Refuse a local path that cannot be a model folder, saying why.

    Left to transformers, a missing path reads "Repo id must use alphanumeric chars" (it is taken for a hub
    id), a folder without config.json "Couldn't instantiate the backend tokenizer", and a GGUF file "the
    config file ... is not a valid JSON file". A name that does not look like a path ("org/name") is left
    to transformers: it may be a hub id in the local cache.

    Raises:
        ModelLoadError: the path does not exist, is a (GGUF) file, or is a folder without config.json.
    """
    path = Path(name_or_path).expanduser()
    if not (path.exists() or _path_like(name_or_path) or name_or_path.lower().endswith(".gguf")):
        return
    if not path.exists():
        raise ModelLoadError(
            f"model path {name_or_path!r} does not exist; pass a local folder with config.json and weights, "
            "a hub id already in your local Hugging Face cache, or 'smollm2-135m' for the embedded model"
        )
    if path.is_file() and path.suffix.lower() == ".gguf":
        raise ModelLoadError(
            f"{name_or_path!r} is a GGUF file, which is not loaded directly (only the embedded smollm2-135m "
            "is converted for you); convert it once with transformers: AutoModelForCausalLM.from_pretrained("
            "folder, gguf_file=name).save_pretrained(out) and the same for AutoTokenizer, then pass out"
        )
    if path.is_file():
        raise ModelLoadError(
            f"{name_or_path!r} is a file; pass the folder that holds config.json, the tokenizer and the weights"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{name_or_path!r} has no config.json; pass the folder that holds config.json, the tokenizer "
            "and the weights (*.safetensors)"
        )
    pickles = [p.name for pattern in _PICKLE_WEIGHTS for p in path.glob(pattern)]
    if pickles and not any(path.glob("*.safetensors")):
        raise ModelLoadError(_pickle_message(name_or_path, sorted(pickles)))


#: Checkpoint files that are Python pickles: never loaded (torch.load unpickles, even with weights_only).
_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def _pickle_message(name: str, files: list[str]) -> str:
    return (
        f"{name!r} holds its weights only as pickle files ({', '.join(files[:3])}), which are not loaded: "
        "unpickling runs code from the file. Convert them once to safetensors, in a trusted environment: "
        "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder) (transformers writes "
        "model.safetensors)"
    )


def load_model_and_tokenizer(
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    tokenizer: str | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer (``tokenizer``'s, when given: a folder or a cached hub id); the
    embedded model's short names are accepted.

    Args:
        max_model_len: the context the caller will ask for; above the one ``config.json`` declares it is
            refused before the weights are read (:func:`check_declared_context`).

    Raises:
        ModelLoadError: either cannot be loaded, or the tokenizer has ids the model has no embedding for.
        ConfigError: ``max_model_len`` exceeds the context the model's config declares.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ModelLoadError(f"model must be a non-empty path or name, got {name_or_path!r}")
    path = resolve_model_path(name_or_path)
    torch_device = resolve_device(device)
    kwargs = {"dtype": resolve_dtype(dtype)}
    if not is_embedded_name(name_or_path):
        check_local_model(name_or_path)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # Before the model: a wrong tokenizer should not cost a model load, nor read as the model's error below.
    own_tokenizer = load_own_tokenizer(tokenizer) if tokenizer is not None else None
    if own_tokenizer is None and Path(path).is_dir() and not _has_tokenizer_files(Path(path)):
        # transformers' message here suggested installing sentencepiece or tiktoken.
        raise ModelLoadError(
            f"{name_or_path!r} holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model or "
            "vocab files); save the model's tokenizer into it (tokenizer.save_pretrained(folder)) or pass "
            "tokenizer (--tokenizer)"
        )
    if max_model_len is not None:
        check_declared_context(path, max_model_len)
    try:
        # local_files_only: a hub id is read from the local Hugging Face cache, as documented; without it a
        # name missing there was fetched from the hub, or, offline, retried for ~45 s before failing.
        # trust_remote_code=False: left unset, transformers asks on stdin whether to run a checkpoint's own
        # modeling code (a prompt a server start waited on for 15 s, and a "y" ran that code).
        loaded_tokenizer = (
            AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            if own_tokenizer is None
            else own_tokenizer
        )
        # use_safetensors=True: a folder (or cached hub id) with only pytorch_model.bin was unpickled
        # (torch.load, weights_only or not, is still an unpickler); never read anything else.
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            output_loading_info=True,
            **kwargs,
        )
    except ImportError as exc:
        # An optional package the load asked for (attn_implementation="flash_attention_2" without flash-attn).
        raise ModelLoadError(
            f"could not load model {name_or_path!r}: {exc} Install that package, or pass "
            "attn_implementation='sdpa' (or leave it unset)."
            if attn_implementation is not None
            else f"could not load model {name_or_path!r}: {exc}"
        ) from exc
    except OSError as exc:
        if Path(path).exists():
            raise ModelLoadError(f"could not load model {name_or_path!r}: {exc}") from exc
        # transformers' own message here is about connecting to huggingface.co, which is never tried.
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a local folder nor a hub id in the local Hugging Face cache "
            f"(nothing is downloaded); fetch it first (hf download {name_or_path}) or pass a local folder "
            "with config.json and weights, or 'smollm2-135m' for the embedded model"
        ) from exc
    except SafetensorError as exc:
        # A truncated or corrupt weights file (a cut copy, a full disk) escaped as a traceback.
        raise ModelLoadError(_damaged_weights(name_or_path, path, exc)) from exc
    except RuntimeError as exc:
        # Weights of other shapes than config.json says ("size mismatch for ...") escaped as a traceback.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"could not load model {name_or_path!r}: {first} (do the weights match its config.json?)"
        ) from exc
    except (ValueError, KeyError) as exc:
        if "trust_remote_code" in str(exc):
            # transformers' fix ("pass trust_remote_code=True") is one KVBoost does not take.
            raise ModelLoadError(
                f"could not load model {name_or_path!r}: it needs its own modeling code (config.json's "
                "auto_map), which KVBoost never runs; only architectures transformers ships are served"
            ) from exc
        hint = (
            ""
            if is_embedded_name(name_or_path)
            else (
                " Pass a local folder with config.json and weights, a hub id already in your local Hugging Face "
                "cache, or 'smollm2-135m' for the embedded model."
            )
        )
        raise ModelLoadError(f"could not load model {name_or_path!r}: {exc}.{hint}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        # transformers initialises them at random and says so in a report; served, every answer is noise.
        raise ModelLoadError(
            f"could not load model {name_or_path!r}: its weights lack {len(missing)} of the model's tensors "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the checkpoint is incomplete or "
            "belongs to another configuration"
        )
    check_vocabulary(model, loaded_tokenizer, tokenizer)
    model.to(torch_device)
    return LoadedModel(model=model.eval(), tokenizer=loaded_tokenizer, name=name_or_path)


def check_declared_context(path: str, max_model_len: int) -> None:
    """Refuse ``max_model_len`` above the context ``path``'s ``config.json`` declares, before any weight is
    read (a 70B checkpoint took minutes to load before the engine said so). The engine's own check after the
    load still applies (a LongRoPE switch or a position limit can lower the context further); a config that
    cannot be read here is left to the load, which reports it.

    Raises:
        ConfigError: ``max_model_len`` exceeds the declared context.
    """
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception:  # whatever it is, the model load right after reports it in its own words
        return
    limit = declared_context(config)
    if limit is not None and max_model_len > limit:
        raise context_exceeded(max_model_len, limit)


def _damaged_weights(name: str, path: str, exc: Exception) -> str:
    if is_embedded_name(name) or Path(path) == embedded_model_folder():
        return (
            f"the embedded model's converted folder {path} is damaged ({exc}); delete that folder and start "
            "again to convert the embedded model anew"
        )
    return f"could not load model {name!r}: a weights file is truncated or corrupt ({exc}); copy or download it again"


def load_own_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer a ``tokenizer`` option names (a folder, a cached hub id or the embedded model's short
    name), loaded as the model's would be; its errors name the option and say what to pass (transformers'
    own ones spoke of an internet connection never tried, or of sentencepiece for a folder without a
    tokenizer)."""
    option = f"tokenizer (--tokenizer) {name_or_path!r}"
    path = Path(resolve_model_path(name_or_path)).expanduser()
    if _path_like(name_or_path) and not path.exists():
        raise ModelLoadError(
            f"tokenizer (--tokenizer) path {name_or_path!r} does not exist; pass a folder with the tokenizer's "
            "files (tokenizer.json, tokenizer_config.json) or a hub id already in your local Hugging Face cache"
        )
    if path.is_file():
        raise ModelLoadError(
            f"{option} is a file; pass the folder holding the tokenizer's files (tokenizer.json, "
            "tokenizer_config.json)"
        )
    if path.is_dir() and not _has_tokenizer_files(path):
        raise ModelLoadError(
            f"{option} holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model or vocab "
            "files); pass the folder its tokenizer was saved into (tokenizer.save_pretrained(folder))"
        )
    try:
        return AutoTokenizer.from_pretrained(
            str(path) if path.exists() else name_or_path, local_files_only=True, trust_remote_code=False
        )
    except OSError as exc:
        if path.exists():
            raise ModelLoadError(f"could not load {option}: {exc}") from exc
        raise ModelLoadError(
            f"{option} is neither a local folder nor a hub id in the local Hugging Face cache (nothing is "
            f"downloaded); fetch it first (hf download {name_or_path}) or pass a folder with its files"
        ) from exc
    except (ValueError, KeyError, ImportError) as exc:
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(
                f"could not load {option}: it needs its own tokenizer code (tokenizer_config.json's auto_map), "
                "which KVBoost never runs; pass a tokenizer transformers ships (--tokenizer)"
            ) from exc
        raise ModelLoadError(f"could not load {option}: {exc}") from exc


def check_vocabulary(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name_or_path: str | None
) -> None:
    """Refuse a tokenizer with ids past the model's embedding table: they index out of range in the first
    forward (a bare IndexError, or a device-side assert on CUDA). A smaller tokenizer is fine (padded
    vocabularies are common). ``name_or_path``: the ``--tokenizer`` given, None for the model folder's own.

    The folder's own tokenizer is refused only when its base vocabulary is past the table (it cannot be this
    model's: nearly every prompt failed, each a 400 blaming the client); added tokens past it are only
    warned about, since a prompt that uses none of them is served.
    """
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or len(tokenizer) <= rows:
        return
    if name_or_path is not None:
        raise ModelLoadError(
            f"tokenizer (--tokenizer) {name_or_path!r} has {len(tokenizer)} tokens and the model embeds only "
            f"{rows}: it is not this model's tokenizer (or a compatible one)"
        )
    base = getattr(tokenizer, "vocab_size", len(tokenizer))
    if base > rows:
        raise ModelLoadError(
            f"the model folder's tokenizer has {base} tokens and the model embeds only {rows}: the tokenizer "
            "does not belong to these weights; save the right one into the folder or pass tokenizer "
            "(--tokenizer)"
        )
    logger.warning(
        "the tokenizer has %d tokens, %d of them added past the model's %d embeddings: a prompt using one of "
        "those is refused",
        len(tokenizer),
        len(tokenizer) - rows,
        rows,
    )


def _has_tokenizer_files(folder: Path) -> bool:
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "vocab.json",
        "vocab.txt",
        "spiece.model",
    )
    return any((folder / name).exists() for name in names)
