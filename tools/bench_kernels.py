"""Benchmark kvb-kernels on a CUDA GPU against what users already have (torch SDPA's flash and cuDNN backends).

Measures, in one run on one device:
  1. causal prefill forward TFLOP/s at 1k / 4k / 16k tokens, head dims 64 and 128 (16k tokens per batch,
     2048 hidden), kvb vs SDPA-flash vs SDPA-cuDNN;
  2. decode (q_len = 1, GQA 32/8, hd 128) bandwidth in GB/s vs the device's measured copy bandwidth,
     kvb vs SDPA-flash;
  3. the fused paths vs their unfused equivalents: block-table attention vs gather (torch.cat) + attention,
     int8 KIVI attention vs dequantise + attention.
Every timed kernel is first checked against fp32 SDPA. Timings are medians of CUDA-event-timed repeats.
Writes docs/kernels_bench.json and docs/kernels_bench.png. Needs a CUDA GPU and Triton; exits 2 otherwise.

Usage: python tools/bench_kernels.py [--quick] [--dtype float16|bfloat16] [--out-dir docs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from plotting import pyplot  # tools/ is on sys.path when a script here runs
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvb_kernels import (
    PagedKV,
    flash_attention,
    get_flash_attn_tier,
    kivi_attention,
    kivi_quantize,
    paged_attention,
)

ROOT = Path(__file__).resolve().parent.parent


def cuda_time_ms(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` CUDA-event-timed runs (after ``warmup`` runs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_with(backend: SDPBackend, q, k, v, *, causal: bool) -> Callable[[], torch.Tensor] | None:
    """An SDPA call pinned to ``backend``, or None when that backend refuses these inputs."""

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
            )

    try:
        call()
    except RuntimeError as err:
        print(f"  ({backend.name} unavailable: {str(err).splitlines()[0][:90]})")
        return None
    return call


def check(out: torch.Tensor, q, k, v, *, causal: bool) -> float:
    """Max abs error of ``out`` against fp32 SDPA (on a slice for big inputs)."""
    sl = slice(0, min(q.shape[0], 1))
    ref = F.scaled_dot_product_attention(
        q[sl].float(), k[sl].float(), v[sl].float(), is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )
    return (out[sl].float() - ref).abs().max().item()


def bench_prefill(dtype: torch.dtype, seq_lens: list[int], head_dims: list[int]) -> list[dict]:
    rows = []
    for head_dim in head_dims:
        heads = 2048 // head_dim
        for seq in seq_lens:
            batch = max(1, 16384 // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the score matrix
            err = check(flash_attention(q, k, v), q, k, v, causal=True)
            row = {"head_dim": head_dim, "seq_len": seq, "batch": batch, "heads": heads, "max_abs_err": err}
            candidates = {
                "kvb": lambda q=q, k=k, v=v: flash_attention(q, k, v),
                "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION, q, k, v, causal=True),
                "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION, q, k, v, causal=True),
            }
            for name, fn in candidates.items():
                row[f"{name}_tflops"] = None if fn is None else flops / cuda_time_ms(fn) / 1e9
            rows.append(row)
            print(
                f"prefill hd={head_dim:3d} L={seq:5d} B={batch:2d}: "
                + "  ".join(
                    f"{n}={row[f'{n}_tflops']:.0f}" if row[f"{n}_tflops"] else f"{n}=n/a" for n in candidates
                )
                + f" TFLOP/s  (err {err:.1e})"
            )
    return rows


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def bench_decode(dtype: torch.dtype, kv_lens: list[int], copy_gbs: float) -> list[dict]:
    rows = []
    batch, heads, kv_heads, head_dim = 8, 32, 8, 128
    for kv_len in kv_lens:
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        moved = 2 * k.numel() * k.element_size()  # K and V read once; q/out are negligible
        err = check(flash_attention(q, k, v), q, k, v, causal=False)
        row = {"kv_len": kv_len, "batch": batch, "max_abs_err": err, "copy_gbs": copy_gbs}
        candidates = {
            "kvb": lambda q=q, k=k, v=v: flash_attention(q, k, v),
            "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION, q, k, v, causal=False),
        }
        for name, fn in candidates.items():
            row[f"{name}_gbs"] = None if fn is None else moved / cuda_time_ms(fn) / 1e6
        rows.append(row)
        print(
            f"decode L={kv_len:6d}: kvb={row['kvb_gbs']:.0f} GB/s ({row['kvb_gbs'] / copy_gbs:.0%} of copy), "
            f"sdpa_flash={row['sdpa_flash_gbs'] or float('nan'):.0f} GB/s  (err {err:.1e})"
        )
    return rows


def bench_fused(dtype: torch.dtype, kv_len: int) -> list[dict]:
    batch, heads, kv_heads, head_dim, page = 8, 32, 8, 128, 128
    rows = []
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, device="cuda", dtype=dtype) for _ in range(2))

    coded = kivi_quantize(k, v, group_size=64, scale_dtype=torch.float16)
    k_hat, v_hat = coded.dequantize(dtype)
    err = (kivi_attention(q, coded).float() - flash_attention(q, k_hat, v_hat).float()).abs().max().item()
    fused = cuda_time_ms(lambda: kivi_attention(q, coded))

    def kivi_unfused() -> torch.Tensor:
        kd, vd = coded.dequantize(dtype)
        return flash_attention(q, kd, vd)

    rows.append(
        {
            "path": "kivi_int8_decode",
            "kv_len": kv_len,
            "fused_ms": fused,
            "unfused_ms": cuda_time_ms(kivi_unfused),
            "fp16_dense_ms": cuda_time_ms(lambda: flash_attention(q, k, v)),
            "max_abs_err_vs_unfused": err,
        }
    )

    pages_per_seq = kv_len // page
    pool_k = (
        k.view(batch, kv_heads, pages_per_seq, page, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(-1, kv_heads, page, head_dim)
    )
    pool_v = (
        v.view(batch, kv_heads, pages_per_seq, page, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(-1, kv_heads, page, head_dim)
    )
    order = torch.randperm(pool_k.shape[0], device="cuda")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device="cuda")
    paged = PagedKV(
        key_pages=pool_k[order].contiguous(),
        value_pages=pool_v[order].contiguous(),
        block_table=inverse.view(batch, pages_per_seq).to(torch.int32),
        kv_lens=torch.full((batch,), kv_len, dtype=torch.int32, device="cuda"),
    )
    err = (paged_attention(q, paged).float() - flash_attention(q, k, v).float()).abs().max().item()

    def paged_unfused() -> torch.Tensor:
        kd, vd = paged.gather()
        return flash_attention(q, kd, vd)

    rows.append(
        {
            "path": "paged_decode",
            "kv_len": kv_len,
            "fused_ms": cuda_time_ms(lambda: paged_attention(q, paged)),
            "unfused_ms": cuda_time_ms(paged_unfused),
            "fp16_dense_ms": cuda_time_ms(lambda: flash_attention(q, k, v)),
            "max_abs_err_vs_unfused": err,
        }
    )
    for row in rows:
        print(
            f"{row['path']:18s} L={kv_len}: fused {row['fused_ms']:.3f} ms, unfused {row['unfused_ms']:.3f} ms "
            f"({row['unfused_ms'] / row['fused_ms']:.2f}x), dense fp16 {row['fp16_dense_ms']:.3f} ms "
            f"(err {row['max_abs_err_vs_unfused']:.1e})"
        )
    return rows


def plot(results: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for head_dim in sorted({r["head_dim"] for r in results["prefill"]}):
        rows = [r for r in results["prefill"] if r["head_dim"] == head_dim]
        for name, style in (("kvb", "-o"), ("sdpa_flash", "--s"), ("sdpa_cudnn", ":^")):
            ys = [r[f"{name}_tflops"] for r in rows]
            if all(y is not None for y in ys):
                axes[0].plot([r["seq_len"] for r in rows], ys, style, label=f"{name} hd{head_dim}")
    axes[0].set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s", title="causal prefill forward")
    axes[0].legend(fontsize=8)
    rows = results["decode"]
    for name, style in (("kvb", "-o"), ("sdpa_flash", "--s")):
        ys = [r[f"{name}_gbs"] for r in rows]
        if all(y is not None for y in ys):
            axes[1].plot([r["kv_len"] for r in rows], ys, style, label=name)
    axes[1].axhline(results["copy_gbs"], color="gray", lw=1, label="device copy")
    axes[1].set(xscale="log", xlabel="KV length", ylabel="GB/s", title="decode (q_len=1, GQA 32/8, hd128)")
    axes[1].legend(fontsize=8)
    fig.suptitle(results["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes (1k/4k prefill, 4k/16k decode)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="input dtype")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs", help="where the JSON and PNG go")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_kernels needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
            file=sys.stderr,
        )
        return 2
    if get_flash_attn_tier() != "kvb_triton":
        print('bench_kernels needs Triton: pip install "kvb-kernels[triton]"', file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}, dtype {args.dtype}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s")
    results = {
        "device": device,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "copy_gbs": copy_gbs,
        "prefill": bench_prefill(dtype, [1024, 4096] if args.quick else [1024, 4096, 16384], [64, 128]),
        "decode": bench_decode(dtype, [4096, 16384] if args.quick else [4096, 16384, 65536], copy_gbs),
        "fused": bench_fused(dtype, 16384),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kernels_bench.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out_dir / "kernels_bench.png")
    print(f"wrote {args.out_dir / 'kernels_bench.json'} and kernels_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
