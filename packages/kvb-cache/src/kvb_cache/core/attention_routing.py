"""Whether a model's attention can be served by ``kvb_paged``: the one-token routing probe.

:func:`check_attention_routing` runs a one-token forward of the installed model while a probe is current;
:func:`~kvb_cache.core.paged_attention.paged_attention_forward` reports each layer's call to it
(:func:`record_layer`). Every decoder layer must go through that function, see keys/values of the shape its
cache holds and get the mask the model's mask function made. Models that route attention elsewhere (GPT-J,
Falcon, Bloom: no ``AttentionInterface``), cache something else than per-head keys and values (DeepSeek's
multi-head latent attention caches the compressed latent), build their own mask inside the attention
module (Doge's dynamic mask) or call attention more than once per layer (DiffLlama's differential attention)
are declined with :class:`~kvb_cache.errors.UnsupportedModelError`. A layer that shares an earlier layer's
keys/values (Gemma 3n, Gemma 4 E2B) must be passed exactly that layer's: the paged attention reads them from
the producer's slots instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch
from transformers import PreTrainedModel

from kvb_cache.core.kv_storage import LayerShape
from kvb_cache.errors import UnsupportedModelError

#: Per layer, the ``(keys, values, biased mask)`` of each attention call during :func:`check_attention_routing`.
_PROBE: ContextVar[dict[int, list[tuple[torch.Tensor, torch.Tensor, bool]]] | None] = ContextVar(
    "kvb_probe", default=None
)


def _biased(mask: torch.Tensor | None) -> bool:
    """Whether a one-token probe's mask does more than let the token see itself (bool True / float 0)."""
    if not isinstance(mask, torch.Tensor):
        return False
    return bool((~mask).any()) if mask.dtype == torch.bool else bool((mask != 0).any())


def record_layer(
    module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
) -> None:
    """Note what a layer's attention call saw, when :func:`check_attention_routing` is probing (else nothing)."""
    probe = _PROBE.get()
    if probe is not None:
        call = (key.detach().clone(), value.detach().clone(), _biased(attention_mask))
        probe.setdefault(getattr(module, "layer_idx", -1), []).append(call)


def check_attention_routing(
    model: PreTrainedModel, shapes: Sequence[LayerShape], sources: Sequence[int] | None = None
) -> None:
    """Raise :class:`UnsupportedModelError` unless a one-token forward of the (installed) model calls the
    ``kvb_paged`` attention once per layer with keys/values shaped as the layer's cache (``shapes``, one per
    layer with KV of its own). ``sources``: per decoder layer, the layer whose keys/values it attends
    (:func:`kvb_cache.kv_sharing.kv_sources`; default: each its own); a shared layer must be passed its
    producer's very keys/values.

    A layer that never calls it computes attention some other way (the paged pool would never be written:
    every output wrong); keys that differ from the cached ones mean the cache holds something else (a
    compressed latent), which the pool's per-head layout cannot serve.
    """
    name = type(model).__name__
    sources = tuple(range(len(shapes))) if sources is None else tuple(sources)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
    token = _PROBE.set(seen)
    try:
        # Not the padding token: its embedding is often zero, and every layer's keys would then be equal,
        # which would let a shared layer passed another layer's keys through.
        pad = model.config.get_text_config(decoder=True).pad_token_id
        ids = torch.full((1, 1), 2 if pad == 1 else 1, dtype=torch.long, device=model.device)
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
    finally:
        _PROBE.reset(token)
    missing = [i for i in range(len(sources)) if i not in seen]
    if missing:
        raise UnsupportedModelError(
            f"{name} does not compute attention through transformers' AttentionInterface (layers {missing[:4]}"
            f"{'...' if len(missing) > 4 else ''} never called it), so KVBoost's paged attention cannot serve "
            "it; supported are models whose attention honours `attn_implementation` (Llama, Qwen, Mistral, "
            "Gemma, Phi, GPT-2, GPT-NeoX, OLMo, gpt-oss, ...)"
        )
    for i, source in enumerate(sources):
        if len(seen[i]) > 1:
            # Each call writes its keys/values into the layer's one pool slot per token, so the second call
            # overwrites the first's, and the first reads the second's back for every cached token.
            raise UnsupportedModelError(
                f"{name} calls attention {len(seen[i])} times in one forward of layer {i} (DiffLlama's "
                "differential attention attends once per half of the values, looped layers such as Dory's once "
                "per loop), each with other keys/values; KVBoost's pool holds one key/value pair per layer and "
                "token and cannot serve it"
            )
        key, value, biased = seen[i][0]
        if biased:
            raise UnsupportedModelError(
                f"{name} builds its own attention mask inside the attention module (layer {i}: a one-token "
                "forward's mask already masks or biases the token's own key, e.g. Doge's dynamic mask computed "
                "from the values of every cached token); KVBoost's paged attention builds the causal / "
                "sliding-window mask from positions and cannot reproduce it"
            )
        if source != i:
            producer_key, producer_value, _ = seen[source][0]
            if not (torch.equal(key, producer_key) and torch.equal(value, producer_value)):
                raise UnsupportedModelError(
                    f"{name} declares layer {i} to share layer {source}'s keys/values (num_kv_shared_layers) "
                    "but its attention is passed other ones (this transformers version computes them "
                    "differently); KVBoost reads a shared layer's keys/values from its producer's pool slots and "
                    "cannot serve it: upgrade transformers"
                )
            continue
        shape = shapes[i]
        got = (key.shape[1], key.shape[-1], value.shape[-1])
        if got != (shape.kv_heads, shape.key_dim, shape.value_dim):
            raise UnsupportedModelError(
                f"{name} caches something other than the keys/values its attention uses (layer {i}: cache "
                f"{shape.kv_heads} heads x {shape.key_dim}/{shape.value_dim} channels, attention "
                f"{got[0]} heads x {got[1]}/{got[2]}), e.g. the compressed latent of multi-head latent "
                "attention; KVBoost's pool stores per-head keys and values and cannot serve it"
            )


