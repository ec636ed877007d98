"""kvb-cache's engine loop attending through kvb-kernels' block-table kernel (``attention_backend="kvb_kernels"``).

On CUDA this is the default (``auto``) and is checked by tools/gpu_checks.py; here the kernel runs under
Triton's CPU interpreter (fp32), in a subprocess because ``TRITON_INTERPRET`` is read when Triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="kvb-kernels' Triton extra is not installed")

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers
    from kvb_cache import EngineConfig, KVBoost, SamplingParams
    import kvb_kernels.paged as paged

    # Each read of kv_lens back to the host (on CUDA a sync in every layer of every step) is counted.
    read_backs, summary = [], paged._table_summary
    paged._table_summary = lambda *args: (read_backs.append(1), summary(*args))[1]

    vocab = {f"w{i}": i for i in range(200)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1")
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=200, max_position_embeddings=512, initializer_range=0.2)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 200, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, 200, (n,), generator=gen).tolist() for n in (9, 30)]
    prompts += [torch.randint(2, 200, (50,), generator=gen).tolist(), shared]
    result = {}
    for name, config in (("llama", T.LlamaConfig(**common)), ("mistral", T.MistralConfig(**common, sliding_window=24))):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config).eval()
        runs = {}
        for backend_name in ("sdpa", "kvb_kernels"):
            engine = KVBoost(model, tok, config=EngineConfig(
                block_size=8, max_num_batched_tokens=64, max_num_seqs=4, attention_backend=backend_name))
            logits, forward = [], engine.core.runner.forward
            def recording(seqs, forward=forward, logits=logits):
                out = forward(seqs)
                logits.append(out.clone())
                return out
            engine.core.runner.forward = recording
            params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            engine.add_request(prompts[0], params)
            engine.step()
            for p in prompts[1:]:
                engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
            runs[backend_name] = (logits, engine.core.runner.kernel is not None)
        (ref, _), (got, used) = runs["sdpa"], runs["kvb_kernels"]
        result[name] = {
            "steps": [len(ref), len(got)],
            "kernel": used,
            "max_abs_err": max(((a - b).abs().max().item() for a, b in zip(ref, got) if a.numel()), default=0.0),
            "read_backs": len(read_backs),
        }
    print(json.dumps(result))
    """
)


def test_the_loop_through_kvb_kernels_gives_the_sdpa_logits() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, row in result.items():
        assert row["kernel"], name
        # The runner passes the lengths' maximum from the host: the kernel never reads kv_lens back.
        assert row["read_backs"] == 0, (name, row)
        assert row["steps"][0] == row["steps"][1] >= 8, (name, row)
        # Interpreted fp32 (IEEE dot products) against torch SDPA: summation order only (8.6e-6 measured).
        assert row["max_abs_err"] < 5e-5, (name, row)
