"""vLLM's ``--reasoning-parser``: a reasoning model's thinking (``<think>...</think>``) split out of the
reply into the message's ``reasoning`` field.

The reply ``<think>Let me see.</think>The answer is 4.`` becomes ``reasoning: "Let me see."`` and
``content: "The answer is 4."``. Templates that open the thinking block in the prompt (DeepSeek-R1, the
Qwen3 thinking models: the generation prompt ends with ``<think>``) make the reply start inside it; a reply
cut off before the closing tag is all reasoning (content null), and one that never opens a block is all
content (Qwen3 with ``enable_thinking: false``). The rule is the same for every parser name; only the tags
differ.

The field is sent under both names clients read: ``reasoning`` (vLLM's since late 2025) and
``reasoning_content`` (DeepSeek's API and vLLM's before; what LiteLLM, Dify and many agents still read).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The message / delta fields the reasoning text is sent under (see the module docstring).
FIELDS = ("reasoning", "reasoning_content")


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    """The tags a model wraps its thinking in."""

    start: str
    end: str


_THINK = ReasoningSyntax("<think>", "</think>")

#: vLLM's ``--reasoning-parser`` names this server knows -> their tags.
PARSERS: dict[str, ReasoningSyntax] = {
    "deepseek_r1": _THINK,
    "deepseek_v3": _THINK,
    "qwen3": _THINK,
    "glm45": _THINK,
    "olmo3": _THINK,
    "ernie45": _THINK,
    "minimax_m2": _THINK,
    "seed_oss": ReasoningSyntax("<seed:think>", "</seed:think>"),
    "mistral": ReasoningSyntax("[THINK]", "[/THINK]"),
}


def parser_syntax(name: str) -> ReasoningSyntax:
    """The tags of ``--reasoning-parser name``.

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser {name!r} is not known here; known: {', '.join(sorted(PARSERS))}"
        ) from None


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """How one chat reply is split: the tags, whether the prompt already opened the block, and whether the
    thinking is returned (vLLM's ``include_reasoning``; the answer leaves it out either way)."""

    syntax: ReasoningSyntax
    opened: bool
    include: bool = True


def opens_block(prompt_text_tail: str, syntax: ReasoningSyntax) -> bool:
    """Whether a rendered prompt (its last characters) leaves the reply inside a thinking block."""
    return prompt_text_tail.rstrip().endswith(syntax.start)


def closes_block(prompt_text_tail: str, syntax: ReasoningSyntax) -> bool:
    """Whether a rendered prompt (its last characters) ends with an empty thinking block already closed:
    Qwen3's ``enable_thinking: false`` writes ``<think>\n\n</think>\n\n`` as the generation prompt, so the
    reply is the answer from its first token."""
    return prompt_text_tail.rstrip().endswith(syntax.end)


class ReasoningStream:
    """Splits a reply into reasoning and content as its text arrives in pieces.

    Text that may be the beginning of a tag (``"</thi"``) is held back until the next piece settles it, so
    a tag split across two deltas never leaks into either field.
    """

    def __init__(self, plan: ReasoningPlan) -> None:
        self._syntax = plan.syntax
        # "start": the reply may still open a block; "reasoning": inside one; "after": past its end,
        # before the answer's first character; "content": the answer.
        self._state = "reasoning" if plan.opened else "start"
        self._held = ""

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """The reasoning and content ``text`` adds (either may be empty); ``final`` flushes held text."""
        reasoning, content = [], []
        buffer = self._held + text
        self._held = ""
        while buffer:
            if self._state == "content":
                content.append(buffer)
                break
            if self._state == "after":
                # The blank lines between the closing tag and the answer are dropped (as Qwen3's template
                # drops them when it renders the turn again).
                buffer = buffer.lstrip()
                if buffer:
                    self._state = "content"
                continue
            if self._state == "start":
                stripped = buffer.lstrip()
                start = self._syntax.start
                if stripped.startswith(start):
                    self._state = "reasoning"
                    buffer = stripped[len(start) :]
                    continue
                if stripped == "" or (start.startswith(stripped) and not final):
                    self._held = buffer  # whitespace, or a tag's beginning: not settled yet
                    break
                self._state = "content"
                continue
            # Inside the block: everything up to the end tag is reasoning.
            end = self._syntax.end
            at = buffer.find(end)
            if at >= 0:
                reasoning.append(buffer[:at])
                self._state = "after"
                buffer = buffer[at + len(end) :]
                continue
            keep = 0 if final else _partial_suffix(buffer, end)
            reasoning.append(buffer[: len(buffer) - keep])
            self._held = buffer[len(buffer) - keep :]
            break
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split(text: str, plan: ReasoningPlan) -> tuple[str | None, str | None]:
    """A whole reply's reasoning and content, None where empty (vLLM's ``content: null`` for a reply cut
    off while thinking)."""
    reasoning, content = ReasoningStream(plan).feed(text, final=True)
    return reasoning or None, content or None
