"""Sampling options named as transformers, vLLM or OpenAI name them, and what each is called here.

An unknown option is refused, never silently ignored: a user porting ``model.generate(..., do_sample=True)``
or a vLLM ``SamplingParams`` is told the name to use instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvb_cache.errors import UnknownOptionError

_HF_BATCH_CALL = (
    "pass the prompt itself (a string or token ids) as the first argument: engine.generate(**tokenizer(...)) "
    "sends input_ids / attention_mask"
)
_HF_OUTPUTS = "the result carries output_ids and, with logprobs=k, each token's logprob and k alternatives"

#: What a transformers ``generate`` / vLLM ``SamplingParams`` / OpenAI name is here: unknown options are
#: refused (never silently ignored), with this said.
FOREIGN_OPTIONS = {
    "max_tokens": "the length limit is max_new_tokens",
    "max_length": "the length limit is max_new_tokens (new tokens, not prompt + new)",
    "min_new_tokens": "use min_tokens",
    "do_sample": "sampling is on when temperature > 0 (0, the default, is greedy)",
    "stop_strings": "use stop",
    "eos_token_id": "use stop_token_ids (the model's eos ids always stop unless ignore_eos)",
    "bad_words": "pass token ids as bad_words_ids (kvb_cache.token_bans.bad_words_ids(tokenizer, words))",
    "prompt_logprobs": "use engine.prompt_logprobs(prompt)",
    "guided_decoding": "use response_format",
    "structured_outputs": "use response_format",
    "streamer": "use engine.stream(prompt, ...), which yields text deltas",
    "sampling_params": "a SamplingParams goes to engine.generate(prompt, params), engine.stream(prompt, params) "
    "or engine.add_request(prompt, params); generate_batch takes options shared by every prompt as keywords and "
    "per-prompt ones as sampling=[{...}, ...]",
    "n": "one completion per call: engine.generate_batch([prompt] * n, sampling=[{'seed': s + i} for i in "
    "range(n)]) for several (one seed for all gives n identical completions)",
    "num_return_sequences": "one completion per call: engine.generate_batch([prompt] * n, sampling=[{'seed': "
    "s + i} for i in range(n)]) for several (one seed for all gives n identical completions)",
    "logits_processor": "custom logits processors are not supported: use logit_bias or response_format",
    "stopping_criteria": "custom stopping criteria are not supported: use stop / stop_token_ids",
    "generator": "use seed (an int) for a reproducible sample",
    "input_ids": _HF_BATCH_CALL,
    "attention_mask": "pass each prompt unpadded (ids[attention_mask.bool()] for a row of a padded batch)",
    "generation_config": "pass its fields as options (max_new_tokens, temperature, top_p, top_k, ...)",
    "pad_token_id": "not needed: prompts are not padded",
    "num_beams": "beam search is not supported (greedy, temperature=0, or sampling)",
    "no_repeat_ngram_size": "not supported: use repetition_penalty, presence_penalty or frequency_penalty",
    "typical_p": "not supported: use top_p, top_k or min_p",
    "output_scores": _HF_OUTPUTS,
    "output_logits": _HF_OUTPUTS + " (engine.next_token_logits(prompt) gives raw logits)",
    "return_dict_in_generate": _HF_OUTPUTS,
    "use_cache": "the engine always uses its KV cache",
    "past_key_values": "the engine finds cached KV itself (engine.lookup_cache(ids) hands it to model.generate)",
}


def refuse_unknown(fields: Iterable[str], valid: Sequence[str]) -> None:
    """Refuse option names not in ``valid`` (:class:`~kvb_cache.sampling.SamplingParams`' fields), naming the
    equivalent of a transformers / vLLM / OpenAI name. (The dataclass's own ``TypeError``, "unexpected
    keyword argument", named neither the valid options nor the equivalent.)

    Raises:
        UnknownOptionError: a name outside ``valid``.
    """
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        hints = [f"{name}: {FOREIGN_OPTIONS[name]}" for name in unknown if name in FOREIGN_OPTIONS]
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise UnknownOptionError(
            f"unknown sampling option(s) {', '.join(unknown)}{hint}; valid: {', '.join(valid)}",
            param=unknown[0],
        )