#: A causal model's first position does not see the token after it: its logits move by float noise at most
#: (none, as a rule: same shapes, same kernels); a bidirectional one's move by a good part of their scale.
#: Relative to the largest logit: the 82 causal tiny models of tools/arch_matrix.py move by 5.4e-7 at most,
#: while a BERT masked-LM checkpoint at its default initialisation (std 0.02, logits up to 0.44) moves by
#: 1.4e-2. NOTE: 1e-2 of max(|logits|, 1) let that BERT through: served as a causal LM, it answered noise.
CAUSAL_TOLERANCE = 1e-3


def check_causal_positions(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedModelError` unless the model is causal and takes its positions from
    ``position_ids``, as the engine's packed forwards need (they pass no cache, so a model counting positions
    from its cache length would restart every request's positions at 0).

    Three two-token forwards without a cache: ``[a, b]`` and ``[a, c]`` at positions ``[0, 1]`` (the first
    token's logits must not depend on the second: a bidirectional encoder's do), and ``[a, b]`` at ``[0, 2]``
    (the last token's logits must move with its position: BART-family decoders' do not, they count
    positions from the cache). A model with fewer than 3 positions is not probed for the second.
    """
    name = type(model).__name__
    config = model.config.get_text_config(decoder=True)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 4:
        return
    pad = getattr(config, "pad_token_id", None)
    a, b, c = [t for t in (1, 2, 3, 4) if t != pad][:3]
    device = model.device

    def logits(ids: list[int], positions: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
            )
        return out.logits[0].float()

    first = logits([a, b], [0, 1])
    other = logits([a, c], [0, 1])
    scale = float(first[0].abs().max().clamp(min=1e-6))
    if float((first[0] - other[0]).abs().max()) > CAUSAL_TOLERANCE * scale:
        raise UnsupportedModelError(
            f"{name} attends bidirectionally (a token's output depends on the tokens after it: an encoder "
            "such as BERT without is_decoder=True, or a config with use_bidirectional_attention); KVBoost "
            "serves causal LMs, whose cached prefix does not change as the prompt goes on"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and limit < 3:
        return
    if torch.equal(first[1], logits([a, b], [0, 2])[1]):
        raise UnsupportedModelError(
            f"{name} ignores the position_ids it is passed (it counts positions from its cache, as BART-family "
            "decoders do); KVBoost's packed forwards pass positions explicitly and no cache, so every request's "
            "positions would restart at 0"
        )
