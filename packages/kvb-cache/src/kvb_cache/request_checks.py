"""Validation of one request's inputs: the prompt, the context budget and the per-request overrides."""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_cache.errors import ContextLengthError, InvalidRequestError, PromptTypeError, check_utf8
from kvb_cache.prepared import Prompt


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    prompt: Prompt,
    *,
    eos_ids: Collection[int] = (),
) -> list[int]:
    """Token ids of ``prompt`` (a string, or ids checked against the model's vocabulary).

    Ids may be a list or tuple of ints, or a 1-D / ``[1, S]`` integer tensor or array (what
    ``tokenizer(text, return_tensors="pt")["input_ids"]`` gives, and what ``lookup_cache`` takes too)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty; pass at least one character", param="prompt")
        check_utf8(prompt, "prompt")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        vocab = model.get_input_embeddings().num_embeddings
        past = [t for t in ids if t >= vocab]
        if past:
            # A tokenizer with added tokens past the embedding table (the load warns): the forward raised a
            # bare IndexError (a device-side assert on CUDA).
            raise InvalidRequestError(
                f"the prompt tokenizes to id {past[0]} ({tokenizer.convert_ids_to_tokens(past[0])!r}), which the "
                f"model has no embedding for (it embeds {vocab}); leave that token out",
                param="prompt",
            )
    else:
        ids = token_id_list(prompt)
        vocab = model.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="prompt")
        if hasattr(prompt, "ndim"):  # a tensor or array: what tokenizer(..., padding=True) returns
            _refuse_padding(tokenizer, ids, eos_ids)
    if not ids:
        raise InvalidRequestError("prompt tokenized to nothing; pass some text", param="prompt")
    return ids


def _refuse_padding(tokenizer: PreTrainedTokenizerBase, ids: list[int], eos_ids: Collection[int]) -> None:
    """Refuse a tensor prompt that starts or ends with the tokenizer's padding token: a row of a padded batch
    (``tokenizer(texts, padding=True, return_tensors="pt")``). ``model.generate`` masks such tokens (its rule:
    the pad id is in the input and is not an end-of-sequence id); fed as content, they changed the answer with
    no error. Not refused when the pad id is also the BOS or an end-of-sequence id, the tokenizer's or one of
    ``eos_ids`` (the engine's: the generation config's too, as Qwen2.5's ``<|endoftext|>``): then it may be
    content."""
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    if (
        pad is None
        or pad == tokenizer.bos_token_id
        or pad in (eos if isinstance(eos, list) else [eos])
        or pad in eos_ids
    ):
        return
    lead = next((i for i, t in enumerate(ids) if t != pad), len(ids))
    trail = next((i for i, t in enumerate(reversed(ids)) if t != pad), len(ids))
    if lead or trail:
        where = f"starts with {lead}" if lead else f"ends with {trail}"
        raise PromptTypeError(
            f"the token-id prompt {where} padding token(s) (pad_token_id {pad}), which would be read as "
            "text: pass each sequence unpadded (tokenizer(text) per prompt, or "
            "input_ids[attention_mask.bool()] for a row of a padded batch)",
            param="prompt",
        )


def token_id_list(prompt: object, param: str = "prompt") -> list[int]:
    """``prompt`` (a list or tuple of ints, numpy ints included, or a 1-D / ``[1, S]`` integer tensor or
    array) as a list of Python ints, or a :class:`PromptTypeError` naming ``param`` and what is wrong."""
    if hasattr(prompt, "tolist") and hasattr(prompt, "ndim"):  # a torch tensor or a numpy array
        if getattr(prompt, "is_meta", False):  # .tolist() raised NotImplementedError
            raise PromptTypeError(
                f"{param} is a meta-device tensor, which holds no data; pass real token ids", param=param
            )
        shape = tuple(prompt.shape)
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        elif len(shape) != 1:
            raise PromptTypeError(
                f"a token-id {type(prompt).__name__} {param} must be 1-D or [1, S], got shape {shape}; "
                "pass one sequence per request (generate_batch takes a list of them)",
                param=param,
            )
        prompt = prompt.tolist()
    text = "a str or " if param == "prompt" else ""
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise PromptTypeError(
            f"{param} must be {text}token ids (a list, or a 1-D / [1, S] tensor or array), "
            f"got {type(prompt).__name__}"
            + ("; pass its ['input_ids']" if isinstance(prompt, Mapping) and "input_ids" in prompt else ""),
            param=param,
        )
    ids: list[int] = []
    for i, t in enumerate(prompt):
        # NOTE: numpy / 0-d tensor ints are ints too (operator.index); bools and floats are not token ids.
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            if isinstance(t, Mapping) and "role" in t:
                hint = "; chat messages are rendered by engine.chat_prompt(messages), whose ids are a prompt"
            elif isinstance(t, str) and param == "prompt":  # vLLM's LLM.generate takes a list of prompts
                hint = "; for several prompts use engine.generate_batch(prompts, ...)"
            else:
                hint = ""

            raise PromptTypeError(
                f"{param} must be {text}a list of int token ids; {param}[{i}] is {type(t).__name__} {t!r}{hint}",
                param=param,
            ) from None
    return ids


def check_context(
    limit: int | None, prompt_tokens: int, max_new_tokens: int, *, reason: str | None = None
) -> None:
    """Raise :class:`ContextLengthError` when prompt + new tokens do not fit the model's context ``limit``
    (``reason``: why the limit is below the model's own window, appended to the message)."""
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        # Name a fix that works: lowering max_new_tokens helps only while the prompt leaves room for at
        # least one new token (it must be >= 1); otherwise only a shorter prompt fits.
        room = limit - prompt_tokens
        if max_new_tokens == 0:  # scoring a prompt (prompt_logprobs): no new tokens involved
            fix = f"shorten the prompt to at most {limit} tokens"
        elif room >= 1:
            fix = f"shorten the prompt or lower max_new_tokens to {room}"
        elif max_new_tokens < limit:
            fix = f"shorten the prompt to at most {limit - max_new_tokens} tokens (prompt and new tokens share the context)"
        else:
            fix = f"shorten the prompt below {limit} tokens and lower max_new_tokens (they share the context)"
        asked = f"prompt ({prompt_tokens} tokens)" + (
            f" + max_new_tokens ({max_new_tokens})" if max_new_tokens else ""
        )
        raise ContextLengthError(
            f"{asked} exceeds the model's context of {limit} tokens; {fix}"
            + (f" ({reason})" if reason else ""),
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            context_length=limit,
        )


def check_prefill_chunk_size(value: object) -> int | None:
    """``value`` when it is a positive int or None (the whole suffix in one forward); else a typed error."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(
            f"prefill_chunk_size must be a positive int (e.g. 512) or None, got {value!r}",
            param="prefill_chunk_size",
        )
    return value  # type: ignore[return-value]


def check_cache_salt(value: object) -> str | None:
    """``value`` when it is a non-empty str or None (no tenant isolation); else a typed error.

    An empty salt is refused rather than read as "no salt": a caller that meant to isolate a tenant and sent
    ``""`` would otherwise share the unsalted cache silently.
    """
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequestError(
            f"cache_salt must be a non-empty str (e.g. a tenant id) or None, got {value!r}",
            param="cache_salt",
        )
    return value  # type: ignore[return-value]


def live_bits(kv_cache_bits: int | None) -> int | None:
    """8 or 4 when the request's live KV is quantized; None (exact path) for 16 and the default."""
    return kv_cache_bits if kv_cache_bits in (8, 4) else None
