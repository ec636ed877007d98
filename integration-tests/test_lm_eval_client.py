"""lm-evaluation-harness's ``local-completions`` model against a real ``python -m kvb_server`` (SmolLM2).

lm-eval scores multiple-choice and perplexity tasks through ``/v1/completions`` with ``echo: true,
logprobs: 1``, and tokenizes through the server (``/tokenizer_info``, ``/tokenize``, ``/detokenize``) when
it finds those routes. The loglikelihoods it computes must equal a plain Hugging Face forward, and its
generation requests must equal greedy decoding.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import server_process

lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions", reason="nox installs lm-eval")
from lm_eval.api.instance import Instance  # noqa: E402

MODEL = "smollm2-135m"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = (" Paris", " London", " Berlin", " the city of Lyon")


@pytest.fixture(scope="module")
def lm() -> Iterator[object]:
    flags = ("--model", MODEL, "--max-tokens", "64", "--chunk-size", "32", "--log-level", "warning")
    with server_process("kvb_server", *flags) as url:
        yield lm_eval_api.LocalCompletionsAPI(
            base_url=f"{url}/v1/completions", model=MODEL, max_length=2048, num_concurrent=1, batch_size=2
        )


def _hf_loglikelihood(smollm2, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval's own ``hf`` model computes: context and continuation tokenized apart, one forward."""
    model, tokenizer = smollm2
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    return float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), logp.argmax(-1).tolist() == cont


def test_remote_tokenizer_is_detected(lm) -> None:
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode("Hello world") == lm.tokenizer.encode("Hello world")


def test_loglikelihood_equals_a_plain_forward(lm, smollm2) -> None:
    requests = [Instance("loglikelihood", {}, (CONTEXT, c), i) for i, c in enumerate(CHOICES)]
    got = lm.loglikelihood(requests)
    want = [_hf_loglikelihood(smollm2, CONTEXT, c) for c in CHOICES]
    for (value, greedy), (ref, ref_greedy) in zip(got, want):
        assert value == pytest.approx(ref, abs=1e-3)
        assert greedy == ref_greedy
    assert max(range(len(CHOICES)), key=lambda i: got[i][0]) == 0  # the model prefers " Paris"


def test_generate_until_equals_greedy(lm, smollm2) -> None:
    model, tokenizer = smollm2
    prompt = "The capital of France is"
    [text] = lm.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 8}), 0)]
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert text == tokenizer.decode(out).split("\n")[0]
