"""int4 GEMM straight from AutoAWQ GEMM tensors: ``y = x @ W``, with ``W`` dequantised tile by tile in registers.

AWQ GEMM layout (``in`` inputs, ``out`` outputs, group size ``g``): ``qweight`` int32 ``[in, out / 8]`` and
``qzeros`` int32 ``[in / g, out / 8]`` hold eight 4-bit values per word, nibble ``j`` (bits ``4j .. 4j+3``)
holding column ``8c + ORDER[j]`` of word ``c`` with ``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; ``scales`` is
``[in / g, out]``; ``W[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]``.

Each program computes one ``[BLOCK_M, BLOCK_N]`` tile of ``y``, looping over ``in`` in steps of ``BLOCK_K``: it
loads a ``[BLOCK_K, BLOCK_N]`` tile of packed words (each word gathered by the 8 columns it holds), shifts each
column's nibble down, subtracts the zero point, multiplies by the scale in fp32 (exact: a 4-bit integer times
an fp16/bf16 scale fits fp32's mantissa), rounds once to ``x``'s dtype (so the tile equals the torch reference
dequantisation bit for bit) and feeds ``tl.dot`` with an fp32 accumulator. The dequantised weight never exists
in memory: only the packed int4 words and the per-group zeros/scales are read.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from kvb_kernels.backend import interpreter_enabled

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). NOT measured on a GPU yet: the GPU tables are the usual
# starting points of Triton's matmul tutorial for sm80/sm90 (a small-M tile for decode, where tokens are few
# and the GEMM is bound by reading the weight), to be tuned when a GPU run exists. BLOCK_K 32/64 divides the
# common AWQ group sizes (32, 64, 128), which lets a K step load one zero/scale row instead of one per k-row;
# the first entry of each table (the one used without autotuning) takes BLOCK_K = 32, which divides them all.
_PREFILL = ((64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 64, 64, 4, 3), (128, 64, 32, 4, 4))
_DECODE = ((16, 128, 32, 4, 3), (16, 64, 128, 4, 3), (16, 256, 32, 4, 3), (32, 128, 64, 4, 3))
# One small tile under the interpreter (it is slow; tuning there would only multiply the run time). 16 is
# tl.dot's smallest M/N/K; BLOCK_N = 32 spans four packed words, so several words per row are unpacked.
_INTERPRET = ((16, 32, 32, 1, 1),)

#: Token counts up to this use the decode tile table.
DECODE_TOKENS_MAX = 32

#: Nibble holding each column of a word: the inverse of AWQ's ORDER (column c -> (c % 2) * 4 + c // 2).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@triton.jit
def round_to_bf16(v):
    """fp32 values rounded to the nearest bf16 (ties to even), still as fp32.

    Only for the interpreter, whose fp32 -> bf16 cast truncates (a compiled cast rounds to nearest): rounded
    first, the truncating cast that follows is exact. Finite values only (the weight and the outputs).
    """
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def awq_gemm_kernel(
    X,
    QWeight,
    QZeros,
    Scales,
    Y,
    n_tokens,
    in_features,
    out_features,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_ym,
    stride_yn,
    TOKENS_KEY,  # autotune key only (bucketed token count)
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < n_tokens
    n_ok = offs_n < out_features

    # Column o lives in word o // 8, nibble (o % 2) * 4 + (o % 8) // 2 (AWQ_REVERSE_ORDER): one shift per column,
    # shared by the weight and the zero-point words.
    col = offs_n % 8
    shift = ((col % 2) * 4 + col // 2) * 4
    word_n = offs_n // 8

    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    q_cols = QWeight + word_n[None, :] * stride_qn
    z_cols = QZeros + word_n[None, :] * stride_zn
    s_cols = Scales + offs_n[None, :] * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < in_features
        x = tl.load(
            x_rows + ks.to(tl.int64)[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(q_cols + ks.to(tl.int64)[:, None] * stride_qk, mask=w_ok, other=0)
        # The arithmetic shift of a negative word (top nibble >= 8) sign-extends; the mask drops those bits.
        q = (words >> shift[None, :]) & 0xF  # [BLOCK_K, BLOCK_N] int32
        if GROUP_SIZE % BLOCK_K == 0:
            # The whole K step lies in one group (k0 is a multiple of BLOCK_K): one zero/scale row for the tile.
            # No k mask needed: BLOCK_K | g and g | in, so every step is full.
            g = k0 // GROUP_SIZE
            zw = tl.load(z_cols + g * stride_zg, mask=n_ok[None, :], other=0)  # [1, BLOCK_N]
            s = tl.load(s_cols + g * stride_sg, mask=n_ok[None, :], other=0.0)
        else:
            # Groups smaller than (or not dividing) the K step: each k-row fetches its own group's row.
            g = ks // GROUP_SIZE
            zw = tl.load(z_cols + g[:, None] * stride_zg, mask=w_ok, other=0)  # [BLOCK_K, BLOCK_N]
            s = tl.load(s_cols + g[:, None] * stride_sg, mask=w_ok, other=0.0)
        z = (zw >> shift[None, :]) & 0xF
        # (q - z) is an integer in -15..15: times an fp16/bf16/fp32 scale it is exact in fp32 (except fp32 scales,
        # rounded once there), then rounded once to x's dtype, as the torch reference dequantisation does.
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        if EMULATE_BF16:
            # bf16 under the CPU interpreter, whose bf16 tl.dot is wrong and whose bf16 cast truncates: the
            # weight rounded to bf16 by hand, and the same products in fp32 (a bf16 x bf16 product is exact in
            # fp32) accumulated in fp32, which is what a compiled bf16 tl.dot computes.
            acc = tl.dot(x.to(tl.float32), round_to_bf16(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)

    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    if EMULATE_BF16:
        acc = round_to_bf16(acc)
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs(decode: bool, autotune: bool) -> list[triton.Config]:
    table = _INTERPRET if interpreter_enabled() else (_DECODE if decode else _PREFILL)
    if not autotune:
        table = table[:1]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in table
    ]


@functools.cache
def tuned_awq_gemm(decode: bool, interpret: bool, autotune: bool) -> triton.runtime.Autotuner:
    """The autotuned kernel for decode- (few tokens) or prefill-shaped calls; same gating as
    ``kvb_kernels.triton.tuning.tuned``: one fixed tile unless ``KVB_KERNELS_AUTOTUNE=1``, and one small tile
    under the interpreter (``interpret`` is in the cache key only, so flipping ``TRITON_INTERPRET`` rebuilds)."""
    del interpret
    key = ["TOKENS_KEY", "in_features", "out_features", "GROUP_SIZE", "EMULATE_BF16", "INPUT_PRECISION"]
    return triton.autotune(configs=_configs(decode, autotune), key=key)(awq_gemm_kernel)
