"""vLLM's request options beyond sampling: min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, stream_options.continuous_usage_stats and the chat template options, against the real
engine on the tiny Llama (each equals the engine called directly)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvb_cache import KVBoost
from kvb_cache.token_bans import bad_words_ids

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=60)


def _eos_bias(engine: KVBoost) -> dict[str, int]:
    return {str(engine.tokenizer.eos_token_id): 100}  # end-of-sequence all but forced


def test_min_tokens_holds_end_of_sequence_back(tiny_url: str, tiny_engine: KVBoost) -> None:
    body = dict(messages=MESSAGES, max_tokens=20, temperature=0, logit_bias=_eos_bias(tiny_engine))
    assert _post(tiny_url, "chat/completions", **body).json()["usage"]["completion_tokens"] == 1
    held = _post(tiny_url, "chat/completions", min_tokens=5, **body).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_and_include_stop_str_in_output(tiny_url: str, tiny_engine: KVBoost) -> None:
    free = tiny_engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    stop_id = free.output_ids[3]
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    choice = _post(tiny_url, "completions", **body).json()["choices"][0]
    want = tiny_engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    assert choice["text"] == want.output_text and choice["stop_reason"] == stop_id
    assert choice["finish_reason"] == "stop"
    kept = _post(tiny_url, "completions", include_stop_str_in_output=True, **body).json()["choices"][0]
    assert kept["text"] == tiny_engine.tokenizer.decode(free.output_ids[:4], skip_special_tokens=True)

    half = len(free.output_text) // 2
    stop = free.output_text[half : half + 2]
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    kept = _post(tiny_url, "completions", include_stop_str_in_output=True, **body).json()["choices"][0]
    assert kept["text"] == free.output_text[: free.output_text.index(stop) + len(stop)]
    assert kept["stop_reason"] == stop


def test_skip_special_tokens_false_keeps_their_text(tiny_url: str, tiny_engine: KVBoost) -> None:
    body = dict(
        prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True, logit_bias=_eos_bias(tiny_engine)
    )
    assert _post(tiny_url, "completions", **body).json()["choices"][0]["text"] == ""
    text = _post(tiny_url, "completions", skip_special_tokens=False, **body).json()["choices"][0]["text"]
    eos = tiny_engine.tokenizer.eos_token_id
    assert text == tiny_engine.tokenizer.decode([eos] * 3, skip_special_tokens=False) != ""


def _stream(url: str, route: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(tiny_url: str, route: str) -> None:
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(
        tiny_url,
        route,
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options=options,
        **prompt,
    )
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    counts = [c["usage"]["completion_tokens"] for c in body]
    assert counts == sorted(counts) and counts[-1] == 8
    if route == "chat/completions":  # the role chunk comes before any token (it said 1)
        assert body[0]["choices"][0]["delta"].get("role") == "assistant" and counts[0] == 0
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in body)
    # Without it, chunks keep usage null (include_usage alone: only the last chunk has it).
    plain = _stream(
        tiny_url,
        route,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **prompt,
    )
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] is not None


def test_continue_final_message_and_chat_template_kwargs(tiny_url: str, tiny_engine: KVBoost) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The quick brown"}]
    resp = _post(
        tiny_url,
        "chat/completions",
        messages=messages,
        max_tokens=2,
        temperature=0,
        continue_final_message=True,
    ).json()
    continued = tiny_engine.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert resp["usage"]["prompt_tokens"] == len(continued)
    resp = _post(
        tiny_url, "chat/completions", messages=MESSAGES, max_tokens=2, add_generation_prompt=False
    ).json()
    assert resp["usage"]["prompt_tokens"] == len(
        tiny_engine.chat_prompt(MESSAGES, add_generation_prompt=False)
    )
    resp = _post(
        tiny_url,
        "chat/completions",
        messages=MESSAGES,
        max_tokens=2,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert resp.status_code == 200


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("completions", {"min_tokens": 5}, "min_tokens"),  # more than max_tokens (2)
        ("completions", {"min_tokens": -1}, "min_tokens"),
        ("completions", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ("completions", {"stop_token_ids": [10**7]}, "stop_token_ids"),  # outside the vocabulary
        ("completions", {"stop_token_ids": "7"}, "stop_token_ids"),
        ("completions", {"skip_special_tokens": "no"}, "skip_special_tokens"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ("chat/completions", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ("chat/completions", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),  # past the vocabulary
        ("chat/completions", {"bad_words": [""]}, "bad_words[0]"),
        ("chat/completions", {"bad_words": ["   "]}, "bad_words"),
        ("chat/completions", {"allowed_token_ids": [5], "bad_words_ids": [[5]]}, "bad_words_ids"),
        (
            "chat/completions",
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
    ],
)
def test_bad_options_are_400s_naming_the_parameter(
    tiny_url: str, route: str, extra: dict, param: str
) -> None:
    prompt = {"prompt": "hi"} if route == "completions" else {"messages": MESSAGES}
    resp = _post(tiny_url, route, max_tokens=2, **prompt, **extra)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_allowed_token_ids_and_bad_words_equal_the_engine(
    tiny_url: str, tiny_engine: KVBoost, route: str
) -> None:
    """vLLM's allowed_token_ids and bad_words (strings, tokenized by the server as vLLM does), streamed and
    not: the reply the engine gives for the same prompt ids, which the options change."""
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    ids = httpx.post(f"{tiny_url}/tokenize", json={"model": MODEL, **prompt}, timeout=30).json()["tokens"]
    free = tiny_engine.generate(ids, max_new_tokens=8, ignore_eos=True)
    # A reply token that is a word of its own (a byte-level piece of a character decodes to U+FFFD).
    tok = tiny_engine.tokenizer
    word = next(tok.decode([t]) for t in free.output_ids if (t,) in bad_words_ids(tok, [tok.decode([t])]))
    allowed = sorted({*free.output_ids[1:5]} - {free.output_ids[0]})
    body = dict(max_tokens=8, temperature=0, ignore_eos=True, **prompt)
    for extra in ({"allowed_token_ids": allowed}, {"bad_words": [word]}):
        want = tiny_engine.generate(ids, max_new_tokens=8, ignore_eos=True, **extra)
        assert want.output_ids != free.output_ids  # the option changes the reply
        if "allowed_token_ids" in extra:
            assert set(want.output_ids) <= set(allowed)
        choice = _post(tiny_url, route, **body, **extra).json()["choices"][0]
        text = choice["text"] if route == "completions" else choice["message"]["content"]
        streamed = "".join(
            c["choices"][0]["text"]
            if route == "completions"
            else c["choices"][0]["delta"].get("content") or ""
            for c in _stream(tiny_url, route, stream=True, **body, **extra)
            if c["choices"]
        )
        assert text == streamed == want.output_text
    # Options that leave no token (the only allowed one is end-of-sequence, held back) are the client's 400,
    # naming the options the request sent (a grammar too).
    eos = tiny_engine.tokenizer.eos_token_id
    resp = _post(tiny_url, route, **prompt, max_tokens=8, allowed_token_ids=[eos], min_tokens=3)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text
    assert "allowed_token_ids and min_tokens" in resp.json()["error"]["message"]
    letter = tiny_engine.tokenizer.encode("G", add_special_tokens=False)
    resp = _post(
        tiny_url,
        route,
        **prompt,
        max_tokens=4,
        allowed_token_ids=letter,
        response_format={"type": "json_object"},
    )
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "allowed_token_ids and response_format" in message and "bad_words" not in message


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(tiny_url: str, tiny_engine: KVBoost) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens (text or token-id prompts, chat's rendered prompt),
    cut before the budget check; usage counts what the model read, echo shows it."""
    ids = tiny_engine.tokenizer(PROMPT)["input_ids"]
    body = dict(max_tokens=4, temperature=0, ignore_eos=True)
    want = tiny_engine.generate(ids[-5:], max_new_tokens=4, ignore_eos=True).output_text
    for prompt in (PROMPT, ids, [ids, ids[:3]]):
        reply = _post(tiny_url, "completions", prompt=prompt, truncate_prompt_tokens=5, **body).json()
        assert reply["choices"][0]["text"] == want
        assert reply["usage"]["prompt_tokens"] == (5 + 3 if isinstance(prompt[0], list) else 5)
    echoed = _post(tiny_url, "completions", prompt=PROMPT, truncate_prompt_tokens=5, echo=True, **body).json()
    assert echoed["choices"][0]["text"] == tiny_engine.tokenizer.decode(ids[-5:]) + want
    untouched = _post(tiny_url, "completions", prompt=PROMPT, truncate_prompt_tokens=-1, **body).json()
    assert untouched["usage"]["prompt_tokens"] == len(ids)
    # Without truncation this prompt leaves no room for the reply (512-token context); cut to 100 it fits.
    long = [7] * 600
    assert _post(tiny_url, "completions", prompt=long, **body).status_code == 400
    cut = _post(tiny_url, "completions", prompt=long, truncate_prompt_tokens=100, **body).json()
    assert cut["usage"]["prompt_tokens"] == 100

    rendered = httpx.post(f"{tiny_url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()[
        "tokens"
    ]
    chat = _post(tiny_url, "chat/completions", messages=MESSAGES, truncate_prompt_tokens=4, **body).json()
    assert chat["usage"]["prompt_tokens"] == 4
    assert chat["choices"][0]["message"]["content"] == (
        tiny_engine.generate(rendered[-4:], max_new_tokens=4, ignore_eos=True).output_text
    )
    for bad in (0, -2, 513, 1.5):
        resp = _post(tiny_url, "completions", prompt=PROMPT, truncate_prompt_tokens=bad, **body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", (
            resp.text
        )


