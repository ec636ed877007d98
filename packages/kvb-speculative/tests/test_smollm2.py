"""Greedy exactness on the real SmolLM2-135M-Instruct (opt-in: set KVB_SPECULATIVE_SLOW=1).

Unit tests use tiny random models; this check needs the embedded model, which only the dev environment
(kvb-cache installed with the converted SmolLM2) has. It is skipped elsewhere, including `nox -s kvb-speculative`.
"""

import os

import pytest
import torch
from fakes import ScriptedDrafter
from helpers import greedy, plain_decode

from kvb_speculative import PromptLookupDrafter, speculative_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("KVB_SPECULATIVE_SLOW") != "1", reason="set KVB_SPECULATIVE_SLOW=1"),
]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    embedded = pytest.importorskip("kvb_cache.embedded", reason="needs kvb-cache's embedded SmolLM2")
    transformers = pytest.importorskip("transformers")
    path = embedded.embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = "Repeat this line exactly: def add(a, b):\n    return a + b\n"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return model, ids, plain_decode(model, ids, greedy(), NUM_TOKENS + 8)


@pytest.mark.parametrize("gamma", [2, 5])
@pytest.mark.parametrize("drafter", ["oracle", "always_wrong", "prompt_lookup"])
def test_smollm2_greedy_is_exact(smollm2, gamma, drafter):
    model, ids, reference = smollm2
    chosen = {
        "oracle": lambda: ScriptedDrafter(reference, vocab_size=model.config.vocab_size),
        "always_wrong": lambda: ScriptedDrafter(reference, wrong=True, vocab_size=model.config.vocab_size),
        "prompt_lookup": PromptLookupDrafter,
    }[drafter]()
    out = speculative_generate(model, ids, chosen, gamma=gamma, max_new_tokens=NUM_TOKENS, eos_token_id=[])
    assert out.tokens.tolist() == reference[:NUM_TOKENS]
    # NOTE: an explicit attention mask: with eos_token_id=None, generate() would infer one from
    # pad_token_id (2 = <|im_end|> in SmolLM2) and mask the prompt's own <|im_end|> tokens.
    with torch.no_grad():
        hf = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
    assert hf[0, ids.shape[1] :].tolist() == reference[:NUM_TOKENS]
