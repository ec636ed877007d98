"""How far cached generation drifts from no-cache: per prompt reuse, logit error, KL and greedy agreement.

Exact reuse must show zero drift (fp32: max-abs-diff ~1e-6, KL ~0, identical continuations); stitched
(approximate) reuse shows what it costs. The default prompts are RAG-shaped: the same documents (Python's
own ``pydoc_data.topics``) in different orders after one system prompt, so later prompts stitch.

Greedy identity over many tokens is chaotic on a small model (one near-tie flips the rest), so the KV is
judged *teacher-forced* too (:func:`teacher_forced_logits`, :func:`compare_distributions`): along the
no-cache continuation, does the cached path pick the same next token at every position, and how far apart
are the two distributions (KL, nats)?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.errors import ContextLengthError, InvalidRequestError

if TYPE_CHECKING:
    from kvb_cache.engine import KVBoost
    from kvb_cache.prepared import Prompt

_DEFAULT_TOPICS = ("assignment", "exceptions", "for", "with")
_SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptFidelity:
    """One prompt through the cache compared with a plain no-cache forward and greedy generation."""

    prompt_tokens: int
    #: Prompt tokens served from cache (exact + stitched) / prompt tokens.
    reuse_ratio: float
    recomputed_tokens: int
    #: ``max |logits_cached - logits_nocache|`` of the first generated token.
    max_abs_logit_diff: float
    #: ``KL(p_nocache || p_cached)`` of the first token's distribution (nats).
    kl: float
    top1_agrees: bool
    #: Fraction of the ``new_tokens`` greedy tokens equal to no-cache greedy, position by position.
    greedy_agreement: float
    #: The whole greedy continuation is identical.
    identical: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CorrectnessReport:
    """Per-prompt fidelity plus aggregates (see :func:`verify_correctness`)."""

    prompts: tuple[PromptFidelity, ...]
    new_tokens: int

    @property
    def top1_agreement(self) -> float:
        return sum(p.top1_agrees for p in self.prompts) / len(self.prompts)

    @property
    def identical_rate(self) -> float:
        return sum(p.identical for p in self.prompts) / len(self.prompts)

    @property
    def max_kl(self) -> float:
        return max(p.kl for p in self.prompts)

    @property
    def max_abs_logit_diff(self) -> float:
        return max(p.max_abs_logit_diff for p in self.prompts)


def default_prompts(words_per_doc: int = 120) -> list[str]:
    """Four RAG prompts over the same four stdlib documents in rotated orders (each spans several chunks)."""
    from pydoc_data.topics import topics

    docs = [
        f"Document ({name}):\n" + " ".join(topics[name].split()[:words_per_doc]) + "\n\n"
        for name in _DEFAULT_TOPICS
    ]
    questions = (
        "Question: which statement binds names?",
        "Question: how are errors handled?",
        "Question: how do loops iterate?",
        "Question: what does a context manager do?",
    )
    n = len(docs)
    return [
        _SYSTEM + "".join(docs[(i + j) % n] for j in range(n)) + q + "\nAnswer:"
        for i, q in enumerate(questions)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinuationLogits:
    """Next-token logits at every position of a continuation, computed through the cache."""

    #: ``[T, V]``: row ``t`` predicts ``continuation[t]`` (after the prompt and ``continuation[:t]``).
    logits: torch.Tensor
    #: Prompt tokens served from cache (exact + stitched).
    cached_tokens: int
    recomputed_tokens: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributionAgreement:
    """Per-position agreement of two ``[T, V]`` logit sequences (reference vs cached)."""

    #: Fraction of positions whose argmax agrees.
    top1_agreement: float
    #: ``KL(p_reference || p_cached)`` per position, nats.
    kl: tuple[float, ...]

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl)


def compare_distributions(reference: torch.Tensor, other: torch.Tensor) -> DistributionAgreement:
    """Top-1 agreement and per-position KL of ``reference`` vs ``other`` logits, both ``[T, V]``."""
    ref, oth = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    kl = torch.sum(ref.exp() * (ref - oth), dim=-1).clamp_min(0.0)
    agree = (reference.argmax(-1) == other.argmax(-1)).double().mean()
    return DistributionAgreement(top1_agreement=float(agree), kl=tuple(kl.tolist()))


@torch.inference_mode()
def reference_continuation_logits(model, ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """No-cache ``[T, V]`` logits along ``continuation`` (one plain forward over prompt + continuation)."""
    tokens = torch.tensor([list(ids) + list(continuation[:-1])], device=model.device)
    return model(tokens).logits[0, -len(continuation) :]


@torch.inference_mode()
def teacher_forced_logits(
    engine: KVBoost, prompt: Prompt, continuation: Sequence[int], *, cache_salt: str | None = None
) -> ContinuationLogits:
    """The cached path's next-token logits at every position of ``continuation`` (teacher forcing).

    The prompt is prepared exactly as a request's would be (exact prefix, stitched pieces re-positioned and
    repaired by the engine's :class:`~kvb_cache.StitchConfig`); then its uncached suffix and ``continuation``
    run in one forward over that KV. Like :meth:`~kvb_cache.KVBoost.next_token_logits`, the prompt's exact
    part is stored afterwards (never its approximate part).
    """
    ids = engine._tokenize(prompt)
    root = engine._salted_root(cache_salt)
    prepared = engine._prepare(ids, max_reuse=len(ids) - 1, stitch=True, root=root)
    start = prepared.cached_tokens
    tokens = ids[start:] + list(continuation[:-1])
    device = engine.device
    out = engine.model(
        input_ids=torch.tensor([tokens], device=device),
        position_ids=torch.arange(start, start + len(tokens), device=device).unsqueeze(0),
        **cache_kwargs(engine.model, prepared.cache),
        use_cache=True,
    )
    engine.store_sequence(prepared.storable(ids), prepared.cache, root=root)
    return ContinuationLogits(
        logits=out.logits[0, -len(continuation) :],
        cached_tokens=prepared.served_tokens,
        recomputed_tokens=prepared.recomputed_tokens,
        prompt_tokens=len(ids),
    )


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """``KL(softmax(reference) || softmax(other))`` of logits ``[V]``, in nats."""
    ref, oth = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    return float(torch.sum(ref.exp() * (ref - oth)).clamp_min(0.0))


@torch.inference_mode()
def _no_cache(model, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    input_ids = torch.tensor([ids], device=model.device)
    first = model(input_ids).logits[0, -1]
    out = model.generate(
        input_ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return first, out[0, len(ids) :].tolist()


def verify_correctness(
    engine: KVBoost, prompts: Sequence[Prompt] | None = None, *, new_tokens: int = 16
) -> CorrectnessReport:
    """Run ``prompts`` in order through ``engine`` (its cache fills as they go) and compare each with no-cache.

    Args:
        prompts: strings or token ids; default :func:`default_prompts` (later ones reuse earlier documents).
        new_tokens: greedy tokens compared per prompt (>= 1).

    Raises:
        InvalidRequestError: ``new_tokens`` is not a positive int (0 raised transformers' own ValueError
            from inside the no-cache reference ``generate``), or ``prompts`` is a single string.
        ContextLengthError: a prompt and ``new_tokens`` do not fit the engine's context or pool, raised before
            the no-cache reference runs.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise InvalidRequestError(
            f"new_tokens must be an int >= 1 (e.g. 16), got {new_tokens!r}", param="new_tokens"
        )
    if isinstance(prompts, (str, bytes)):  # iterated, "Hello" was five one-character prompts
        raise InvalidRequestError(
            "prompts must be a list of prompts; wrap a single one: [prompt]", param="prompts"
        )
    rows = []
    for prompt in prompts if prompts is not None else default_prompts():
        ids = engine._tokenize(prompt)
        # Before the reference: it generates on the bare model, which nothing bounds (new_tokens=10**9 ran
        # until killed; 2000 ran past the model's positions for 14 s before the engine refused it).
        try:
            engine._check_context(len(ids), new_tokens)
        except ContextLengthError as exc:
            if prompts is not None:
                raise
            # The caller passed no prompt, so "shorten the prompt" named nothing they could change.
            raise ContextLengthError(
                f"the built-in verification prompts need {len(ids) + new_tokens} tokens of context, this "
                f"engine has {exc.context_length}: pass your own, engine.verify_correctness([prompt, ...])",
                prompt_tokens=exc.prompt_tokens,
                max_new_tokens=exc.max_new_tokens,
                context_length=exc.context_length,
            ) from None
        ref_logits, ref_tokens = _no_cache(engine.model, ids, new_tokens)
        cached = engine.next_token_logits(ids)
        out = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        same = [a == b for a, b in zip(out.output_ids, ref_tokens)]
        rows.append(
            PromptFidelity(
                prompt_tokens=len(ids),
                reuse_ratio=cached.cached_tokens / len(ids),
                recomputed_tokens=cached.recomputed_tokens,
                max_abs_logit_diff=float((cached.logits.float() - ref_logits.float()).abs().max()),
                kl=kl_divergence(ref_logits, cached.logits),
                top1_agrees=int(cached.logits.argmax()) == int(ref_logits.argmax()),
                greedy_agreement=sum(same) / new_tokens,
                identical=out.output_ids == ref_tokens,
            )
        )
    return CorrectnessReport(prompts=tuple(rows), new_tokens=new_tokens)
