"""Strict vocabulary parity between a target model and its draft model.

Verification compares token *ids*: a draft model whose ids mean other strings (or whose special tokens
differ) would silently propose garbage, so any difference is refused at construction time.
"""

from __future__ import annotations

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

    Raises:
        VocabularyMismatchError: listing every difference.
    """
    mismatches = []
    for key, (want, got) in _zip_dicts(_sizes(target), _sizes(draft)).items():
        if want != got:
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


def _zip_dicts(a: dict[str, object], b: dict[str, object]) -> dict[str, tuple[object, object]]:
    return {key: (a.get(key), b.get(key)) for key in dict.fromkeys([*a, *b])}
