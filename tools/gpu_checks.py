"""Model-level GPU checks a CPU cannot run: the kernels inside a real architecture, the engine loop on CUDA, and
speculative decoding stacked on a layer-streamed target.

Every model here has SmolLM2-135M's architecture (the config and tokenizer of the embedded model) but seeded
random weights: the device machine has no registry access and the real weights do not fit the transfer limit.
Random weights make greedy near-ties common, so token agreement is reported beside teacher-forced logit
errors measured against an fp32 reference (the figure that does not depend on ties).

    python tools/gpu_checks.py --model-dir <folder with config.json + tokenizer files> --out gpu_checks.json

Sections (each independent; a failure is recorded and the next one runs):
  kernels_in_model  sdpa vs kvb_attention in fp16 and bf16: prefill logits vs fp32, greedy tokens.
  engine_cuda       KVBoost on CUDA: exact-prefix hit vs no-cache logits (fp32 and bf16), greedy batch vs HF.
  spec_streaming    speculative decoding on a StreamingCausalLM target (full_stream, 2 slots): identical greedy
                    tokens, tokens per target forward and speed vs plain streamed decoding.
  memory_share      gpu_memory_utilization 0.3 / 0.6: the pool's blocks, the device's peak while a full batch
                    of long prompts runs against total x fraction (the profiled step must cover the loop's).
  engine_cuda_kernel  engine_cuda with attention_backend="kvb_kernels" (the block-table kernel reads the pool).
  loop_kernel       the loop's two attention backends side by side: logits over one schedule, decode and
                    prefill step time and peak memory with 32 x 2000 / 8 x 8000-token contexts.
  planner_loop      kvb-planner's engine-loop estimate (PagedLoop) against each step's measured peak on CUDA
                    (max_memory_allocated above the step's start), fp32 and bf16, long prompts beside decoders.
  kernels_trained   kernels_in_model on the real SmolLM2-135M-Instruct weights (--trained-dir) and real text
  engine_trained    engine_cuda on the real weights and real text (pydoc topics instead of random ids)
  features_cuda     every request option through the engine loop on the device (tools/gpu_features.py):
                    bans, biases, stops, seeds, penalties, logprobs, grammars, aborts, priority, threads,
                    KIVI live KV, prompt-lookup speculation; fp32 over SDPA and bf16 over the default backend
  server_cuda       kvboost-server on the device over HTTP (tools/gpu_server.py): chat, streams, echo logprobs,
                    n, json_schema, tools, vLLM extras, Responses, a 400, 16 concurrent streams, metrics

The trained sections need ``--trained-dir``: a safetensors folder of SmolLM2-135M-Instruct (the embedded GGUF
converted on the machine, ``kvb_cache.embedded``), since trained weights have few near-ties and random ones
many, so greedy identity in fp16/bf16 only means something with them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import gpu_features  # tools/ is on sys.path when a script here runs
import gpu_server
import torch

from kvb_cache.cache_kwarg import cache_kwargs

LOG = logging.getLogger("gpu_checks")
#: Where everything runs; ``--device cpu`` is a smoke test of this script only (the kernels then fall back).
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def measured_step(engine) -> tuple[float, int]:
    """One ``engine.step()`` on CUDA: its seconds and its peak allocation above the memory at its start."""
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base


def random_model_dir(src: Path, dst: Path) -> Path:
    """Save SmolLM2's config + tokenizer with seeded random weights (fp32) under ``dst``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (dst / "model.safetensors").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in {".json", ".jinja"} and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dst)
    return dst


