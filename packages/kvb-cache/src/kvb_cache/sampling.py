"""Per-request sampling parameters (:class:`SamplingParams`), validated when built."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvb_cache.errors import InvalidRequestError, PromptTypeError
from kvb_cache.foreign_options import refuse_unknown
from kvb_cache.prediction import check_prediction
from kvb_cache.structured.spec import ResponseFormat
from kvb_cache.token_bans import check_allowed, check_sequences

#: Temperatures below this decode greedily (vLLM's sampling epsilon, the same value).
GREEDY_TEMPERATURE = 1e-5
#: OpenAI's ``logit_bias`` range; values outside it are clamped.
MAX_LOGIT_BIAS = 100.0
#: ``repetition_penalty`` bounds (the server's schema has the same): outside them float32 logits overflow.
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request decodes.

    ``temperature == 0`` (anything below :data:`GREEDY_TEMPERATURE`) is greedy. ``top_k == 0`` (or -1),
    ``top_p == 1`` and ``min_p == 0`` disable those filters (``min_p``: drop tokens less likely than ``min_p``
    times the most likely one, after temperature and before top-k and top-p, as vLLM orders them;
    transformers applies it after top-p). ``seed`` -1 means no seed, as in vLLM.
    ``repetition_penalty`` follows Hugging Face (divides positive logits of every token seen, prompt
    included); ``presence_penalty`` / ``frequency_penalty`` follow OpenAI (subtracted from the logits of
    tokens already generated). ``min_tokens`` (vLLM) holds end-of-sequence and stop strings back until that
    many tokens are generated (EOS logits ``-inf``, as transformers' ``MinNewTokensLengthLogitsProcessor``;
    ``ignore_eos`` leaves EOS alone). vLLM's ``stop_token_ids`` end generation like end-of-sequence (even
    with ``ignore_eos``) and become the result's ``stop_reason``; ``include_stop_str_in_output`` keeps the
    stop string or stop token in the text; ``skip_special_tokens=False`` keeps special tokens' text.
    ``logprobs = k`` returns each chosen token's log-probability plus the ``k``
    most likely alternatives (the whole vocabulary when ``k`` exceeds it; the server caps ``k`` with
    ``--max-logprobs``), under the model's raw distribution (before penalties, temperature and
    filters, as vLLM's default ``raw_logprobs``; None: off).

    ``response_format`` constrains the output to a grammar (anything :meth:`ResponseFormat.parse` accepts:
    a JSON schema dict, a pydantic model class, ``"json"``, a regex or a Lark/GBNF grammar; needs
    ``kvb-cache[structured]``). ``logit_bias`` maps token ids to a bias added to their logits (OpenAI
    semantics: clamped to [-100, 100]; -100 bans a token, +100 all but forces it). ``allowed_token_ids``
    (vLLM) keeps only those tokens; ``bad_words_ids`` (transformers' name, vLLM's ``bad_words`` as token ids:
    :func:`kvb_cache.token_bans.bad_words_ids`) bans each sequence's last token wherever the output ends with
    its other tokens (:mod:`kvb_cache.token_bans`). Both act before penalties and filters, as in vLLM.

    ``prediction_ids`` (OpenAI's predicted outputs, as token ids) are tokens the output is expected to
    repeat: they are drafted and verified (:mod:`kvb_cache.prediction`), so the output is what it is without
    them, sooner where they match (greedy, or unseeded sampling without penalties; not with a grammar,
    ``logprobs`` or ``kv_cache_bits``, where they are ignored).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    prediction_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _plain_numbers(self)

        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        def number(param: str) -> float:
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(param, "must be a finite number")
            return value

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise bad("max_new_tokens", "must be an int")
        if self.max_new_tokens <= 0:
            raise bad("max_new_tokens", "must be >= 1")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise bad("min_tokens", "must be an int")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise bad("min_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        if number("temperature") < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < number("top_p") <= 1:
            raise bad("top_p", "must be in (0, 1]")
        # The batched sampler holds every row's k in one int64 tensor: a wider k failed the step of every
        # request decoding beside this one (any k past the vocabulary keeps every token anyway).
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # vLLM's "off"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**63:
            raise bad("top_k", "must be an int in [0, 2**63) (0 or -1 disables it)")
        if not 0 <= number("min_p") <= 1:
            raise bad("min_p", "must be in [0, 1] (0 disables it)")
        # Bounded so penalized logits stay finite in float32 (1e-308 is 0 there: logits / 0 = inf, and the
        # softmax's NaN failed the step of every request decoding beside this one); 1.0-2.0 is the useful range.
        if not MIN_REPETITION_PENALTY <= number("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise bad(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1.0 disables it)",
            )
        for param in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(param) <= 2:
                raise bad(param, "must be in [-2, 2]")
        # Lists are what generate() and the server take; the frozen params keep a hashable tuple.
        for param in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, param), list):
                object.__setattr__(self, param, tuple(getattr(self, param)))
        # One stop string, as generate(stop="x") and vLLM take it.
        if isinstance(self.stop, str) and self.stop:
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list or tuple of non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list or tuple of token ids >= 0")
        for flag in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):  # "false" is truthy
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "must be a bool")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an int or None")
        if self.seed == -1:
            # vLLM's rule, and the "random seed" of clients that send -1 (text-generation-webui, SillyTavern):
            # taken as a seed, every such request sampled the same reply.
            object.__setattr__(self, "seed", None)
        # torch.Generator.manual_seed takes a 64-bit seed (negative ones wrap); anything wider raised a bare
        # ValueError ("Overflow when unpacking long long") from inside torch.
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits: an int in [-2**63, 2**64)")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 0
        ):
            raise bad("logprobs", "must be None or an int >= 0")
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", check_allowed(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_ids", check_sequences(self.bad_words_ids))
        object.__setattr__(self, "prediction_ids", check_prediction(self.prediction_ids))

    @classmethod
    def build(
        cls,
        *,
        stop: str | list[str] | tuple[str, ...] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **fields,
    ) -> SamplingParams:
        """Accept ``stop`` as a string, a list or None and ``stop_token_ids`` as any sequence (as the public
        API does)."""
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)):
            stops = tuple(stop)
        else:
            raise PromptTypeError(
                f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop"
            )
        if stop_token_ids is not None and not isinstance(stop_token_ids, (list, tuple)):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}",
                param="stop_token_ids",
            )
        refuse_unknown(fields, _FIELD_NAMES)
        return cls(stop=stops, stop_token_ids=tuple(stop_token_ids or ()), **fields)

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE the division by the temperature overflows the logits to inf/NaN (a fuzzer's
        # 1.4e-83 crashed multinomial); the distribution is one-hot long before that, so it *is* greedy.
        return self.temperature < GREEDY_TEMPERATURE


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_INT_FIELDS = ("max_new_tokens", "top_k", "min_tokens", "seed", "logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _plain_numbers(params: SamplingParams) -> None:
    """NumPy (and other non-bool ``numbers``) scalars as Python ints and floats: what numpy / torch code hands
    around (``np.float32(0.7)`` was refused as "must be a finite number" while the prompt took numpy ints);
    the float fields as floats, Python ints included. Anything else is left for the checks to refuse."""
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(params, name, operator.index(value))
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        # Python ints too: transformers' warpers demand a float (temperature=2 and repetition_penalty=2 were a
        # bare ValueError, "has to be a strictly positive float"). An int past float's range is left as inf,
        # for the finiteness check to refuse.
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
            try:
                object.__setattr__(params, name, float(value))
            except OverflowError:
                object.__setattr__(params, name, math.inf)
    if isinstance(params.stop_token_ids, (list, tuple)):
        object.__setattr__(
            params,
            "stop_token_ids",
            tuple(
                operator.index(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                for t in params.stop_token_ids
            ),
        )


def _checked_init(init: Callable[..., None]) -> Callable[..., None]:
    """``SamplingParams(**options)`` refuses unknown names as :meth:`SamplingParams.build` does."""

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **fields: Any) -> None:
        refuse_unknown(fields, _FIELD_NAMES)
        init(self, *args, **fields)

    return __init__


SamplingParams.__init__ = _checked_init(SamplingParams.__init__)  # type: ignore[method-assign]


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    """Token id (int, or a decimal string as JSON sends it) -> bias clamped to [-100, 100]; None if empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(
            f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}", param="logit_bias"
        )
    out: dict[int, float] = {}
    for token, value in bias.items():
        # ASCII digits only: str.isdigit() also accepts "²" and "４２", which int() rejects or reads as
        # another id.
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        elif isinstance(token, numbers.Integral) and not isinstance(token, bool):
            token = operator.index(token)  # a numpy int
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
            value = float(value)  # a numpy float
        # An int past the bound is clamped below anyway; float(10**400) overflowed first.
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_LOGIT_BIAS:
            value = MAX_LOGIT_BIAS if value > 0 else -MAX_LOGIT_BIAS
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(
                f"logit_bias[{token}] must be a finite number, got {value!r}", param="logit_bias"
            )
        out[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
    return out or None


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every ``logit_bias``, ``stop_token_ids``, ``allowed_token_ids`` and ``bad_words_ids`` token id must
    exist in the model's vocabulary (checked at admission)."""
    for param, ids in (
        ("logit_bias", params.logit_bias or ()),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_ids", [t for seq in params.bad_words_ids for t in seq]),
        ("prediction_ids", params.prediction_ids or ()),
    ):
        if ids and max(ids) >= vocab_size:
            raise InvalidRequestError(
                f"{param} token id {max(ids)} is outside the vocabulary (size {vocab_size})", param=param
            )
