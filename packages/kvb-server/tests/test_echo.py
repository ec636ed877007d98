"""``echo`` on ``/v1/completions`` (real engine, tiny Llama, official ``openai`` client and raw HTTP).

The loglikelihood requests below are the ones lm-eval's ``local-completions`` model sends (``echo: true,
logprobs: 1, max_tokens: 1``, token-id prompts, several per request), read the way it reads them; the
expected numbers come from one plain forward of the model.
"""

from __future__ import annotations

import json
from operator import itemgetter

import httpx
import openai
import pytest
import torch

from kvb_cache import KVBoost

MODEL = "tiny-llama"


@pytest.fixture()
def client(tiny_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)


def _forward_logprobs(engine: KVBoost, ids: list[int]) -> torch.Tensor:
    """``[n - 1]`` log-probabilities of ``ids[1:]`` from one plain forward."""
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _lm_eval_parse(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4's ``LocalCompletionsAPI.parse_logprobs``: the continuation's summed logprob and whether
    every continuation token was the argmax."""
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
        out.append((sum(token_logprobs), greedy))
    return out


def test_echo_repeats_the_prompt_before_the_completion(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    prompt = "The quick brown fox"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    plain = tiny_engine.generate(prompt, max_new_tokens=6, temperature=0.0)
    assert resp.choices[0].text == prompt + plain.output_text
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens == plain.prompt_tokens


def test_lm_eval_loglikelihood_request(tiny_url: str, tiny_engine: KVBoost) -> None:
    """Two (context, continuation) pairs in one request, as token ids: the continuation's summed logprob
    equals a plain forward's, and the greedy flag is true exactly when the forward's argmax agrees."""
    tok = tiny_engine.tokenizer
    pairs = [("The capital of France is", " Paris"), ("One two three four", " five six")]
    requests = [(tok(c)["input_ids"], tok(x, add_special_tokens=False)["input_ids"]) for c, x in pairs]
    prompts = [ctx + cont for ctx, cont in requests]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    resp = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    for choice, ids in zip(data["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [tiny_engine.token_text(t) for t in ids]
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"][1 : len(ids)]),
            _forward_logprobs(tiny_engine, ids),
            atol=1e-5,
            rtol=0,
        )
        assert lp["text_offset"] == sorted(lp["text_offset"])
    parsed = _lm_eval_parse(data, [len(ctx) for ctx, _ in requests])
    for (ctx, cont), (total, greedy) in zip(requests, parsed):
        ids = ctx + cont
        want = _forward_logprobs(tiny_engine, ids)[len(ctx) - 1 :]
        assert total == pytest.approx(float(want.sum()), abs=1e-4)
        with torch.no_grad():
            argmax = tiny_engine.model(torch.tensor([ids])).logits[0, len(ctx) - 1 : -1].argmax(-1)
        assert greedy == (argmax.tolist() == cont)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(
    client: openai.OpenAI, tiny_engine: KVBoost
) -> None:
    prompt = "Alpha beta gamma delta"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, n=2)
    ids = tiny_engine.tokenizer(prompt)["input_ids"]
    assert [c.text for c in resp.choices] == [prompt, prompt]
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])  # up to 2 (tokens sharing a text merge)


def test_max_tokens_zero_without_echo_is_a_400(tiny_url: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 0}
    resp = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens" and "echo" in resp.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert httpx.post(f"{tiny_url}/v1/chat/completions", json=chat, timeout=30).status_code == 400


def test_streamed_echo_opens_with_the_prompt(tiny_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    whole = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    chunks = []
    with httpx.stream(
        "POST", f"{tiny_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"] == "Once upon a time"
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None
    torch.testing.assert_close(
        torch.tensor(streamed[1:]), torch.tensor(whole["logprobs"]["token_logprobs"][1:])
    )


def _logprob_arrays(tiny_url: str, body: dict) -> dict[str, list]:
    """Choice 0's completions logprobs arrays, the chunks' joined when ``body`` streams."""
    if not body.get("stream"):
        return httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=60).json()["choices"][0][
            "logprobs"
        ]
    arrays: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    with httpx.stream("POST", f"{tiny_url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                for key in arrays:
                    arrays[key] += logprobs[key] if logprobs else []
    return arrays


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_hold_the_chosen_token_too(tiny_url: str, stream: bool) -> None:
    """OpenAI and vLLM: a completions top_logprobs dict holds the logprobs=N most likely tokens *and* the
    token itself, so up to N + 1 entries, for an echoed prompt token as for a sampled one; the prompt's
    tokens had only the N best (a random model rarely expects the prompt's next token)."""
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 8, "stream": stream}
    arrays = _logprob_arrays(tiny_url, {**body, "temperature": 2.0, "seed": 3})
    scored = list(zip(arrays["tokens"], arrays["token_logprobs"], arrays["top_logprobs"], strict=True))[1:]
    prompt_tokens = len(scored) - 8
    for token, logprob, top in scored[:prompt_tokens]:
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob), (token, top)
    assert any(len(top) == 2 for _, _, top in scored[:prompt_tokens])  # a prompt token not the model's top-1
    for token, _, top in scored[prompt_tokens:]:  # sampled at temperature 2: often not the top-1 either
        assert 1 <= len(top) <= 2 and token in top, (token, top)
    assert any(len(top) == 2 for _, _, top in scored[prompt_tokens:])
    zero = _logprob_arrays(tiny_url, {**body, "logprobs": 0, "max_tokens": 1, "temperature": 0})
    assert [list(top) for top in zero["top_logprobs"][1:]] == [[t] for t in zero["tokens"][1:]]


