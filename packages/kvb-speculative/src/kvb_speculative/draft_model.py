"""Drafting with a smaller Hugging Face causal LM that shares the target's vocabulary."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_speculative.cache_ops import extend, make_croppable, new_cache, rollback
from kvb_speculative.errors import SpeculativeConfigError
from kvb_speculative.protocols import Draft, TokenProcessor
from kvb_speculative.sampling import sample_token
from kvb_speculative.vocab import check_vocab_parity, fit_width, logits_width


class DraftModelDrafter:
    """Proposes tokens by running ``draft_model`` autoregressively through the request's processor.

    Args:
        target_model: the model whose output is verified (only its vocabulary is read here).
        draft_model: a smaller causal LM with the same vocabulary and special tokens.
        target_tokenizer, draft_tokenizer: optional; when both are given their vocabularies are compared too.

    Raises:
        VocabularyMismatchError: the vocabularies differ (sizes or any special token id).
    """

    def __init__(
        self,
        target_model: PreTrainedModel,
        draft_model: PreTrainedModel,
        *,
        target_tokenizer: PreTrainedTokenizerBase | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        if not isinstance(draft_model, torch.nn.Module):  # a path string failed in vocab.py's AttributeError
            raise SpeculativeConfigError(
                f"draft_model must be a loaded model (a transformers PreTrainedModel), got "
                f"{type(draft_model).__name__}; load it first (AutoModelForCausalLM.from_pretrained(path)), or "
                "pass the path as KVBoost.from_pretrained(..., draft_model=path) / --draft-model"
            )
        check_vocab_parity(
            target_model, draft_model, target_tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer
        )
        self.draft_model = draft_model
        self.context_length = _context_length(draft_model)
        # Equal unless the two embedding tables are padded differently (vocab.py): the draft's logits are
        # fitted to the target's width, and ids past the draft's table end its proposals.
        self.width = logits_width(target_model)
        self.draft_rows = draft_model.get_input_embeddings().num_embeddings

    def start(self, prompt_ids: torch.Tensor) -> DraftModelSession:
        """Open a session with an empty draft cache; the prompt is prefilled on the first proposal."""
        return DraftModelSession(
            self.draft_model, self.context_length, width=self.width, draft_rows=self.draft_rows
        )


def _context_length(model: PreTrainedModel) -> int | None:
    """The draft model's context: ``max_position_embeddings`` (GPT-2 maps ``n_positions`` to it), extended by
    a YaRN ``rope_scaling`` block to ``original_max_position_embeddings x factor`` as the engine extends its
    target's (``kvb_cache.model_traits.declared_context``, not imported: this distribution stands alone); a
    draft with the same YaRN block as its target stopped drafting at the declared window."""
    config = model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn":
        factor, original = rope.get("factor"), rope.get("original_max_position_embeddings") or limit
        if (
            isinstance(factor, (int, float))
            and not isinstance(factor, bool)
            and factor > 1
            and isinstance(original, int)
        ):
            return max(limit, int(original * factor))
    return limit


class DraftModelSession:
    """The draft model's KV cache for one request, kept equal to a prefix of the committed tokens."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        context_length: int | None = None,
        *,
        width: int | None = None,
        draft_rows: int | None = None,
    ) -> None:
        self._model = draft_model
        #: The target's logits width (None: the draft's own), and the draft's embedding rows: a committed
        #: id past them (the target sampling one of its padding ids) cannot be fed to the draft model.
        self._width = width
        self._draft_rows = draft_rows
        self._stopped = False
        #: Positions the draft model may take (None: no limit). A draft model with a shorter context than
        #: the target stops proposing past it: learned absolute positions (GPT-2) raised IndexError there,
        #: and RoPE models past their trained length propose little worth verifying.
        self._context_length = context_length
        self.cache = new_cache(draft_model)
        # Committed tokens whose KV ``cache`` holds: always a prefix of the history passed to propose().
        self._cached = 0
        self._history_length = 0
        self._proposed = 0

    def propose(self, history: torch.Tensor, max_tokens: int, processor: TokenProcessor) -> Draft:
        """Sample (or argmax, when greedy) ``max_tokens`` tokens from the draft model.

        Args:
            history: ``[S]`` int64 committed tokens.
            max_tokens: number of tokens to propose (>= 1).
            processor: the request's sampling rule, applied to the draft logits.

        Returns:
            ``k <= max_tokens`` tokens and, when sampling, ``[k, V]`` their proposal distributions; fewer
            (none once ``history`` outgrows it) where the draft model's context ends, since a proposal's
            KV sits one position past the token before it.
        """
        if history.shape[0] == self._cached and self._cached:
            # The last proposal was never verified (the engine's step failed, or was interrupted, before
            # its verification) and nothing was committed since: the cache holds KV up to the last token,
            # whose logits are gone, so that token is fed again.
            self._cached -= 1
        assert history.shape[0] > self._cached, "the committed history never shrinks"
        if self._draft_rows is not None and not self._stopped:
            self._stopped = bool((history[self._cached :] >= self._draft_rows).any())
        if self._stopped:  # the target committed an id the draft has no embedding for: it decodes alone
            return Draft(torch.empty(0, dtype=torch.long), None)
        if self._context_length is not None:
            # The forward computes positions up to len(history) + max_tokens - 2.
            max_tokens = min(max_tokens, self._context_length - history.shape[0] + 1)
            if max_tokens <= 0:
                return Draft(torch.empty(0, dtype=torch.long), None)
        # Self-healing when a caller skipped rollback(): drop any proposal KV beyond the committed prefix.
        rollback(self.cache, self._cached)
        prefilling = self._cached == 0
        logits = self._fit(extend(self._model, self.cache, history[self._cached :])[-1])
        if prefilling:
            # After the prompt (not before: it would be held whole), so rejected proposals can be cropped
            # from a sliding-window draft model's cache past its window.
            make_croppable(self.cache)
        self._history_length = history.shape[0]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        context = history
        for step in range(max_tokens):
            scores = processor.process(context, logits)
            if bool(torch.isnan(scores).any()):
                # A draft model that overflows proposes nothing from here: a NaN proposal distribution
                # would poison the verifier's p / q ratios (the target's own logits decide the token).
                break
            if processor.greedy:
                token = int(torch.argmax(scores))
            else:
                q = torch.softmax(scores, dim=-1)
                token = sample_token(q, processor.generator)
                probs.append(q)
            tokens.append(token)
            if step + 1 < max_tokens:
                next_token = torch.tensor([token], dtype=torch.long, device=history.device)
                context = torch.cat([context, next_token])
                logits = self._fit(extend(self._model, self.cache, next_token)[-1])
        self._proposed = len(tokens)
        # The cache now also holds the first ``max_tokens - 1`` proposals; rollback() keeps the accepted ones.
        self._cached = self._history_length
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self._width is None else fit_width(logits, self._width)

    def rollback(self, num_accepted: int) -> None:
        """Drop the draft KV of rejected proposals (the last proposal never had KV computed)."""
        keep = self._history_length + min(num_accepted, max(self._proposed - 1, 0))
        rollback(self.cache, keep)
        self._cached = keep
