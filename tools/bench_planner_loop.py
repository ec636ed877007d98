"""The memory planner against the engine loop: predicted vs profiled step peaks on SmolLM2-135M (fp32, CPU).

For each case the embedded model is served by a ``kvb_cache.KVBoost`` engine loop with
``max_num_batched_tokens`` S; ``D`` requests of ``ctx`` prompt tokens are put into decode first, then a
``P``-token prompt is added and every step until it has prefilled is run under ``torch.profiler``. "Actual"
is the largest step's peak of live tensor bytes (deterministic; what the planner's memory model
describes). Beside it, what the server's gate predicts for that request:

- ``loop``: ``kvb_planner.estimate_memory(..., loop=PagedLoop(**engine.step_limits))``: no KV (it is in the
  pool), a full step's activations, the loop attention's gathered context and masks, the decode gather, the
  sampler; the probed thread count for the CPU attention tiles. What the gate charges now.
- ``per-request``: the same request planned on a cache of its own (as the gate did before): its whole KV, a
  prefill as long as the prompt, no loop attention.

Both are upper bounds by design: ``loop`` charges a full step and the largest decode gather the engine can
reach (so a short prompt alone is over-predicted); the useful figures are how close it gets where the
request's own terms dominate, and that it never falls below the actual peak.

Writes docs/planner_loop_bench.json; prints a table. Run: ``nox -s "bench(name='planner_loop')"`` or
``python tools/bench_planner_loop.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import torch

from kvb_planner import tensor_peak

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MIB = 1 << 20
#: (S step tokens, P prompt tokens, D decoding requests beside it, their prompt tokens)
CASES = (
    (1024, 500, 0, 0),
    (1024, 2000, 0, 0),
    (1024, 4000, 0, 0),
    (1024, 8000, 0, 0),
    (256, 4000, 0, 0),
    (4096, 4000, 0, 0),
    (4096, 8000, 0, 0),
    (1024, 4000, 8, 400),
    (1024, 200, 16, 400),
    # 32 decoding rows of 2500 tokens: 26 rows x 2500 positions gathered per sub-batch (of at most 65536).
    (4096, 1000, 32, 2500),
)


def _measure(path: str, step: int, prompt: int, decoders: int, decode_context: int, max_seqs: int) -> dict:
    from kvb_cache import KVBoost, SamplingParams
    from kvb_planner import DeviceProfile, LadderStep, ModelShape, PagedLoop, PlanRequest, estimate_memory
    from kvb_server.planner_gate import shape_for_engine

    engine = KVBoost.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=step,
        max_num_seqs=max_seqs,
        max_cache_bytes=6 << 30,
    )
    g = torch.Generator().manual_seed(prompt + decoders)
    for _ in range(decoders):
        ids = torch.randint(100, 40000, (decode_context,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True))
    for _ in range(decoders * decode_context // step + 2):  # their prefills, so they decode from now on
        engine.step()
    ids = torch.randint(100, 40000, (prompt,), generator=g).tolist()
    new = 4
    engine.add_request(ids, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
    peaks = [tensor_peak(engine.step) for _ in range(-(-prompt // step) + 1)]

    model = engine.model
    shape = shape_for_engine(ModelShape.from_config(model.config, dtype=model.dtype), engine)
    loop = PagedLoop(**dataclasses.asdict(engine.step_limits))
    threads = DeviceProfile.probe("cpu").cpu_threads
    request = PlanRequest(prompt_tokens=prompt, max_new_tokens=new)
    single = LadderStep(prefill_chunk_size=None)
    looped = estimate_memory(request, single, shape, device="cpu", loop=loop, cpu_threads=threads)
    solo = estimate_memory(request, single, shape, device="cpu")
    actual = max(peaks)
    return {
        "step_tokens": step,
        "prompt_tokens": prompt,
        "decoding_requests": decoders,
        "decode_context": decode_context if decoders else 0,
        "actual_mib": round(actual / MIB, 1),
        "step_peaks_mib": [round(p / MIB, 1) for p in peaks],
        "loop_predicted_mib": round(looped.peak_bytes / MIB, 1),
        "loop_ratio": round(looped.peak_bytes / actual, 2),
        "per_request_predicted_mib": round(solo.peak_bytes / MIB, 1),
        "per_request_ratio": round(solo.peak_bytes / actual, 2),
        "loop_terms_mib": {
            "attention_phase": round(looped.attention_phase_bytes / MIB, 1),
            "of_which_gather_masks": round(looped.attention_scratch_bytes / MIB, 1),
            "mlp_phase": round(looped.mlp_phase_bytes / MIB, 1),
            "logits": round(looped.logits_bytes / MIB, 1),
            "sampler": round(looped.sampler_bytes / MIB, 1),
        },
        "loop": dataclasses.asdict(loop),
        "cpu_threads": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--decode-context", type=int, default=400, help="prompt tokens of each decoding request"
    )
    parser.add_argument("--out", type=Path, default=DOCS / "planner_loop_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kvb_cache.embedded import embedded_model_path

    path = embedded_model_path()
    rows = []
    header = (
        f"{'S':>5} {'P':>5} {'D':>3} {'ctx':>5} | {'actual MiB':>10} | {'loop MiB':>8} {'ratio':>5} | "
        f"{'per-request MiB':>15} {'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    for step, prompt, decoders, context in CASES:
        row = _measure(path, step, prompt, decoders, context, args.max_num_seqs)
        rows.append(row)
        print(
            f"{step:>5} {prompt:>5} {decoders:>3} {context:>5} | {row['actual_mib']:>10} | {row['loop_predicted_mib']:>8} "
            f"{row['loop_ratio']:>5} | {row['per_request_predicted_mib']:>15} {row['per_request_ratio']:>5}",
            flush=True,
        )
    payload = {
        "model": "SmolLM2-135M-Instruct (embedded), float32, CPU",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "rows": rows,
    }
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
