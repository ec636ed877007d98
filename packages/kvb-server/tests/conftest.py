"""Fixtures: a tiny random Llama behind the real KVBoost engine, a fake engine, and live uvicorn servers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvb_cache import EngineConfig, KVBoost
from kvb_server import ServerConfig, create_app

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A cache keeps what was computed for reuse.",
    "You are a helpful assistant. Answer briefly and precisely, one sentence at a time.",
    "Paris is the capital of France; Berlin is the capital of Germany; Rome is in Italy.",
] * 20
TINY_CHUNK = 16


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes) trained in milliseconds on a fixed corpus: no hub access."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, *, context: int = 512) -> LlamaForCausalLM:
    """A 2-layer random Llama (seed 0) over ``tokenizer``'s vocabulary; ``context``: its
    max_position_embeddings."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def build_tiny_engine(
    *, context: int = 512, tokenizer: PreTrainedTokenizerFast | None = None, **engine_config: Any
) -> KVBoost:
    """The tiny Llama behind KVBoost (``context``: its max_position_embeddings; ``tokenizer``: another than
    :func:`build_tokenizer`'s); ``engine_config`` adds :class:`EngineConfig` fields (e.g. ``tiers``)."""
    tokenizer = tokenizer or build_tokenizer()
    model = build_tiny_model(tokenizer, context=context)
    return KVBoost(
        model, tokenizer, config=EngineConfig(chunk_size=TINY_CHUNK, **engine_config), model_name="tiny-llama"
    )


@pytest.fixture(scope="session")
def tiny_engine() -> KVBoost:
    return build_tiny_engine()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def tiny_url(tiny_engine: KVBoost) -> Iterator[str]:
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=48)
    with serve(create_app(tiny_engine, config)) as url:
        yield url
