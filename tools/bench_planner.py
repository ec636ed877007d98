"""Predicted vs actual peak memory of single requests on the embedded SmolLM2-135M (fp32).

For every (prompt length, prefill chunk size) a *fresh subprocess* loads the model, pages its weights in,
runs one warm-up forward, and then runs the request (prefill in slices over a transformers DynamicCache,
then ``--max-new-tokens`` greedy decode steps). "Actual" is measured two ways:

- ``rss``: the peak resident set size over the request, minus the RSS just before it. The kernel's peak
  counter (VmHWM) is reset first by writing 5 to /proc/self/clear_refs, so model loading cannot mask
  it. This is what the OOM killer sees: it includes allocator fragmentation and library scratch, and it is
  noisy by a few MiB (glibc arenas, thread pools, page granularity).
- ``tensor``: the peak of live CPU tensor bytes from torch.profiler memory events during a second run
  of the same request in the same process: deterministic, and exactly what the memory model describes.

On CUDA (``--device cuda``, unverified here: no GPU on the development machine) "actual" is
``torch.cuda.max_memory_allocated()`` minus the allocation before the request.

Writes docs/planner_bench.json and docs/planner_bench.png; prints a table. Run: ``nox -s "bench(name='planner')"``
or ``python tools/bench_planner.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from plotting import pyplot  # tools/ is on sys.path when a script here runs

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_planner import tensor_peak

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MIB = 1 << 20


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prompt_ids(tokenizer, length: int):
    """``length`` tokens of real English text (Python's own documentation topics, shipped with CPython)."""
    from pydoc_data.topics import topics

    import torch

    parts: list[str] = []
    for key in sorted(topics):  # ~4 characters per token: stop once there is comfortably enough text
        parts.append(topics[key])
        if sum(map(len, parts)) > 6 * length:
            break
    ids = tokenizer("\n\n".join(parts), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise SystemExit(f"only {ids.shape[1]} tokens of text available, asked for {length}")
    return ids.to(torch.long)


def _run_request(model, ids, chunk: int | None, max_new_tokens: int) -> None:
    """Prefill ``ids`` in slices of ``chunk`` tokens (None = one forward), then greedy-decode."""
    import torch
    from transformers import DynamicCache

    step = chunk or ids.shape[1]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        for start in range(0, ids.shape[1], step):
            out = model(
                ids[:, start : start + step], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1
            )
        for _ in range(max_new_tokens):
            token = out.logits[:, -1].float().argmax(-1, keepdim=True)  # the sampler's fp32 copy
            out = model(token, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)


def worker(prompt: int, chunk: int | None, max_new_tokens: int, device: str, threads: int) -> dict:
    """Runs in a fresh process; returns measured peaks in bytes."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvb_cache.embedded import embedded_model_path

    torch.set_num_threads(threads)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = _prompt_ids(tokenizer, prompt).to(device)
    with torch.no_grad():
        for p in model.parameters():  # page in mmapped weights so their first touch is not counted
            p.sum()
    _run_request(model, ids[:, :8], None, 1)  # warm-up: thread pools, lazy kernels
    gc.collect()
    result: dict = {}
    if device == "cpu":
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
        _run_request(model, ids, chunk, max_new_tokens)
        result["rss_bytes"] = _status_bytes("VmHWM") - before
        gc.collect()
        result["tensor_bytes"] = tensor_peak(lambda: _run_request(model, ids, chunk, max_new_tokens))
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _run_request(model, ids, chunk, max_new_tokens)
        torch.cuda.synchronize()
        result["cuda_bytes"] = torch.cuda.max_memory_allocated() - before
    return result


def _predict(prompt: int, chunk: int | None, max_new_tokens: int, device: str) -> dict:
    from transformers import AutoConfig

    from kvb_cache.embedded import embedded_model_path
    from kvb_planner import LadderStep, ModelShape, PlanRequest, estimate_memory

    shape = ModelShape.from_config(AutoConfig.from_pretrained(embedded_model_path()), dtype="float32")
    est = estimate_memory(
        PlanRequest(prompt_tokens=prompt, max_new_tokens=max_new_tokens),
        LadderStep(prefill_chunk_size=chunk),
        shape,
        device=device,  # the SDPA backend (and so the scores it materialises) depends on it
    )
    return {
        "peak_bytes": est.peak_bytes,
        "kv_bytes": est.kv_bytes,
        "slice_bytes": max(est.mlp_phase_bytes, est.attention_phase_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prompt-lengths",
        type=int,
        nargs="+",
        default=[256, 512, 1024, 2048, 4096],
        help="prompt lengths in tokens (real text from pydoc_data.topics)",
    )
    parser.add_argument(
        "--chunks",
        nargs="+",
        default=["none", "512"],
        help="prefill chunk sizes to measure; 'none' = single-shot prefill",
    )
    parser.add_argument("--max-new-tokens", type=int, default=8, help="greedy decode steps after the prefill")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda uses torch.cuda.max_memory_allocated (unverified without a GPU)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker")
    parser.add_argument("--out", type=Path, default=DOCS / "planner_bench.json", help="JSON results path")
    # NOTE: a str, not a Path: Path('') is '.', so '' would plot to './.png' instead of meaning "none".
    parser.add_argument("--plot", default=str(DOCS / "planner_bench.png"), help="plot path ('' = none)")
    parser.add_argument("--worker", nargs=2, metavar=("PROMPT", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        prompt, chunk = int(args.worker[0]), None if args.worker[1] == "none" else int(args.worker[1])
        print(json.dumps(worker(prompt, chunk, args.max_new_tokens, args.device, args.threads)))
        return

    logging.basicConfig(level=logging.WARNING)
    rows = []
    measure = ["rss", "tensor"] if args.device == "cpu" else ["cuda"]
    header = f"{'prompt':>6} {'chunk':>6} {'predicted MiB':>13} " + " ".join(
        f"{m + ' MiB':>10} {m + ' resid':>11}" for m in measure
    )
    print(header)
    for prompt in args.prompt_lengths:
        for chunk_arg in args.chunks:
            chunk = None if chunk_arg == "none" else int(chunk_arg)
            if chunk is not None and chunk >= prompt:
                continue  # same as single-shot
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(prompt),
                chunk_arg,
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--device",
                args.device,
                "--threads",
                str(args.threads),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            actual = json.loads(done.stdout.strip().splitlines()[-1])
            predicted = _predict(prompt, chunk, args.max_new_tokens, args.device)
            row = {
                "prompt_tokens": prompt,
                "prefill_chunk_size": chunk,
                "max_new_tokens": args.max_new_tokens,
                "predicted_bytes": predicted["peak_bytes"],
                "predicted_kv_bytes": predicted["kv_bytes"],
            }
            for m in measure:
                row[f"{m}_bytes"] = actual[f"{m}_bytes"]
                row[f"{m}_residual"] = (actual[f"{m}_bytes"] - predicted["peak_bytes"]) / predicted[
                    "peak_bytes"
                ]
            rows.append(row)
            print(
                f"{prompt:>6} {chunk_arg:>6} {row['predicted_bytes'] / MIB:>13.1f} "
                + " ".join(
                    f"{row[f'{m}_bytes'] / MIB:>10.1f} {row[f'{m}_residual']:>+11.1%}" for m in measure
                ),
                flush=True,
            )

    summary = {m: statistics.median(abs(r[f"{m}_residual"]) for r in rows) for m in measure}
    for m, value in summary.items():
        print(f"median |residual| ({m}): {value:.1%}  (target <= 15%)")
    import torch
    import transformers

    payload = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "device": args.device,
            "threads": args.threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": "SmolLM2-135M-Instruct (fp32, sdpa)",
        "residual": "(actual - predicted) / predicted",
        "median_abs_residual": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        _plot(rows, measure, Path(args.plot))
        print(f"wrote {args.plot}")


def _plot(rows: list[dict], measure: list[str], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for chunk in sorted({r["prefill_chunk_size"] for r in rows}, key=lambda c: c or 0):
        sel = [r for r in rows if r["prefill_chunk_size"] == chunk]
        x = [r["prompt_tokens"] for r in sel]
        label = "single-shot" if chunk is None else f"chunk {chunk}"
        ax.plot(x, [r["predicted_bytes"] / MIB for r in sel], "-", label=f"predicted ({label})")
        for m, marker in zip(measure, "ox"):
            ax.plot(x, [r[f"{m}_bytes"] / MIB for r in sel], marker, label=f"{m} ({label})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak over the loaded model (MiB)")
    ax.set_title("kvb-planner: predicted vs measured request peak, SmolLM2-135M fp32 CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
