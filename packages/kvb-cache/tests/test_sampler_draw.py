"""The sampler's draw: ``torch.multinomial``'s token from the same generator, without its host reads."""

from __future__ import annotations

import pytest
import torch

from kvb_cache.core.sampler import _draw


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_a_draw_is_multinomials_token_and_advances_the_generator_alike(vocab: int) -> None:
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        scores = torch.randn(vocab, generator=gen) * (0.2 + seed % 5)
        if seed % 3 == 0:  # banned / filtered tokens, as top-k, top-p and bans leave them
            scores[torch.randint(0, vocab, (vocab // 2,), generator=gen)] = -float("inf")
        a, b = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)
        expected = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=a))
        token, valid = _draw(scores, b).tolist()
        assert (token, valid) == (expected, 1)
        assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


def test_invalid_probabilities_are_flagged_not_drawn() -> None:
    for scores in (torch.tensor([0.0, float("nan"), 1.0]), torch.full((4,), -float("inf"))):
        assert _draw(scores, torch.Generator().manual_seed(0)).tolist()[1] == 0


def test_sampled_rows_of_a_batch_are_read_at_once(monkeypatch) -> None:
    """A step samples 4 seeded rows with two host reads (argmax/NaN flags, then every drawn token), not one
    more per row: on CUDA each read waits for the GPU (multinomial made three per row)."""
    from conftest import make_model, make_tokenizer

    from kvb_cache import EngineConfig, KVBoost, SamplingParams
    from kvb_cache.core import engine_core

    engine = KVBoost(make_model("llama"), make_tokenizer(), config=EngineConfig(chunk_size=16))
    for i in range(4):
        engine.add_request(list(range(3, 20 + i)), SamplingParams(max_new_tokens=3, temperature=1.0, seed=i))
    reads: list[int] = []
    counting = [False]
    for name in ("tolist", "item", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, **kwargs):
            if counting[0]:
                reads[-1] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    sample = engine_core.sample

    def counted(logits, requests):
        reads.append(0)
        counting[0] = True
        try:
            return sample(logits, requests)
        finally:
            counting[0] = False

    monkeypatch.setattr(engine_core, "sample", counted)
    while engine.has_unfinished():
        engine.step()
    assert reads and max(reads) <= 2, reads
