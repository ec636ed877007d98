"""kvboost-server over HTTP on a CUDA device: the OpenAI routes, the vLLM extras and concurrent streams, each
checked by a property of the response (status, shape, constraint held), not by its text, so random weights of
SmolLM2's shape are enough. Used by ``tools/gpu_checks.py --sections server_cuda``; ``--device cpu``
smoke-tests it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sse(lines: list[str]) -> list[dict]:
    """The JSON events of an SSE body (``[DONE]`` dropped)."""
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def _checks(base: str, model: str) -> dict[str, Callable[[httpx.Client], dict]]:
    msgs = [{"role": "user", "content": "Name three colours."}]

    def chat(c: httpx.Client) -> dict:
        r = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 16})
        body = r.json()
        return {
            "ok": r.status_code == 200
            and isinstance(body["choices"][0]["message"]["content"], str)
            and body["usage"]["completion_tokens"] > 0,
            "status": r.status_code,
        }

    def chat_stream(c: httpx.Client) -> dict:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": msgs,
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            lines = [x for x in r.iter_lines() if x]
        events = _sse(lines)
        return {
            "ok": r.status_code == 200
            and lines[-1] == "data: [DONE]"
            and events[-1].get("usage") is not None,
            "events": len(events),
        }

    def completions_echo_logprobs(c: httpx.Client) -> dict:
        r = c.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": "one two three four",
                "max_tokens": 4,
                "echo": True,
                "logprobs": 2,
            },
        )
        body = r.json()
        lp = body["choices"][0]["logprobs"]
        n = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        return {"ok": r.status_code == 200 and len(lp["tokens"]) == n, "tokens": len(lp["tokens"]), "want": n}

    def n_seeded(c: httpx.Client) -> dict:
        req = {"model": model, "messages": msgs, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5}
        a, b = (
            c.post("/v1/chat/completions", json=req).json(),
            c.post("/v1/chat/completions", json=req).json(),
        )
        texts = [ch["message"]["content"] for ch in a["choices"]]
        return {
            "ok": len(texts) == 3 and texts == [ch["message"]["content"] for ch in b["choices"]],
            "distinct": len(set(texts)),
        }

    def json_schema(c: httpx.Client) -> dict:
        schema = {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        }
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": msgs,
                "max_tokens": 30,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
            },
        )
        content = r.json()["choices"][0]["message"]["content"]
        return {
            "ok": r.status_code == 200 and json.loads(content)["colour"] in ("red", "blue"),
            "content": content,
        }

    def tool_required(c: httpx.Client) -> dict:
        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                },
            },
        }
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": msgs,
                "max_tokens": 60,
                "tools": [tool],
                "tool_choice": "required",
            },
        )
        body = r.json()
        calls = body["choices"][0]["message"].get("tool_calls") or []
        return {
            "ok": r.status_code == 200 and len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather",
            "finish_reason": body["choices"][0].get("finish_reason"),
        }

    def vllm_extras(c: httpx.Client) -> dict:
        allowed = c.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": "x",
                "max_tokens": 6,
                "allowed_token_ids": [101, 202],
                "ignore_eos": True,
            },
        ).json()
        trunc = c.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": "a b c d e f g h i j k l",
                "max_tokens": 2,
                "truncate_prompt_tokens": 4,
            },
        ).json()
        prio = c.post(
            "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, "priority": -3}
        )
        words = c.post(
            "/v1/completions",
            json={"model": model, "prompt": "x", "max_tokens": 6, "bad_words": ["the"], "ignore_eos": True},
        )
        return {
            "ok": allowed["usage"]["completion_tokens"] == 6
            and trunc["usage"]["prompt_tokens"] == 4
            and prio.status_code == 200
            and words.status_code == 200,
            "allowed_text": allowed["choices"][0]["text"],
        }

    def responses_api(c: httpx.Client) -> dict:
        r = c.post("/v1/responses", json={"model": model, "input": "hello", "max_output_tokens": 8})
        return {
            "ok": r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"),
            "status": r.status_code,
        }

    def bad_input(c: httpx.Client) -> dict:
        r = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": -1})
        return {"ok": r.status_code == 400 and "error" in r.json(), "status": r.status_code}

    def concurrent_streams(c: httpx.Client) -> dict:
        results: list = [None] * 16

        def one(i: int) -> None:
            with (
                httpx.Client(base_url=base, timeout=120) as own,
                own.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": [{"role": "user", "content": f"Story number {i}."}],
                        "max_tokens": 32,
                        "stream": True,
                        "ignore_eos": True,
                    },
                ) as r,
            ):
                results[i] = (r.status_code, [x for x in r.iter_lines() if x][-1])

        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        ok = all(r is not None and r[0] == 200 and r[1] == "data: [DONE]" for r in results)
        return {"ok": ok, "seconds": time.perf_counter() - start}

    def metrics_and_stats(c: httpx.Client) -> dict:
        metrics = c.get("/metrics").text
        stats = c.get("/v1/stats").json()
        return {
            "ok": "kvboost:num_requests_running" in metrics and "paged" in stats,
            "prefix_hits": stats.get("paged", {}).get("prefix_cache_hits"),
        }

    return {f.__name__: f for f in (
        chat, chat_stream, completions_echo_logprobs, n_seeded, json_schema, tool_required, vllm_extras,
        responses_api, bad_input, concurrent_streams, metrics_and_stats,
    )}  # fmt: skip


def server_http(path: Path, device: str, dtype: str = "bfloat16") -> dict:
    """Start kvboost-server on ``device`` with the model at ``path``, run every check, stop it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "kvb_server", "--model", str(path), "--device", device, "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--scheduling-policy", "priority", "--log-level", "warning",
    ]  # fmt: skip
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvb_server_{port}.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    out: dict = {"argv": argv[2:], "checks": {}}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("server did not answer /health within 300 s")
        out["startup_s"] = 300 - (deadline - time.monotonic())
        with httpx.Client(base_url=base, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for name, check in _checks(base, model).items():
                try:
                    out["checks"][name] = check(client)
                except Exception:
                    out["checks"][name] = {"ok": False, "error": traceback.format_exc()[-1200:]}
                print("server", name, json.dumps(out["checks"][name], default=str)[:300], flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out["server_log_tail"] = log.read_text()[-3000:]
    out["summary"] = {name: r.get("ok") for name, r in out["checks"].items()}
    return out