def load(path: Path, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(DEVICE).eval()


def random_tokens(vocab: int = 49152) -> Callable[[int, torch.Generator], list[int]]:
    """``draw(n, gen)``: n seeded random token ids (the random-weights sections)."""
    return lambda n, gen: torch.randint(3, vocab, (n,), generator=gen).tolist()


def text_tokens(path: Path) -> Callable[[int, torch.Generator], list[int]]:
    """``draw(n, gen)``: n consecutive tokens of Python's pydoc topics from a seeded offset (real text, for
    trained weights: random ids put a trained model far outside its distribution)."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    stream = tokenizer("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]

    def draw(n: int, gen: torch.Generator) -> list[int]:
        start = int(torch.randint(0, len(stream) - n, (1,), generator=gen))
        return stream[start : start + n]

    return draw


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class FallbackCounter(logging.Handler):
    """Counts kvb_kernels' 'falls back to SDPA' warnings, so a silent fallback cannot pass as the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())


def kernels_in_model(path: Path, draw: Callable[[int, torch.Generator], list[int]]) -> dict:
    from kvb_kernels import register_kvb_attention

    register_kvb_attention()
    counter = FallbackCounter()
    logging.getLogger("kvb_kernels").addHandler(counter)
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([draw(777, gen) for _ in range(4)], device=DEVICE)
    with torch.inference_mode():
        ref = load(path, torch.float32, "sdpa")
        torch.backends.cuda.matmul.allow_tf32 = False
        ref_logits = ref(ids).logits.float()
        ref_argmax = ref_logits.argmax(-1)
        scale = ref_logits.std().item()
        del ref
        out: dict = {"prompt_shape": list(ids.shape), "ref_logit_std": scale, "rows": []}
        for dtype in (torch.float16, torch.bfloat16):
            tokens = {}
            for impl in ("sdpa", "kvb_attention"):
                model = load(path, dtype, impl)
                logits = model(ids).logits.float()
                err = (logits - ref_logits).abs()
                greedy = model.generate(
                    ids[:1, :256], max_new_tokens=64, do_sample=False, min_new_tokens=64, pad_token_id=0
                )[0, 256:].tolist()
                tokens[impl] = greedy
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "attn": impl,
                    "max_abs_err_vs_fp32": err.max().item(),
                    "mean_abs_err_vs_fp32": err.mean().item(),
                    "argmax_agreement_vs_fp32": (logits.argmax(-1) == ref_argmax).float().mean().item(),
                }
                out["rows"].append(row)
                print(row, flush=True)
                del model
            out["rows"][-1]["greedy_first_divergence_vs_sdpa"] = first_divergence(
                tokens["sdpa"], tokens["kvb_attention"]
            )
            out["rows"][-1]["greedy_identical_vs_sdpa"] = tokens["sdpa"] == tokens["kvb_attention"]
    out["fallbacks"] = sorted(set(counter.reasons))
    return out


