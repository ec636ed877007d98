"""Small drafters with known behaviour, for exactness and rollback tests."""

from __future__ import annotations

import torch

from kvb_speculative import Draft


class ScriptedSession:
    """Proposes ``script[len(history) - offset :]`` (an oracle when the script is the true output)."""

    def __init__(self, script: list[int], offset: int, wrong: bool, vocab_size: int) -> None:
        self.script = script
        self.offset = offset
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.rollbacks: list[int] = []

    def propose(self, history, max_tokens, processor) -> Draft:
        pos = history.shape[0] - self.offset
        tokens = self.script[pos : pos + max_tokens]
        if self.wrong:
            # Shift every token by one: never the target's choice.
            tokens = [(t + 1) % self.vocab_size for t in tokens]
        return Draft(torch.tensor(tokens, dtype=torch.long), None)

    def rollback(self, num_accepted: int) -> None:
        self.rollbacks.append(num_accepted)


class ScriptedDrafter:
    """A drafter replaying ``script`` (tokens expected after the prompt); ``wrong=True`` corrupts each one."""

    def __init__(self, script: list[int], *, wrong: bool = False, vocab_size: int = 128) -> None:
        self.script = script
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.sessions: list[ScriptedSession] = []

    def start(self, prompt_ids: torch.Tensor) -> ScriptedSession:
        session = ScriptedSession(self.script, prompt_ids.shape[0], self.wrong, self.vocab_size)
        self.sessions.append(session)
        return session


class FixedDrafter:
    """Always proposes the same tokens (a deterministic drafter for the sampling tests)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def start(self, prompt_ids: torch.Tensor) -> FixedDrafter:
        return self

    def propose(self, history, max_tokens, processor) -> Draft:
        return Draft(torch.tensor(self.tokens[:max_tokens], dtype=torch.long), None)

    def rollback(self, num_accepted: int) -> None:
        pass
