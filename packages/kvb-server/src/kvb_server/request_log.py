"""``--enable-log-requests`` (vLLM's): one INFO line per generation request on the ``kvb_server.requests``
logger, with its prompt, prompt token ids and sampling parameters, for debugging a deployment.

Off by default: prompts are the users' data. ``--max-log-len N`` keeps the first N characters of the
prompt and the first N token ids (vLLM's flag; unset: all of them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvb_server.request_id import CURRENT

logger = logging.getLogger("kvb_server.requests")


def log_request(
    *,
    endpoint: str,
    model: str,
    job_ids: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    n: int,
    sampling: object,
    tokenizer: Any | None,
    max_len: int | None,
) -> None:
    """Log one line per prompt of a request: its choices' job ids, the prompt as text and as token ids
    (each cut to ``max_len``), the sampling parameters (``repr``, as vLLM logs them) and the request's
    ``x-request-id`` (the client's or gateway's, else the one the response carries). Without a
    ``tokenizer`` (a service built without its engine) the text is logged as None, the ids as ever."""
    if not logger.isEnabledFor(logging.INFO):
        return
    for p, ids in enumerate(prompts):
        shown = list(ids[:max_len])  # a slice to None keeps them all
        # The prompt is tokens by now (text prompts were encoded in the plan): decoded back, special
        # tokens kept, it is what the model reads.
        text = None if tokenizer is None else tokenizer.decode(shown)[:max_len]
        cut = "" if len(shown) == len(ids) else f" (first {max_len} of {len(ids)})"
        jobs = [str(j) for j in job_ids[p * n : (p + 1) * n]] or ["none: prompt only"]
        logger.info(
            "request %s %s x-request-id=%s model=%s prompt=%r prompt_token_ids%s=%s sampling=%r",
            endpoint,
            ",".join(jobs),
            CURRENT.get(),
            model,
            text,
            cut,
            shown,
            sampling,
        )