def engine_cuda(
    path: Path, draw: Callable[[int, torch.Generator], list[int]], backends: tuple[str, ...] = ("sdpa",)
) -> dict:
    from kvb_cache import KVBoost

    out: dict = {"rows": []}
    for backend, dtype in [(b, d) for b in backends for d in ("float32", "bfloat16")]:
        gen = torch.Generator().manual_seed(2)
        shared = draw(300, gen)
        torch.backends.cuda.matmul.allow_tf32 = False
        engine = KVBoost.from_pretrained(
            str(path), device=DEVICE, dtype=dtype, max_num_batched_tokens=2048, attention_backend=backend
        )
        model = engine.model
        prompt = shared + draw(420, gen)
        with torch.inference_mode():
            ref = model(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float()
        miss = engine.next_token_logits(prompt)
        hit = engine.next_token_logits(prompt)
        longer = [*prompt, 17, 42, 99]
        with torch.inference_mode():
            ref_longer = model(torch.tensor([longer], device=DEVICE)).logits[0, -1].float()
        extend = engine.next_token_logits(longer)
        prompts = [shared + draw(n, gen) for n in (5, 40, 90, 130)]
        batch = engine.generate_batch(prompts, max_new_tokens=32, ignore_eos=True)
        same = 0
        divergences = []
        with torch.inference_mode():
            for p, r in zip(prompts, batch, strict=True):
                hf = model.generate(
                    torch.tensor([p], device=DEVICE), max_new_tokens=32, min_new_tokens=32, do_sample=False
                )[0, len(p) :].tolist()
                same += hf == r.output_ids
                divergences.append(first_divergence(hf, r.output_ids))
        row = {
            "attention_backend": backend,
            "kernel": engine.core.runner.kernel is not None,
            "dtype": dtype,
            "miss_max_abs_err": (miss.logits.float().to(ref.device) - ref).abs().max().item(),
            "hit_cached_tokens": hit.cached_tokens,
            "hit_max_abs_err": (hit.logits.float().to(ref.device) - ref).abs().max().item(),
            "extend_cached_tokens": extend.cached_tokens,
            "extend_max_abs_err": (extend.logits.float().to(ref.device) - ref_longer).abs().max().item(),
            "prompt_tokens": len(prompt),
            "batch_identical_to_hf_greedy": f"{same}/{len(prompts)}",
            "batch_first_divergence": divergences,
            "batch_cached_tokens": [r.cached_tokens for r in batch],
            "paged": engine.paged_stats().as_dict(),
        }
        out["rows"].append(row)
        print(row, flush=True)
        engine.close()
        del engine, model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def loop_kernel(path: Path) -> dict:
    """The engine loop's attention backends side by side on CUDA: kvb-kernels' block-table kernel reading the
    pool in place against gather + SDPA. Per dtype: every step's sampled logits over one schedule (a shared
    prefix, prefills beside decodes) compared between the two; then time and peak memory above the step's start
    of decode steps with ``D`` requests of ``ctx`` tokens, and of a long prompt's prefill slices."""
    from kvb_cache import KVBoost, SamplingParams

    out: dict = {"agreement": [], "speed": []}
    for dtype in () if os.environ.get("GPU_CHECKS_SPEED_ONLY") else ("float32", "bfloat16"):
        torch.backends.cuda.matmul.allow_tf32 = False
        gen = torch.Generator().manual_seed(4)
        scale = 1 if DEVICE == "cuda" else 10  # the CPU smoke test runs the kernel interpreted
        shared = torch.randint(3, 49152, (600 // scale,), generator=gen).tolist()
        prompts = [
            shared + torch.randint(3, 49152, (n // scale,), generator=gen).tolist() for n in (7, 150, 400)
        ]
        prompts.append(torch.randint(3, 49152, (900 // scale,), generator=gen).tolist())
        runs = {}
        for backend in ("sdpa", "kvb_kernels"):
            engine = KVBoost.from_pretrained(
                str(path),
                device=DEVICE,
                dtype=dtype,
                max_num_batched_tokens=512 // scale,
                attention_backend=backend,
            )
            logits, forward = [], engine.core.runner.forward

            def recording(seqs, forward=forward, logits=logits):
                result = forward(seqs)
                logits.append(result.float().clone())
                return result

            engine.core.runner.forward = recording
            params = SamplingParams(max_new_tokens=24 // scale + 2, temperature=0, ignore_eos=True)
            ids = [engine.add_request(prompts[0], params)]
            engine.step()
            ids += [engine.add_request(p, params) for p in prompts[1:]]
            outputs: dict = {}
            while engine.has_unfinished():
                for o in engine.step():
                    if o.result is not None:
                        outputs[o.request_id] = list(o.result.output_ids)
            runs[backend] = (logits, [outputs.get(i) for i in ids], engine.core.runner.kernel is not None)
            engine.close()
        (ref, ref_tokens, _), (got, tokens, used) = runs["sdpa"], runs["kvb_kernels"]
        row = {
            "dtype": dtype,
            "kernel_used": used,
            "steps": [len(ref), len(got)],
            "max_abs_logit_diff": max((a - b).abs().max().item() for a, b in zip(ref, got) if a.numel()),
            "argmax_agreement": sum(
                int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref, got) if a.numel()
            )
            / max(1, sum(a.shape[0] for a in ref)),
            "greedy_identical": f"{sum(a == b for a, b in zip(ref_tokens, tokens))}/{len(tokens)}",
        }
        out["agreement"].append(row)
        print(row, flush=True)
        if DEVICE != "cuda":
            break  # the CPU smoke test: float32 agreement only
    for dtype, decoders, context in (
        [] if DEVICE != "cuda" else (("bfloat16", 32, 2000), ("bfloat16", 8, 7900), ("float32", 32, 2000))
    ):
        row = {"dtype": dtype, "D": decoders, "ctx": context}
        for backend in ("sdpa", "kvb_kernels"):
            engine = KVBoost.from_pretrained(
                str(path),
                device=DEVICE,
                dtype=dtype,
                max_num_batched_tokens=2048,
                max_cache_bytes=24 << 30,
                attention_backend=backend,
            )
            gen = torch.Generator().manual_seed(decoders)
            params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
            for _ in range(decoders):
                engine.add_request(torch.randint(3, 49152, (context,), generator=gen).tolist(), params)
            prefill_s, prefill_peak = [], []
            while engine.core.scheduler.waiting or any(
                r.num_computed < r.prompt_len for r in engine.core.scheduler.running
            ):
                seconds, peak = measured_step(engine)
                prefill_s.append(seconds)
                prefill_peak.append(peak)
            decode_s, decode_peak = [], []
            for _ in range(12):
                seconds, peak = measured_step(engine)
                decode_s.append(seconds)
                decode_peak.append(peak)
            steady = sorted(decode_s[2:])
            row[backend] = {
                "kernel_used": engine.core.runner.kernel is not None,
                "prefill_steps": len(prefill_s),
                "prefill_s_total": sum(prefill_s[1:]),  # the first step compiles
                "prefill_peak_mib": max(prefill_peak) / 2**20,
                "decode_step_ms_median": 1000 * steady[len(steady) // 2],
                "decode_peak_mib": max(decode_peak) / 2**20,
            }
            engine.close()
            del engine
            torch.cuda.empty_cache()
        row["decode_speedup"] = (
            row["sdpa"]["decode_step_ms_median"] / row["kvb_kernels"]["decode_step_ms_median"]
        )
        out["speed"].append(row)
        print(row, flush=True)
    return out


def memory_share(path: Path) -> dict:
    """Does ``gpu_memory_utilization`` keep the process inside its share? The pool is sized from one profiled
    plain forward plus the loop attention's transients (``gpu_budget.loop_attention_bytes``); the engine
    loop's own steps must stay below it: a batch of mid-length prompts, then 32 prompts near the model's
    context decoding together (the padded gather of every row's context, in sub-batches)."""
    from kvb_cache import KVBoost

    rows = []
    total = torch.cuda.mem_get_info()[1]
    gen = torch.Generator().manual_seed(3)
    workloads = {
        "16 x 1500": [torch.randint(3, 49152, (1500,), generator=gen).tolist() for _ in range(16)],
        "32 x 7900": [torch.randint(3, 49152, (7900,), generator=gen).tolist() for _ in range(32)],
    }
    for fraction in (0.3, 0.6):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = KVBoost.from_pretrained(
            str(path),
            device=DEVICE,
            dtype="bfloat16",
            gpu_memory_utilization=fraction,
            max_num_batched_tokens=2048,
        )
        row: dict = {
            "fraction": fraction,
            "num_blocks": engine.kv.pool.num_blocks,
            "share_gib": total * fraction / 2**30,
        }
        for name, prompts in workloads.items():
            start = time.perf_counter()
            engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
            sync()
            row[f"{name} seconds"] = time.perf_counter() - start
            row[f"peak_reserved_gib after {name}"] = torch.cuda.max_memory_reserved() / 2**30
        peak = torch.cuda.max_memory_reserved()
        row["peak_reserved_gib"] = peak / 2**30
        row["margin_mib"] = (total * fraction - peak) / 2**20
        row["within_share"] = peak <= total * fraction
        row["cuda_graphs"] = engine.cache_stats().get("cuda_graphs")
        rows.append(row)
        print(row, flush=True)
        engine.close()
        del engine
    return {"rows": rows}


def _server_module(name: str):
    """``kvb_server.<name>`` without the package's ``__init__``, which imports the HTTP app (fastapi): the device
    machine has torch and transformers but not the server's web stack, and the planner wiring needs none of it."""
    import importlib
    import importlib.util
    import types

    if "kvb_server" not in sys.modules:
        try:
            import kvb_server  # noqa: F401
        except ModuleNotFoundError:
            spec = importlib.util.find_spec("kvb_server")
            package = types.ModuleType("kvb_server")
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules["kvb_server"] = package
    return importlib.import_module(f"kvb_server.{name}")


def planner_loop(path: Path) -> dict:
    """Is kvb-planner's engine-loop estimate an upper bound of the loop's steps on CUDA? For each case a
    ``P``-token prompt prefills in steps of ``S`` beside ``D`` decoding requests of ``ctx`` tokens; every step's
    peak allocation above its start is measured and compared with
    ``estimate_memory(..., device="cuda:0", loop=PagedLoop(**engine.step_limits))`` (on the CPU, the smoke
    test, the profiled tensor peak instead)."""
    import dataclasses

    from kvb_cache import KVBoost, SamplingParams
    from kvb_planner import LadderStep, ModelShape, PagedLoop, PlanRequest, estimate_memory

    shape_for_engine = _server_module("planner_gate").shape_for_engine

    def step_peak(engine) -> int:
        if DEVICE != "cuda":
            from kvb_planner import tensor_peak

            return tensor_peak(engine.step)
        return measured_step(engine)[1]

    cases = [
        (1024, 4000, 0, 0),
        (1024, 8000, 0, 0),
        (4096, 8000, 0, 0),
        (2048, 4000, 16, 3000),
        (4096, 1000, 32, 7000),
    ]
    if DEVICE != "cuda":
        cases = [(256, 600, 2, 300)]  # the smoke test: minutes of CPU, not hours
    rows = []
    for dtype in ("float32", "bfloat16"):
        for step, prompt, decoders, context in cases:
            engine = KVBoost.from_pretrained(
                str(path),
                device=DEVICE,
                dtype=dtype,
                max_num_batched_tokens=step,
                max_num_seqs=32,
                max_cache_bytes=24 << 30,
            )
            gen = torch.Generator().manual_seed(prompt + decoders)
            params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
            for _ in range(decoders):
                engine.add_request(torch.randint(3, 49152, (context,), generator=gen).tolist(), params)
            for _ in range(decoders * context // step + 2):
                engine.step()
            new = 4
            engine.add_request(
                torch.randint(3, 49152, (prompt,), generator=gen).tolist(),
                SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True),
            )
            peaks = [step_peak(engine) for _ in range(-(-prompt // step) + 1)]
            model = engine.model
            shape = shape_for_engine(ModelShape.from_config(model.config, dtype=model.dtype), engine)
            loop = PagedLoop(**dataclasses.asdict(engine.step_limits))
            device = "cuda:0" if DEVICE == "cuda" else "cpu"
            est = estimate_memory(
                PlanRequest(prompt_tokens=prompt, max_new_tokens=new),
                LadderStep(prefill_chunk_size=None),
                shape,
                device=device,
                loop=loop,
                cpu_threads=torch.get_num_threads() if device == "cpu" else None,
            )
            row = {
                "dtype": dtype,
                "S": step,
                "P": prompt,
                "D": decoders,
                "ctx": context,
                "actual_mib": max(peaks) / 2**20,
                "predicted_mib": est.peak_bytes / 2**20,
                "ratio": est.peak_bytes / max(max(peaks), 1),
                "covered": est.peak_bytes >= max(peaks),
                "step_peaks_mib": [round(p / 2**20, 1) for p in peaks],
            }
            rows.append(row)
            print(row, flush=True)
            engine.close()
            del engine, model
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows}


def spec_streaming(args: argparse.Namespace) -> dict:
    from transformers import DynamicCache, LlamaConfig

    from kvb_speculative import DraftModelDrafter, PromptLookupDrafter, speculative_generate
    from kvb_streaming import StreamingCausalLM, StreamingConfig, get_runtime
    from kvb_streaming.packer import save_random_awq_checkpoint

    path = Path(args.awq_dir)
    if not (path / "config.json").is_file():
        config = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=args.awq_layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
        save_random_awq_checkpoint(config, path, group_size=128, device=DEVICE)
    streamed = StreamingCausalLM.from_pretrained(
        path,
        streaming_config=StreamingConfig(residency_mode="full_stream", n_staging_slots=2),
        device=DEVICE,
        dtype=torch.float16,
    )
    runtime = get_runtime(streamed)
    gen = torch.Generator().manual_seed(3)
    # A prompt that repeats itself, so prompt lookup has matches to propose (the agent / RAG / code-edit case).
    block = torch.randint(3, 32000, (64,), generator=gen)
    ids = torch.cat([block, block, block[:40]]).unsqueeze(0).to(DEVICE)
    new = args.spec_new_tokens

    def plain() -> tuple[list[int], float, int]:
        runtime.scheduler.reset_stats()
        cache = DynamicCache(config=streamed.config)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            logits = streamed(input_ids=ids, **cache_kwargs(streamed, cache), use_cache=True).logits
            tokens = [int(logits[0, -1].argmax())]
            while len(tokens) < new:
                logits = streamed(
                    input_ids=torch.tensor([[tokens[-1]]], device=DEVICE),
                    **cache_kwargs(streamed, cache),
                    use_cache=True,
                ).logits
                tokens.append(int(logits[0, -1].argmax()))
        sync()
        return tokens, time.perf_counter() - start, runtime.stats().forwards

    plain()  # warm-up: cuBLAS heuristics, allocator, first-call kernel selection
    base_tokens, base_s, base_forwards = plain()
    out: dict = {
        "target": f"random AWQ Llama {args.awq_layers} x 4096/14336, full_stream x2 slots, fp16",
        "plain": {"tokens": new, "seconds": base_s, "target_forwards": base_forwards, "tok_s": new / base_s},
        "rows": [],
    }
    print(out["plain"], flush=True)
    drafters = {"prompt_lookup": lambda: PromptLookupDrafter()}
    # A resident copy of the target as its own draft: acceptance 1.0, so this is the ceiling of what a perfect
    # drafter buys on a streamed target (random weights make any smaller draft disagree).
    resident = StreamingCausalLM.from_pretrained(
        path,
        streaming_config=StreamingConfig(residency_mode="full_resident"),
        device=DEVICE,
        dtype=torch.float16,
    )
    drafters["self_draft_resident (ceiling)"] = lambda: DraftModelDrafter(streamed, resident)
    for name, make in drafters.items():
        for gamma in (4, 8):
            runtime.scheduler.reset_stats()
            sync()
            start = time.perf_counter()
            with torch.inference_mode():
                res = speculative_generate(
                    streamed, ids, make(), gamma=gamma, max_new_tokens=new, eos_token_id=[]
                )
            sync()
            seconds = time.perf_counter() - start
            tokens = res.tokens.tolist()
            row = {
                "drafter": name,
                "gamma": gamma,
                "identical_to_plain": tokens == base_tokens[: len(tokens)] and len(tokens) == new,
                "first_divergence": first_divergence(base_tokens, tokens),
                "target_forwards": runtime.stats().forwards,
                "tokens_per_target_forward": len(tokens) / max(runtime.stats().forwards, 1),
                "acceptance_rate": res.stats.acceptance_rate,
                "seconds": seconds,
                "speedup_vs_plain": base_s / seconds,
            }
            out["rows"].append(row)
            print(row, flush=True)
    return out


def launch_overhead() -> dict:
    """Decode attention: eager time (CUDA events around the Python call) vs CUDA-graph replay (GPU time alone),
    and the host functions that dominate an eager call."""
    import cProfile
    import io
    import pstats

    from kvb_kernels import flash_attention

    def timed(fn, reps: int = 50) -> float:
        for _ in range(5):
            fn()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        sync()
        return start.elapsed_time(end) / reps

    out: dict = {"rows": []}
    for kv_len in (4096, 16384, 65536):
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 8, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        moved = 2 * k.numel() * k.element_size()
        eager_ms = timed(lambda q=q, k=k, v=v: flash_attention(q, k, v))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            flash_attention(q, k, v)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            flash_attention(q, k, v)
        graph_ms = timed(graph.replay)
        row = {
            "kv_len": kv_len,
            "eager_ms": eager_ms,
            "graph_ms": graph_ms,
            "eager_gbs": moved / eager_ms / 1e6,
            "graph_gbs": moved / graph_ms / 1e6,
        }
        out["rows"].append(row)
        print(row, flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        flash_attention(q, k, v)
    profiler.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    out["host_profile_200_calls"] = text.getvalue()
    print(text.getvalue()[:4000], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir", required=True, help="SmolLM2 config + tokenizer files (weights unused)"
    )
    parser.add_argument(
        "--trained-dir", help="SmolLM2-135M-Instruct safetensors folder (kernels_trained, engine_trained)"
    )
    parser.add_argument("--work-dir", default="/tmp/kvb_gpu_checks")
    parser.add_argument("--awq-dir", default="/tmp/kvb_streaming_bench_model")
    parser.add_argument("--awq-layers", type=int, default=32)
    parser.add_argument("--spec-new-tokens", type=int, default=48)
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["kernels_in_model", "engine_cuda", "spec_streaming", "launch_overhead", "memory_share"],
    )
    parser.add_argument("--out", default="gpu_checks.json")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_checks needs a CUDA GPU; nothing was checked.", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    path = random_model_dir(Path(args.model_dir), Path(args.work_dir) / "smollm2-shaped-random")
    results: dict = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    import transformers

    results["transformers"] = transformers.__version__

    def trained() -> Path:
        if not args.trained_dir:
            raise SystemExit("kernels_trained / engine_trained need --trained-dir")
        return Path(args.trained_dir)

    sections = {
        "kernels_in_model": lambda: kernels_in_model(path, random_tokens()),
        "engine_cuda": lambda: engine_cuda(path, random_tokens()),
        "engine_cuda_kernel": lambda: engine_cuda(path, random_tokens(), ("kvb_kernels",)),
        "loop_kernel": lambda: loop_kernel(path),
        "kernels_trained": lambda: kernels_in_model(trained(), text_tokens(trained())),
        "engine_trained": lambda: engine_cuda(trained(), text_tokens(trained())),
        "spec_streaming": lambda: spec_streaming(args),
        "launch_overhead": launch_overhead,
        "memory_share": lambda: memory_share(path),
        "planner_loop": lambda: planner_loop(path),
        "features_cuda": lambda: gpu_features.features(path, DEVICE),
        "server_cuda": lambda: gpu_server.server_http(
            path, DEVICE, "bfloat16" if DEVICE == "cuda" else "float32"
        ),
    }
    for name in args.sections:
        start = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception:  # record and go on: device time is scarce
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr, flush=True)
        results[name + "_seconds"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
