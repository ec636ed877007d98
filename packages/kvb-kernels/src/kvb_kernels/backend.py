"""Where the Triton kernels can run: a CUDA device, or the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` makes Triton execute kernels in NumPy on CPU tensors. It is slow and only meant for
tests; its bf16 ``tl.dot`` is known to be wrong, so bf16 is never served there.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

from kvb_kernels.errors import KernelUnavailableError

TRITON_EXTRA_HINT = 'install the Triton extra: pip install "kvb-kernels[triton]"'


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


# NOTE: Triton reads the variable as a boolean (1/true/on/yes, any case); "1" alone missed the others, so with
# TRITON_INTERPRET=true the kernels were interpreted while this package assumed compiled code (GPU tuning tables,
# bf16 served although the interpreter's bf16 tl.dot is wrong).
_TRUTHY = ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``, or true/on/yes).

    Triton's own reading of the variable where it has one (``triton.knobs``): a spelling parsed here and
    there differently ("y" interpreted by Triton but not here, " 1" here but not by Triton) made this package
    refuse CPU tensors Triton would run, or send CPU tensors to a compiled launch ("0 active drivers").
    """
    if "TRITON_INTERPRET" not in os.environ:
        return False
    if triton_installed():
        try:
            from triton import knobs

            return bool(knobs.runtime.interpret)
        except (ImportError, AttributeError):  # a Triton without knobs (< 3.3): the usual spellings
            pass
    return os.environ["TRITON_INTERPRET"].strip().lower() in _TRUTHY


def autotune_enabled() -> bool:
    """True only when ``KVB_KERNELS_AUTOTUNE`` is 1/true/on/yes; by default each kernel runs one fixed tile per
    shape class (the table's first entry).

    Autotuning compiles and times every candidate tile for each new specialization (causal or not, a window,
    a mask, ``window == 1``, ...): 3-25 s per first call on an H200, which a server pays on its first requests
    of each shape and a test suite on nearly every test. Measured on the H200 (2026-11-28, fp16,
    ``tools/bench_kernels.py --quick`` once each way; docs/kernels.md) the fixed tile gave up nothing
    systematic: prefill within 7% either way, eager decode 18-22% faster (the autotuner's dispatch is host
    time), the fused block-table decode 1.6x faster, the fused int8 KIVI decode 1.27x slower. So tuning is
    opt-in, for a long-running process with stable shapes.
    """
    return os.environ.get("KVB_KERNELS_AUTOTUNE", "0").strip().lower() in _TRUTHY


def require_triton() -> ModuleType:
    """Import and return ``triton``, or raise :class:`KernelUnavailableError` naming the extra."""
    if not triton_installed():
        raise KernelUnavailableError(f"the kvb-kernels Triton kernels need Triton; {TRITON_EXTRA_HINT}")
    import triton

    return triton


def device_supported(device: torch.device) -> bool:
    """Whether a Triton kernel can run on ``device`` in this process."""
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_enabled()


def dtype_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """fp16/bf16 (and fp32, computed in IEEE fp32) on CUDA; fp16/fp32 under the interpreter."""
    if device.type == "cuda":
        return dtype in (torch.float16, torch.bfloat16, torch.float32)
    return dtype in (torch.float16, torch.float32)
