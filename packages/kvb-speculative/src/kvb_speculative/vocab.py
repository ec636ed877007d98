"""Vocabulary parity between a target model and its draft model.

Verification compares token *ids*: a draft model whose ids mean other strings (or whose special tokens
differ) would silently propose garbage, so any difference is refused at construction time. One difference
is allowed: embedding tables padded to different sizes (Qwen2.5-0.5B has 151,936 rows, 7B 152,064, for
the same 151,665-token tokenizer), when both tokenizers are given and equal and every tokenizer id has a
row in both models; the draft's logits are then fitted to the target's width (:func:`fit_width`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_speculative.errors import VocabularyMismatchError

#: Config / generation-config attributes that name special token ids.
SPECIAL_TOKEN_FIELDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "sep_token_id",
)


def _ids(value: object) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    return sorted(int(v) for v in value)  # type: ignore[union-attr]


def _sizes(model: PreTrainedModel) -> dict[str, int | None]:
    output = model.get_output_embeddings()
    return {
        "config.vocab_size": getattr(model.config.get_text_config(), "vocab_size", None),
        "input embedding rows": model.get_input_embeddings().num_embeddings,
        "output embedding rows": None if output is None else output.weight.shape[0],
    }


def _special_ids(model: PreTrainedModel) -> dict[str, list[int] | None]:
    found: dict[str, list[int] | None] = {}
    sources = (
        ("config", model.config.get_text_config()),
        ("generation_config", getattr(model, "generation_config", None)),
    )
    for source_name, source in sources:
        if source is None:
            continue
        for field in SPECIAL_TOKEN_FIELDS:
            found[f"{source_name}.{field}"] = _ids(getattr(source, field, None))
    return found


def _tokenizer_mismatches(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> list[str]:
    mismatches = []
    if len(target) != len(draft):
        mismatches.append(f"tokenizer length: target {len(target)} != draft {len(draft)}")
    if target.get_vocab() != draft.get_vocab():
        mismatches.append("tokenizer vocabulary: the token -> id maps differ")
    if target.all_special_ids != draft.all_special_ids:
        mismatches.append(
            f"tokenizer special ids: target {target.all_special_ids} != draft {draft.all_special_ids}"
        )
    return mismatches


def check_vocab_parity(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    *,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """Raise unless ``target`` and ``draft`` share vocabulary sizes and every special token id.

    Compared: ``config.vocab_size``, the rows of the input and output embeddings, and each of
    ``bos/eos/pad/decoder_start/sep_token_id`` in both ``config`` and ``generation_config``. When both
    tokenizers are given, their lengths, token -> id maps and special ids are compared too.

    Sizes may differ when both tokenizers are given, equal, and no longer than any of the sizes: tables
    padded past the tokenizer (the padding rows are ids no text maps to).

    Raises:
        VocabularyMismatchError: listing every difference.
    """
    mismatches = []
    padded = _padded_tables(target, draft, target_tokenizer, draft_tokenizer)
    for key, (want, got) in _zip_dicts(_sizes(target), _sizes(draft)).items():
        if want != got and not padded:
            mismatches.append(f"{key}: target {want} != draft {got}")
    for key, (want, got) in _zip_dicts(_special_ids(target), _special_ids(draft)).items():
        if want != got:
            mismatches.append(f"{key}: target {want} != draft {got}")
    if (target_tokenizer is None) != (draft_tokenizer is None):
        mismatches.append("tokenizers: pass both target_tokenizer and draft_tokenizer, or neither")
    elif target_tokenizer is not None and draft_tokenizer is not None:
        mismatches.extend(_tokenizer_mismatches(target_tokenizer, draft_tokenizer))
    if mismatches:
        raise VocabularyMismatchError(tuple(mismatches))


def _padded_tables(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None,
    draft_tokenizer: PreTrainedTokenizerBase | None,
) -> bool:
    """Whether both tokenizers are given and equal and every size of both models covers them."""
    if target_tokenizer is None or draft_tokenizer is None:
        return False
    if _tokenizer_mismatches(target_tokenizer, draft_tokenizer):
        return False
    sizes = [*_sizes(target).values(), *_sizes(draft).values()]
    return all(isinstance(n, int) and n >= len(target_tokenizer) for n in sizes)


def logits_width(model: PreTrainedModel) -> int:
    """The width of ``model``'s logits: its output embedding rows (``config.vocab_size`` without a head)."""
    sizes = _sizes(model)
    width = sizes["output embedding rows"] or sizes["config.vocab_size"]
    if not isinstance(width, int):
        raise VocabularyMismatchError((f"cannot tell the logits width of {type(model).__name__}",))
    return width


def fit_width(logits: torch.Tensor, width: int) -> torch.Tensor:
    """``logits`` ``[..., V]`` as ``[..., width]``: padding ids past ``V`` get -inf (never proposed), ids
    past ``width`` (the draft's own padding) are dropped."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def _zip_dicts(a: dict[str, object], b: dict[str, object]) -> dict[str, tuple[object, object]]:
    return {key: (a.get(key), b.get(key)) for key in dict.fromkeys([*a, *b])}
