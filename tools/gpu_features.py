"""The engine's request options on a CUDA device: every option a request can carry, through the engine loop
(and the speculative and live-quantized paths beside it), each checked by a property that does not depend on
the weights, so random weights of SmolLM2's shape are enough.

The CPU test suites check these options on tiny models on the CPU; what they cannot check is that each
option's tensors (bans, biases, penalties, grammar bitmasks, seeded generators, logprob gathers) live on the
model's device. Used by ``tools/gpu_checks.py --sections features_cuda``; ``--device cpu`` smoke-tests it.

Each check returns a dict with ``ok`` (the property held) and what was seen; an exception is recorded as the
check's error and the next check runs.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def _tokens(engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.tokenizer.vocab_size, (n,), generator=gen).tolist()


def _ref_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 log-softmax of the model's own forward over ``ids`` (no cache)."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids], device=engine.model.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_allowed_token_ids(engine, greedy: Callable) -> dict:
    allowed = [101, 202, 303, 404]
    out = engine.generate(
        _tokens(engine, 40, 1), allowed_token_ids=allowed, max_new_tokens=12, ignore_eos=True
    )
    return {"ok": len(out.output_ids) == 12 and set(out.output_ids) <= set(allowed), "tokens": out.output_ids}


def check_bad_words(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 2)
    plain = greedy(prompt, 12)
    banned = plain[0]
    out = engine.generate(prompt, bad_words_ids=[[banned]], max_new_tokens=12, ignore_eos=True)
    return {"ok": banned not in out.output_ids, "banned": banned, "plain": plain, "tokens": out.output_ids}


def check_logit_bias(engine, greedy: Callable) -> dict:
    out = engine.generate(_tokens(engine, 40, 3), logit_bias={777: 100.0}, max_new_tokens=6, ignore_eos=True)
    return {"ok": out.output_ids == [777] * 6, "tokens": out.output_ids}


def check_stop_token_and_min_tokens(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 4)
    plain = greedy(prompt, 16)
    stop = plain[3]
    first = plain.index(stop)
    stopped = engine.generate(prompt, stop_token_ids=[stop], max_new_tokens=16, ignore_eos=True)
    held = engine.generate(prompt, stop_token_ids=[stop], min_tokens=10, max_new_tokens=16, ignore_eos=True)
    return {
        "ok": len(stopped.output_ids) == first + 1
        and stopped.stop_reason == stop
        and len(held.output_ids) >= 10
        and stop not in held.output_ids[:10],
        "stop": stop,
        "stopped_len": len(stopped.output_ids),
        "held_len": len(held.output_ids),
    }


def check_stop_string(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 5)
    full = engine.generate(prompt, max_new_tokens=16, ignore_eos=True).output_text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        return {"ok": True, "skipped": "blank stop string", "text": full}
    out = engine.generate(prompt, stop=[stop], max_new_tokens=16, ignore_eos=True)
    return {
        "ok": out.finish_reason == "stop"
        and stop not in out.output_text
        and full.startswith(out.output_text),
        "stop": stop,
        "text": out.output_text,
    }


def check_seeded_sampling(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 6)
    opts = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, seed=7, max_new_tokens=12, ignore_eos=True)
    a = engine.generate(prompt, **opts).output_ids
    b = engine.generate(prompt, **opts).output_ids
    batch = engine.generate_batch(
        [prompt, _tokens(engine, 30, 60), prompt],
        sampling=[opts, dict(opts, seed=8), dict(opts, seed=9)],
    )
    return {
        "ok": a == b == batch[0].output_ids and batch[2].output_ids != a,
        "solo": a,
        "in_batch": batch[0].output_ids,
    }


def check_penalties(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 7)
    opts = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, max_new_tokens=12)
    solo = engine.generate(prompt, ignore_eos=True, **opts).output_ids
    batch = engine.generate_batch([_tokens(engine, 50, 70), prompt], ignore_eos=True, **opts)
    plain = greedy(prompt, 12)
    return {"ok": solo == batch[1].output_ids, "solo": solo, "in_batch": batch[1].output_ids, "plain": plain}


def check_logprobs(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 40, 8)
    out = engine.generate(prompt, logprobs=5, max_new_tokens=8, ignore_eos=True)
    ref = _ref_logprobs(engine, prompt + out.output_ids[:-1])[len(prompt) - 1 :]
    err = max(abs(lp.logprob - ref[i, lp.token_id].item()) for i, lp in enumerate(out.logprobs))
    tops_ok = all(len(lp.top) == 5 and lp.top[0][2] >= lp.top[-1][2] for lp in out.logprobs)
    return {"ok": tops_ok and len(out.logprobs) == 8, "max_abs_err_vs_forward": err}


def check_prompt_logprobs(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 300, 9)
    got = engine.prompt_logprobs(prompt, top_logprobs=2)
    ref = _ref_logprobs(engine, prompt)
    err = max(abs(lp.logprob - ref[i, prompt[i + 1]].item()) for i, lp in enumerate(got))
    return {"ok": len(got) == len(prompt) - 1, "max_abs_err_vs_forward": err}


def check_structured(engine, greedy: Callable) -> dict:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return {"ok": None, "skipped": "llguidance not installed"}
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 99}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    outs = engine.generate_batch(
        [_tokens(engine, 30, 10), _tokens(engine, 30, 11)],
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        max_new_tokens=40,
    )
    parsed = [json.loads(o.output_text) for o in outs if o.finish_reason == "stop"]
    return {
        "ok": len(parsed) == 2
        and all(p["color"] in ("red", "green") and isinstance(p["n"], int) for p in parsed),
        "texts": [o.output_text for o in outs],
    }


def check_no_token_error(engine, greedy: Callable) -> dict:
    from kvb_cache import InvalidRequestError

    eos = engine.tokenizer.eos_token_id
    try:
        engine.generate(_tokens(engine, 20, 12), allowed_token_ids=[eos], min_tokens=4, max_new_tokens=8)
    except InvalidRequestError as exc:
        return {"ok": exc.param == "allowed_token_ids", "error": str(exc)}
    return {"ok": False, "error": "no InvalidRequestError"}


def check_abort_mid_run(engine, greedy: Callable) -> dict:
    from kvb_cache import SamplingParams

    prompts = [_tokens(engine, 60 + 10 * i, 20 + i) for i in range(3)]
    solos = [greedy(p, 10) for p in prompts]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    outs: dict = {r: [] for r in rids}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
    engine.abort(rids[1])
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
    return {
        "ok": outs[rids[0]] == solos[0] and outs[rids[2]] == solos[2] and len(outs[rids[1]]) < 10,
        "kept": [outs[rids[0]] == solos[0], outs[rids[2]] == solos[2]],
    }


def check_priority(engine, greedy: Callable) -> dict:
    from kvb_cache import SamplingParams

    if engine.config.scheduling_policy != "priority":
        return {"ok": None, "skipped": "engine not built with scheduling_policy='priority'"}
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    backlog = [engine.add_request(_tokens(engine, 200, 30 + i), params, priority=5) for i in range(12)]
    urgent = engine.add_request(_tokens(engine, 200, 99), params, priority=0)
    finished: list = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    place = finished.index(urgent)
    return {"ok": place < len(backlog) - engine.config.max_num_seqs, "urgent_finished_at": place}


def check_stream_equals_generate(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 50, 13)
    text = "".join(ev.delta_text for ev in engine.stream(prompt, max_new_tokens=12, ignore_eos=True))
    return {"ok": text == engine.generate(prompt, max_new_tokens=12, ignore_eos=True).output_text}


def check_threads(engine, greedy: Callable) -> dict:
    prompts = [_tokens(engine, 80 + 7 * i, 40 + i) for i in range(4)]
    solos = [greedy(p, 10) for p in prompts]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = engine.generate(prompts[i], max_new_tokens=10, ignore_eos=True).output_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    same = [got.get(i) == solos[i] for i in range(4)]
    return {"ok": all(same), "same_as_solo": same}


def check_exact_prefix(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 333, 14)
    ref = _ref_logprobs(engine, prompt)[-1]
    miss = engine.next_token_logits(prompt)
    hit = engine.next_token_logits(prompt)
    lp = torch.log_softmax(hit.logits.float().to(ref.device), dim=-1)
    return {
        "ok": hit.cached_tokens > 0,
        "hit_cached_tokens": hit.cached_tokens,
        "hit_minus_miss_max_abs": (hit.logits.float() - miss.logits.float()).abs().max().item(),
        "hit_logprob_max_abs_err_vs_forward": (lp - ref).abs().max().item(),
    }


def check_kv_cache_bits(engine, greedy: Callable) -> dict:
    prompt = _tokens(engine, 120, 15)
    out = engine.generate(prompt, kv_cache_bits=8, max_new_tokens=8, ignore_eos=True)
    plain = greedy(prompt, 8)
    agree = sum(a == b for a, b in zip(out.output_ids, plain, strict=False))
    return {"ok": len(out.output_ids) == 8, "agreement_with_exact": f"{agree}/8"}


CHECKS = {
    name.removeprefix("check_"): fn
    for name, fn in globals().items()
    if name.startswith("check_") and callable(fn)
}


def run_checks(engine) -> dict:
    """Every check against ``engine``; ``{name: result}`` with ``ok`` True/False/None (skipped)."""

    def greedy(prompt: list[int], n: int) -> list[int]:
        return engine.generate(prompt, max_new_tokens=n, ignore_eos=True).output_ids

    results: dict = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(engine, greedy)
        except Exception:  # record and go on: device time is scarce
            results[name] = {"ok": False, "error": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results[name], default=str)[:300], flush=True)
    return results


def speculative_checks(path: Path, device: str, dtype: str) -> dict:
    """kvboost's composed engine with prompt-lookup speculation: greedy equals the plain engine's."""
    import kvboost

    gen = torch.Generator().manual_seed(16)
    block = torch.randint(3, 49152, (48,), generator=gen).tolist()
    prompt = block * 3  # repeats, so prompt lookup proposes drafts
    with kvboost.KVBoost.from_pretrained(str(path), device=device, dtype=dtype) as plain_engine:
        plain = plain_engine.generate(prompt, max_new_tokens=24, ignore_eos=True).output_ids
    with kvboost.KVBoost.from_pretrained(
        str(path), device=device, dtype=dtype, speculative="prompt_lookup"
    ) as engine:
        out = engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        lp = engine.generate(prompt, max_new_tokens=8, ignore_eos=True, logprobs=2)
    return {
        "ok": out.output_ids == plain and len(lp.logprobs) == 8,
        "first_divergence": next((i for i, (a, b) in enumerate(zip(plain, out.output_ids)) if a != b), None),
    }


def features(path: Path, device: str) -> dict:
    """The checks in fp32 over SDPA and in bf16 over the default backend (kvb-kernels' paged kernel on CUDA)."""
    from kvb_cache import KVBoost

    out: dict = {}
    for dtype in ("float32", "bfloat16"):
        torch.backends.cuda.matmul.allow_tf32 = False
        with KVBoost.from_pretrained(
            str(path),
            device=device,
            dtype=dtype,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            scheduling_policy="priority",
            attention_backend="sdpa" if dtype == "float32" else "auto",
        ) as engine:
            backend = "sdpa" if engine.core.runner.kernel is None else "kvb_kernels"
            print(f"== {dtype} {backend}", flush=True)
            rows = run_checks(engine)
        try:
            rows["speculative_prompt_lookup"] = speculative_checks(path, device, dtype)
        except Exception:
            rows["speculative_prompt_lookup"] = {"ok": False, "error": traceback.format_exc()[-1500:]}
        print("speculative_prompt_lookup", rows["speculative_prompt_lookup"], flush=True)
        out[f"{dtype}/{backend}"] = rows
        if device == "cuda":
            torch.cuda.empty_cache()
    out["summary"] = {
        key: {name: r.get("ok") for name, r in rows.items()} for key, rows in out.items() if key != "summary"
    }
    return out
