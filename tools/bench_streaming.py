"""Benchmark kvb-streaming on a CUDA GPU: H2D bandwidth, tok/s per residency mode and slot count, hit rate,
PCIe efficiency, and accelerate's offload (``device_map`` + ``max_memory``) at the same VRAM budget.

Needs CUDA (exits with a clear message otherwise). Builds a random-weight Llama-architecture model (default
~4 GB of int4 weights, Llama-3-8B layer shapes), AWQ-packs it with kvb-streaming's own packer, then measures,
all in the same run. Results: a table on stdout, ``docs/streaming_bench.json`` and ``docs/streaming_bench.png``.

    python tools/bench_streaming.py                       # defaults (H100: a few minutes)
    python tools/bench_streaming.py --layers 64 --hidden 5120 --intermediate 27648   # ~32B shapes, ~19 GB
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvb_cache.cache_kwarg import cache_kwargs

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One measured configuration."""

    name: str
    residency_mode: str
    n_staging_slots: int
    keep_first_k: int
    tok_s: float
    peak_vram_gib: float
    hit_rate: float | None
    late_prefetches: int
    bytes_per_token: int
    pcie_ceiling_tok_s: float | None
    pcie_efficiency: float | None
    load_s: float


def measure_h2d(bandwidth_bytes: int, reps: int, pinned: bool) -> float:
    """Median host-to-device bandwidth in GB/s (1e9 bytes/s) for one ``bandwidth_bytes`` copy."""
    host = torch.empty(bandwidth_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(bandwidth_bytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=pinned)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del host, dev
    return bandwidth_bytes / statistics.median(times) / 1e9


def decode_tok_s(model: torch.nn.Module, *, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Batch-1 greedy decode rate: 1 / median per-token forward time, after a prefill."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt_len), generator=generator).cuda()
    cache = DynamicCache(config=model.config)
    times = []
    with torch.inference_mode():
        logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times[2:] if len(times) > 4 else times)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_streaming(
    path: Path, args: argparse.Namespace, h2d_gbs: float, *, name: str, **config: object
) -> Row:
    from kvb_streaming import StreamingCausalLM, StreamingConfig, get_runtime

    free()
    streaming = StreamingConfig(quant_kernel=args.quant_kernel, **config)  # type: ignore[arg-type]
    start = time.perf_counter()
    model = StreamingCausalLM.from_pretrained(
        path, streaming_config=streaming, device="cuda", dtype=torch.float16
    )
    load_s = time.perf_counter() - start
    runtime = get_runtime(model)
    tok_s = decode_tok_s(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens, vocab=args.vocab)
    stats = runtime.stats()
    # Every streamed layer moves once per forward (prefill or decode alike), so bytes per forward over a short
    # fresh run is the bytes streamed per generated token.
    runtime.scheduler.reset_stats()
    decode_tok_s(model, prompt_len=args.prompt_len, new_tokens=4, vocab=args.vocab)
    per_forward = runtime.stats().bytes_moved / max(runtime.stats().forwards, 1)
    ceiling = h2d_gbs * 1e9 / per_forward if per_forward else None
    row = Row(
        name=name,
        residency_mode=streaming.residency_mode,
        n_staging_slots=streaming.n_staging_slots,
        keep_first_k=streaming.keep_first_k,
        tok_s=tok_s,
        peak_vram_gib=torch.cuda.max_memory_allocated() / GiB,
        hit_rate=stats.hit_rate,
        late_prefetches=stats.late_prefetches,
        bytes_per_token=int(per_forward),
        pcie_ceiling_tok_s=ceiling,
        pcie_efficiency=tok_s / ceiling if ceiling else None,
        load_s=load_s,
    )
    del model, runtime
    return row


def run_accelerate(path: Path, args: argparse.Namespace, budget_bytes: int) -> Row:
    """The same AWQ model and kernel, kept on the host and dispatched by accelerate's offload hooks."""
    from accelerate import dispatch_model, infer_auto_device_map

    from kvb_streaming import StreamingConfig
    from kvb_streaming.builder import build_model
    from kvb_streaming.loader import AWQLoader

    free()
    start = time.perf_counter()
    loader = AWQLoader(path, pin_memory=False)
    config = StreamingConfig(residency_mode="full_resident", quant_kernel=args.quant_kernel)
    built = build_model(
        loader, config, device=torch.device("cpu"), dtype=torch.float16, kernel_device=torch.device("cuda")
    )
    model = built.model
    device_map = infer_auto_device_map(
        model,
        max_memory={0: budget_bytes, "cpu": 512 * GiB},
        no_split_module_classes=list(model._no_split_modules or []),
        offload_buffers=True,
    )
    # offload_buffers: the int4 payloads are buffers; without it accelerate would keep them all on the GPU.
    model = dispatch_model(
        model, device_map=device_map, main_device=torch.device("cuda", 0), offload_buffers=True
    )
    load_s = time.perf_counter() - start
    tok_s = decode_tok_s(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens, vocab=args.vocab)
    row = Row(
        name="accelerate offload",
        residency_mode="accelerate device_map",
        n_staging_slots=0,
        keep_first_k=sum(1 for k, v in device_map.items() if ".layers." in k and v == 0),
        tok_s=tok_s,
        peak_vram_gib=torch.cuda.max_memory_allocated() / GiB,
        hit_rate=None,
        late_prefetches=0,
        bytes_per_token=0,
        pcie_ceiling_tok_s=None,
        pcie_efficiency=None,
        load_s=load_s,
    )
    del model, built
    return row


def build_checkpoint(args: argparse.Namespace) -> Path:
    from transformers import LlamaConfig

    from kvb_streaming.packer import save_random_awq_checkpoint

    path = Path(args.model_dir)
    if (path / "config.json").is_file() and not args.rebuild:
        return path
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
    )
    start = time.perf_counter()
    save_random_awq_checkpoint(config, path, group_size=128, device="cuda")
    print(f"built random AWQ checkpoint in {time.perf_counter() - start:.0f} s at {path}", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default="/tmp/kvb_streaming_bench_model", help="checkpoint folder")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint even if present")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--quant-kernel", default="auto", help="auto | torch | int4pack | kvb_kernels")
    parser.add_argument("--out", default=str(ROOT / "docs" / "streaming_bench.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_streaming needs a CUDA GPU (streaming is disabled on CPU); nothing measured.",
            file=sys.stderr,
        )
        return 2

    h2d_pinned = measure_h2d(1 * GiB, 10, pinned=True)
    h2d_pageable = measure_h2d(1 * GiB, 5, pinned=False)
    print(f"H2D bandwidth: pinned {h2d_pinned:.1f} GB/s, pageable {h2d_pageable:.1f} GB/s", flush=True)
    path = build_checkpoint(args)
    half = args.layers // 2
    rows: list[Row] = [
        run_streaming(path, args, h2d_pinned, name="full_resident", residency_mode="full_resident")
    ]
    for slots in args.slots:
        rows.append(
            run_streaming(
                path,
                args,
                h2d_pinned,
                name=f"full_stream x{slots}",
                residency_mode="full_stream",
                n_staging_slots=slots,
            )
        )
    rows.append(
        run_streaming(
            path,
            args,
            h2d_pinned,
            name=f"partial_resident k={half} x2",
            residency_mode="partial_resident",
            keep_first_k=half,
            n_staging_slots=2,
        )
    )
    rows.append(
        run_streaming(path, args, h2d_pinned, name="ffn_only_stream x2", residency_mode="ffn_only_stream")
    )
    for row in rows:
        print(row, flush=True)
    # accelerate at the VRAM budget of the partial_resident run, and at that of full_stream x2.
    budgets = {r.name: r.peak_vram_gib for r in rows}
    comparisons = []
    for ours in (f"partial_resident k={half} x2", "full_stream x2"):
        if ours not in budgets:
            continue
        acc = run_accelerate(path, args, int(budgets[ours] * GiB))
        acc = Row(**{**asdict(acc), "name": f"accelerate @ {ours} budget"})
        rows.append(acc)
        mine = next(r for r in rows if r.name == ours)
        comparisons.append({"ours": ours, "accelerate_tok_s": acc.tok_s, "speedup": mine.tok_s / acc.tok_s})
        print(acc, flush=True)

    print(f"\n{'config':34} {'tok/s':>8} {'VRAM GiB':>9} {'hit rate':>8} {'MB/token':>9} {'PCIe eff':>8}")
    for r in rows:
        hit = f"{r.hit_rate:.3f}" if r.hit_rate is not None else "-"
        eff = f"{r.pcie_efficiency:.0%}" if r.pcie_efficiency is not None else "-"
        print(
            f"{r.name:34} {r.tok_s:8.2f} {r.peak_vram_gib:9.2f} {hit:>8} {r.bytes_per_token / 1e6:9.1f} {eff:>8}"
        )
    for c in comparisons:
        print(f"{c['ours']} vs accelerate at the same VRAM budget: {c['speedup']:.2f}x")

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "h2d_pinned_gbs": h2d_pinned,
        "h2d_pageable_gbs": h2d_pageable,
        "model": {
            k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
        },
        "rows": [asdict(r) for r in rows],
        "accelerate_comparisons": comparisons,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh([r.name for r in rows], [r.tok_s for r in rows])
        ax.set_xlabel("decode tok/s (batch 1)")
        ax.set_title(f"kvb-streaming on {result['device']} (pinned H2D {h2d_pinned:.0f} GB/s)")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