def test_streamed_max_tokens_zero(tiny_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon",
        "max_tokens": 0,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{tiny_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[0]["choices"][0]["text"] == "Once upon"
    assert payloads[1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 0


def test_streamed_max_tokens_zero_with_logprobs_finishes(tiny_url: str) -> None:
    """Scoring a prompt streamed (lm-eval's request with ``stream: true``): the stream used to break off
    after the echo chunk (an IndexError: the choices' offsets were counted by engine jobs, and a prompt that
    generates nothing has none), without a finish chunk or ``[DONE]``."""
    body = {
        "model": MODEL,
        "prompt": ["Once upon", "a time"],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "stream": True,
    }
    with httpx.stream("POST", f"{tiny_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in choices[:2]] == ["Once upon", "a time"]
    assert [c["logprobs"]["token_logprobs"][0] for c in choices[:2]] == [None, None]
    assert [c["finish_reason"] for c in choices[2:]] == ["length", "length"]


def test_tokenizer_info_lets_a_client_tokenize_as_the_server(tiny_url: str, tiny_engine: KVBoost) -> None:
    """lm-eval picks its remote tokenizer when ``/tokenizer_info`` names an ``eos_token`` and ``/tokenize``
    answers; it then encodes with ``add_special_tokens: false`` and decodes through ``/detokenize``."""
    info = httpx.get(f"{tiny_url}/tokenizer_info", timeout=30).json()
    tok = tiny_engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["model_max_length"] == tiny_engine.context_length and info["vocab_size"] == len(tok)
    assert info["chat_template"] == tok.chat_template
    text = "Hello there world"
    ids = httpx.post(f"{tiny_url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert ids.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    back = httpx.post(f"{tiny_url}/detokenize", json={"tokens": ids.json()["tokens"]}, timeout=30)
    assert back.json()["prompt"] == tok.decode(ids.json()["tokens"])


def test_bad_echo_requests_are_400s(tiny_url: str, tiny_engine: KVBoost) -> None:
    """An id outside the vocabulary and a prompt longer than the context are refused before scoring."""
    url = f"{tiny_url}/v1/completions"
    body = {"model": MODEL, "prompt": [3, 10**6], "max_tokens": 0, "echo": True, "logprobs": 1}
    resp = httpx.post(url, json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    # Past what the tokenizer takes (u32): decoding the echo raised OverflowError, a 500; generated or scored.
    for huge, budget in ((2**32, 0), (10**30, 2), (2**64, 2)):
        resp = httpx.post(url, json={**body, "prompt": [3, huge], "max_tokens": budget}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    # In the part truncate_prompt_tokens cuts, it is never read: served with echo as without.
    cut = {**body, "prompt": [2**32, 3, 4], "max_tokens": 1, "truncate_prompt_tokens": 2}
    for echo in (True, False):
        resp = httpx.post(url, json={**cut, "echo": echo}, timeout=30)
        assert resp.status_code == 200, resp.text
    too_long = [5] * (tiny_engine.context_length + 1)
    resp = httpx.post(url, json={**body, "prompt": too_long}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    full = [5] * tiny_engine.context_length  # fills the context: scorable, nothing generated
    resp = httpx.post(url, json={**body, "prompt": full}, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"][0]["logprobs"]["tokens"]) == len(full)


def test_a_bos_the_echoed_text_lacks_takes_no_room_in_the_offsets() -> None:
    """A text prompt is echoed as sent; the BOS it was encoded with is a token of the prompt but not of the
    text. Its text ("<|begin_of_text|>") was counted: "Hello world" had offsets [0, 17, 22]."""
    from kvb_cache.results import TokenLogprob
    from kvb_server.echo import Echo
    from kvb_server.token_bytes import TextOffsets

    scored = (
        TokenLogprob(token_id=5, token="Hello", logprob=-1.0),
        TokenLogprob(token_id=6, token=" world", logprob=-2.0),
    )
    echo = Echo(
        text="Hello world",
        first_token="<|begin_of_text|>",
        first_token_id=1,
        logprobs=scored,
        special_ids=frozenset({1}),
    )
    assert echo.logprob_arrays(TextOffsets())["text_offset"] == [0, 0, 5]
    # Echoing token ids, the text is their decode, BOS included: it takes its room there.
    ids_echo = Echo(
        text="<|begin_of_text|>Hello world",
        first_token="<|begin_of_text|>",
        first_token_id=1,
        logprobs=scored,
        special_ids=frozenset({1}),
    )
    assert ids_echo.logprob_arrays(TextOffsets())["text_offset"] == [0, 17, 22]


def test_completion_top_keeps_the_chosen_tokens_own_logprob_under_a_shared_text() -> None:
    """Every lone byte token reads U+FFFD: the chosen one's entry was shadowed by a likelier namesake."""
    from kvb_cache.results import TokenLogprob
    from kvb_server.echo import completion_top

    entry = TokenLogprob(
        token_id=7, token="\ufffd", logprob=-6.8, top=((3, "ad", -3.7), (9, "\ufffd", -4.3), (4, "ex", -4.1))
    )
    assert completion_top(entry) == {"ad": -3.7, "\ufffd": -6.8, "ex": -4.1}
    among = TokenLogprob(token_id=3, token="ad", logprob=-3.7, top=((3, "ad", -3.7), (4, "ex", -4.1)))
    assert completion_top(among) == {"ad": -3.7, "ex": -4.1}


def test_a_scored_response_is_built_off_the_event_loop(
    tiny_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logprobs make bodies of tens of MB (64 echoed prompts of 2,000 tokens with 20 alternatives: 80 MB):
    built on the event loop, they held /health for seconds. A plain response stays on it."""
    import asyncio

    from kvb_server import service

    offloaded = []
    to_thread = asyncio.to_thread

    def recording(fn, *args, **kwargs):
        offloaded.append(getattr(fn, "func", fn).__name__)
        return to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(service.asyncio, "to_thread", recording)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{tiny_url}/v1/completions", json=body).status_code == 200
    assert offloaded == []
    scored = httpx.post(f"{tiny_url}/v1/completions", json={**body, "echo": True, "logprobs": 3})
    assert scored.status_code == 200 and scored.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert offloaded == ["final_response"]
