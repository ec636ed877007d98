"""Autotuned handles on the kernels, built on first use (not at import) so the interpreter check sees the
environment of the call, not of the import.

Under ``TRITON_INTERPRET=1`` there is exactly one small config: the interpreter is slow and autotuning there
would only multiply the run time. By default (``KVB_KERNELS_AUTOTUNE`` unset or 0) each table's first entry
is used alone (Triton's autotuner skips benchmarking when it holds one config): on an H200 it was as fast as
the tuned choice within noise, without the 3-25 s of tuning compiles per new shape. ``KVB_KERNELS_AUTOTUNE=1``
keeps every candidate.
"""

from __future__ import annotations

import functools

import triton

from kvb_kernels.backend import interpreter_enabled

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Prefill tiles follow the FA2 paper / Triton tutorial sizes for
# sm80/sm90; decode tiles keep BLOCK_M small because a decode row block holds only q_len * group rows.
# The first entry of each table is the default tile (KVB_KERNELS_AUTOTUNE unset or 0): a mid-size tile that fits
# fp32 with a 128-wide head in registers on sm80/sm90.
_PREFILL = (
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 4),
    (64, 128, 4, 3),
)
_DECODE = ((16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2), (16, 32, 2, 3))
_INTERPRET = ((16, 16, 1, 1),)

# Rows per program above which the prefill tile set is used (rows = q_len * group).
DECODE_ROWS_MAX = 64

AUTOTUNE_KEY = ["ROWS_KEY", "KV_KEY", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "HAS_MASK", "SPLIT"]


def _configs(decode: bool, autotune: bool) -> list[triton.Config]:
    table = _INTERPRET if interpreter_enabled() else (_DECODE if decode else _PREFILL)
    if not autotune:
        table = table[:1]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in table
    ]


@functools.cache
def tuned(kernel_name: str, decode: bool, interpret: bool, autotune: bool) -> triton.runtime.Autotuner:
    """The autotuned kernel ``kernel_name`` for decode- or prefill-shaped calls.

    ``interpret`` is part of the cache key only, so flipping ``TRITON_INTERPRET`` in a process builds a new
    handle instead of reusing one built for the other mode; ``autotune`` (``KVB_KERNELS_AUTOTUNE``) keeps all
    candidate tiles or only the first.
    """
    del interpret
    if kernel_name == "dense":
        from kvb_kernels.triton.dense import dense_attention_kernel as kernel
    elif kernel_name == "paged":
        from kvb_kernels.triton.paged import paged_attention_kernel as kernel
    elif kernel_name == "kivi":
        from kvb_kernels.triton.kivi import kivi_attention_kernel as kernel
    else:
        raise AssertionError(f"unknown kernel {kernel_name!r}")
    return triton.autotune(configs=_configs(decode, autotune), key=AUTOTUNE_KEY)(kernel)
