"""Concurrent streamed multi-turn chat sessions against an OpenAI-compatible server (tools/bench_server.py).

Conversations are real (chitchat-dataset); every session starts with the same long system prompt, which
embeds a real document (Python's ``pydoc_data.topics``). Each session sends its turns one after another,
streamed, keeping its own history (the server's replies), so greedy decoding gives every server the same
first turn and, as long as replies agree, the same later turns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import openai

DOC_TOPICS = ("with", "try", "for", "while", "if", "function", "class")


def reference_document() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in DOC_TOPICS)


def system_prompt(chars: int) -> str:
    """The shared system prompt: an instruction and the first ``chars`` characters of the document."""
    return (
        "You are a helpful assistant for Python programmers. Answer using this reference.\n\n"
        + reference_document()[:chars]
    )


def conversations(count: int, turns: int, *, skip: int = 0) -> list[list[str]]:
    """The user side of ``count`` real chit-chat conversations with at least ``turns`` user turns each.

    A user turn is one speaker's consecutive messages joined; ``skip`` leaves out the first qualifying
    conversations, so phases of one run never replay the same history to a server that cached it.
    """
    import chitchat_dataset

    out: list[list[str]] = []
    seen = 0
    for convo in chitchat_dataset.Dataset().values():
        groups = [" ".join(m["text"] for m in group) for group in convo["messages"]]
        if len(groups) < 2 * turns:
            continue
        seen += 1
        if seen > skip:
            out.append(groups[0::2][:turns])
        if len(out) == count:
            return out
    raise RuntimeError(
        f"chitchat-dataset has fewer than {skip + count} conversations with {turns} user turns"
    )


def short_questions(count: int) -> list[str]:
    """``count`` distinct short questions (first messages of chit-chat conversations that end with '?')."""
    import chitchat_dataset

    out: list[str] = []
    for convo in chitchat_dataset.Dataset().values():
        text = " ".join(m["text"] for m in convo["messages"][0]).strip()
        if text.endswith("?") and 10 <= len(text) <= 100 and text not in out:
            out.append(text)
        if len(out) == count:
            return out
    raise RuntimeError(f"chitchat-dataset has fewer than {count} short opening questions")


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRecord:
    """One streamed request, as the client saw it (times from the moment the request was sent)."""

    session: int
    turn: int
    ttft_ms: float  # request sent -> first non-empty content delta
    total_ms: float
    last_token_ms: float  # request sent -> last non-empty content delta
    content_chunks: int
    completion_tokens: int  # from the final usage chunk; content chunks when the server sent none
    prompt_tokens: int | None
    cached_tokens: int | None
    reply: str
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time between first and last content delta."""
        span = (self.last_token_ms - self.ttft_ms) / 1e3
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None

    def to_dict(self) -> dict:
        return asdict(self) | {"decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseResult:
    """All sessions of one concurrency level on one server."""

    wall_s: float
    records: list[TurnRecord]
    timed_out: bool


def client(url: str, request_timeout_s: float) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", timeout=request_timeout_s, max_retries=0)


async def one_turn(
    api: openai.AsyncOpenAI, model: str, history: list[dict], max_tokens: int, *, session: int, turn: int
) -> TurnRecord:
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    reply: list[str] = []
    usage = None
    try:
        stream = await api.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                chunks += 1
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        error = None
    except Exception as exc:  # any HTTP/transport failure is a failed turn to record, not a crash
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return TurnRecord(
        session=session,
        turn=turn,
        ttft_ms=((first or end) - t0) * 1e3,
        total_ms=(end - t0) * 1e3,
        last_token_ms=((last or end) - t0) * 1e3,
        content_chunks=chunks,
        completion_tokens=usage.completion_tokens if usage else chunks,
        prompt_tokens=usage.prompt_tokens if usage else None,
        cached_tokens=getattr(details, "cached_tokens", None),
        reply="".join(reply),
        error=error,
    )


async def run_sessions(
    url: str,
    model: str,
    system: str,
    sessions: list[list[str]],
    *,
    max_tokens: int,
    request_timeout_s: float,
    phase_timeout_s: float,
) -> PhaseResult:
    """Run every session at once; each stops at its first failed turn. The phase stops by itself after
    ``phase_timeout_s`` (the turns finished so far are kept)."""
    api = client(url, request_timeout_s)
    records: list[TurnRecord] = []

    async def session(index: int, user_turns: list[str]) -> None:
        history = [{"role": "system", "content": system}]
        for turn, text in enumerate(user_turns, start=1):
            history.append({"role": "user", "content": text})
            record = await one_turn(api, model, history, max_tokens, session=index, turn=turn)
            records.append(record)
            if record.error:
                return
            history.append({"role": "assistant", "content": record.reply})

    t0 = time.perf_counter()
    timed_out = False
    try:
        await asyncio.wait_for(
            asyncio.gather(*(session(i, s) for i, s in enumerate(sessions))), phase_timeout_s
        )
    except asyncio.TimeoutError:
        timed_out = True
    wall = time.perf_counter() - t0
    await api.close()
    return PhaseResult(
        wall_s=wall, records=sorted(records, key=lambda r: (r.session, r.turn)), timed_out=timed_out
    )


async def warm_up(url: str, model: str, request_timeout_s: float) -> float:
    """One short greedy request unrelated to the benchmark's prompts; returns its seconds.

    NOTE: transformers' continuous-batching server builds its batching manager (and its paged cache) on
    the first request, with that request's sampling settings for all later ones; it must not be timed.
    """
    api = client(url, request_timeout_s)
    t0 = time.perf_counter()
    await api.chat.completions.create(
        model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
    )
    await api.close()
    return time.perf_counter() - t0
