"""Log-probabilities of a prompt's own tokens: OpenAI's ``echo`` + ``logprobs``, lm-eval's loglikelihood.

Scoring needs the model's output at *every* prompt position, and a cached prefix has KV but no outputs, so
this is a plain forward over the whole prompt (no cache read, nothing stored), in slices with a
:class:`~transformers.DynamicCache` so the ``[slice, vocab]`` logits stay bounded. vLLM does the same for
``prompt_logprobs`` (it skips its prefix cache for such requests).

The numbers follow the generation path's convention (:func:`kvb_cache.emitter.token_logprob`): log-softmax
of the model's raw logits in fp32, so a prompt token and a generated token are scored alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.emitter import TokenTexts
from kvb_cache.results import TokenLogprob

#: Prompt positions per forward: bounds the fp32 logits to ``SLICE * vocab * 4`` bytes (~50 MB at 49k).
SLICE = 256


def prompt_logprobs(
    model: PreTrainedModel,
    texts: TokenTexts,
    ids: Sequence[int],
    *,
    top: int = 0,
    slice_size: int = SLICE,
    device: torch.device | None = None,
) -> list[TokenLogprob]:
    """Score ``ids[1:]``: entry ``j - 1`` is token ``ids[j]`` under the model's distribution after
    ``ids[:j]``, with the ``top`` most likely tokens there (best first). The first token has no entry
    (nothing precedes it), so ``len(result) == len(ids) - 1``.

    Equal to ``log_softmax(model(ids).logits[0, :-1])`` gathered at ``ids[1:]``, up to float summation
    order across slices.
    """
    if len(ids) < 2:
        return []
    device = model.device if device is None else device
    cache = DynamicCache(config=model.config)
    entries: list[TokenLogprob] = []
    with torch.inference_mode():
        # The last token is never fed: nothing in the prompt follows it.
        for start in range(0, len(ids) - 1, slice_size):
            end = min(start + slice_size, len(ids) - 1)
            logits = model(
                input_ids=torch.tensor([ids[start:end]], device=device),
                position_ids=torch.arange(start, end, device=device)[None],
                past_key_values=cache,
                use_cache=True,
            ).logits[0]  # [S, V]
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = list(ids[start + 1 : end + 1])
            chosen = logp.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].tolist()
            best: list[list[tuple[int, float]]] = [[] for _ in targets]
            if top:
                values, indices = torch.topk(logp, top, dim=-1)
                best = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            for token, logprob, alternatives in zip(targets, chosen, best):
                entries.append(
                    TokenLogprob(
                        token_id=token,
                        token=texts.token_text(token),
                        logprob=logprob,
                        top=tuple((i, texts.token_text(i), v) for i, v in alternatives),
                    )
                )
    return entries
