"""Device functions shared by every attention kernel: which scores survive, and the online-softmax step.

Scores are kept in log2 units (``qk * sm_scale * log2(e)``) so the kernels can use ``exp2``, which maps to a single
hardware instruction on NVIDIA GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def keep_scores(q_abs, offs_n, kv_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Boolean ``[BLOCK_M, BLOCK_N]`` tile: True where query row ``q_abs`` may attend key ``offs_n``.

    ``q_abs`` is the absolute position of each query row (bottom-right causal alignment: the last query sits at
    ``kv_len - 1``). A sliding window of ``window`` keeps keys with ``q_abs - key < window`` (the query itself
    included), the same rule as transformers' ``sliding_window_overlay``.
    """
    keep = offs_n[None, :] < kv_len
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= q_abs[:, None])
    if HAS_WINDOW:
        keep = keep & (q_abs[:, None] - offs_n[None, :] < window)
    return keep


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, v, INPUT_PRECISION: tl.constexpr):
    """Fold one ``[BLOCK_M, BLOCK_N]`` tile of log2-scaled scores into the running output.

    Masked scores are ``-inf``. A row that has seen only masked scores keeps ``m_i == -inf``; the max is then
    replaced by 0 so ``exp2(-inf - 0) = 0`` instead of ``exp2(nan)``.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def store_result(
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
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Write the normalised output, or (split-KV) the unnormalised partial output and its log2-sum-exp.

    A row that attended to nothing (every key masked) gets 0 output and ``lse = -inf``, so the split combine
    gives it zero weight.
    """
    if SPLIT:
        part = (pid_bh * num_splits + pid_s).to(tl.int64) * n_rows + rows
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(LsePart + part, lse, mask=row_ok)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = OPart + part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = (
            Out
            + b.to(tl.int64) * stride_ob
            + head[:, None] * stride_oh
            + q_idx[:, None] * stride_om
            + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