def test_tokenize_takes_the_chat_template_options(tiny_url: str, tiny_engine: KVBoost) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The quick brown"}]
    body = {"model": MODEL, "messages": messages, "continue_final_message": True}
    got = httpx.post(f"{tiny_url}/tokenize", json=body, timeout=30).json()["tokens"]
    assert got == tiny_engine.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    body = {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}
    resp = httpx.post(f"{tiny_url}/tokenize", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs", resp.text


def test_a_batch_gives_each_prompt_its_own_default_budget(tiny_url: str) -> None:
    """Without max_tokens, each prompt of a /v1/completions batch gets the default of 16 or its own room
    (512-token context): the short prompt's reply no longer shrinks to the long prompt's room."""
    body = dict(temperature=0, ignore_eos=True, prompt=[[7] * 3, [7] * 500])
    reply = _post(tiny_url, "completions", **body).json()
    lengths = {c["index"]: c["finish_reason"] for c in reply["choices"]}
    assert lengths == {0: "length", 1: "length"}
    assert reply["usage"]["completion_tokens"] == 16 + 12


def test_priority_needs_priority_scheduling(tiny_url: str) -> None:
    """vLLM's priority: 0 is accepted anywhere; another value is a 400 naming the flag unless the engine
    schedules by priority (then it orders the queue: kvb-cache's test_priority.py)."""
    body = dict(prompt=PROMPT, max_tokens=2, temperature=0)
    assert _post(tiny_url, "completions", priority=0, **body).status_code == 200
    resp = _post(tiny_url, "chat/completions", messages=MESSAGES, max_tokens=2, priority=3)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in resp.json()["error"]["message"]


def test_a_priority_server_passes_each_requests_priority_to_the_engine() -> None:
    from conftest import build_tiny_engine, serve

    from kvb_server import ServerConfig, create_app

    engine = build_tiny_engine(scheduling_policy="priority")
    seen: list[int] = []
    add = engine.add_request

    def spy(*args, priority: int = 0, **kwargs):
        seen.append(priority)
        return add(*args, priority=priority, **kwargs)

    engine.add_request = spy  # type: ignore[method-assign]
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=8))) as url:
        for priority in (5, -1, 0):
            body = dict(prompt=PROMPT, max_tokens=2, temperature=0, priority=priority)
            assert _post(url, "completions", **body).status_code == 200
    assert seen == [5, -1, 0]
