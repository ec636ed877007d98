"""Attention over int8 asymmetric (KIVI-style) K/V with dequantisation fused into the tile loads.

Keys are coded per channel over groups of ``K_GROUP`` tokens, values per token (see
:class:`kvb_kernels.kivi.KiviKV`). Each key/value tile is loaded as ``uint8`` (half the bytes of fp16, the point
on a bandwidth-bound decode), widened and rescaled in registers, then fed to ``tl.dot`` in the query's dtype: the
full-precision K/V never exist in memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvb_kernels.triton.common import keep_scores, online_softmax_step, store_result


@triton.jit
def kivi_attention_kernel(
    Q,
    KCodes,
    KScale,
    KZero,
    VCodes,
    VScale,
    VZero,
    Out,
    OPart,
    LsePart,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_sb,
    stride_sh,
    stride_sg,
    stride_sd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    qk_scale,
    num_kv_heads,
    q_len,
    kv_len,
    window,
    num_splits,
    ROWS_KEY,
    KV_KEY,  # autotune keys only (bucketed sizes)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    n_rows = q_len * GROUP

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    q_idx = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    q_abs = q_idx + (kv_len - q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (
        Q
        + b.to(tl.int64) * stride_qb
        + head[:, None] * stride_qh
        + q_idx[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kc_base = KCodes + b.to(tl.int64) * stride_kb + kvh * stride_kh
    ks_base = b.to(tl.int64) * stride_sb + kvh * stride_sh
    vc_base = VCodes + b.to(tl.int64) * stride_vb + kvh * stride_vh
    vs_base = b.to(tl.int64) * stride_wb + kvh * stride_wh

    first_abs = (pid_m * BLOCK_M) // GROUP + (kv_len - q_len)
    last_abs = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP + (kv_len - q_len)
    lo = 0
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, last_abs + 1)
    if HAS_WINDOW:
        lo = (tl.maximum(first_abs - window + 1, 0) // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = tl.maximum(lo, pid_s * split_len)
    end = tl.minimum(hi, pid_s * split_len + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        kmask = d_ok[:, None] & n_ok[None, :]
        vmask = n_ok[:, None] & d_ok[None, :]
        # Keys: per-channel scale/zero of the token's group. [BLOCK_D, BLOCK_N]
        kc = tl.load(kc_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=kmask, other=0)
        s_off = ks_base + (offs_n[None, :] // K_GROUP) * stride_sg + offs_d[:, None] * stride_sd
        k_scale = tl.load(KScale + s_off, mask=kmask, other=0.0).to(tl.float32)
        k_zero = tl.load(KZero + s_off, mask=kmask, other=0.0).to(tl.float32)
        k = (kc.to(tl.float32) * k_scale + k_zero).to(q.dtype)
        # Values: one scale/zero per token. [BLOCK_N, BLOCK_D]
        vc = tl.load(vc_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=vmask, other=0)
        v_scale = tl.load(VScale + vs_base + offs_n * stride_wn, mask=n_ok, other=0.0).to(tl.float32)
        v_zero = tl.load(VZero + vs_base + offs_n * stride_wn, mask=n_ok, other=0.0).to(tl.float32)
        v = (vc.to(tl.float32) * v_scale[:, None] + v_zero[:, None]).to(q.dtype)
        v = tl.where(vmask, v, 0.0).to(q.dtype)

        qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
        keep = keep_scores(q_abs, offs_n, kv_len, window, CAUSAL, HAS_WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v, INPUT_PRECISION)

    store_result(
        acc,
        m_i,
        l_i,
        Out,
        OPart,
        LsePart,
        b,
        head,
        q_idx,
        rows,
        row_ok,
        offs_d,
        d_ok,
        pid_bh,
        pid_s,
        num_splits,
        n_rows,
        stride_ob,
        stride_oh,
        stride_om,
        stride_od,
        HEAD_DIM,
        SPLIT,
    )
