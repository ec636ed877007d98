"""Build a Hugging Face causal LM from an AWQ checkpoint with int4 linears, resident or streamed."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kvb_streaming.binding import LayerBinding
from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import AWQFormatError
from kvb_streaming.kernels import KernelContext, LinearShape, QuantKernel, resolve_kernel
from kvb_streaming.loader import AWQ_SUFFIXES, AWQLoader
from kvb_streaming.qlinear import StreamingQLinear
from kvb_streaming.residency import (
    LayerIndex,
    ResidencyPlan,
    check_kept_layers,
    decoder_layers,
    plan_residency,
)
from kvb_streaming.scheduler import StreamingScheduler
from kvb_streaming.staging import make_transfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltModel:
    """What :func:`build_model` returns.

    Attributes:
        model: the Hugging Face model, with ``StreamingQLinear`` in its decoder layers and hooks installed.
        scheduler: drives the staging slots (has no streamed layer when everything is resident).
        plan: which linears are streamed.
        kernel: the int4 GEMM backend in use.
        resident_bytes: device bytes of resident int4 payloads (staging slots not included).
        transient_bytes: the most weight-side temporaries one quantized linear's kernel call holds
            (``QuantKernel.transient_bytes`` over the model's linear shapes).
    """

    model: PreTrainedModel
    scheduler: StreamingScheduler
    plan: ResidencyPlan
    kernel: QuantKernel
    resident_bytes: int
    transient_bytes: int


def build_model(
    loader: AWQLoader,
    config: StreamingConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    kernel_device: torch.device | None = None,
    requested: StreamingConfig | None = None,
) -> BuiltModel:
    """Loads ``loader``'s checkpoint into a model skeleton built on the meta device.

    Args:
        loader: the indexed AWQ checkpoint.
        config: streaming configuration, already adjusted for the device (see ``StreamingCausalLM``).
        device: where resident tensors and staging slots live.
        dtype: dtype of the non-quantized weights and of activations.
        kernel_device: device the int4 kernel computes on, if not ``device`` (e.g. a model kept on the
            host and dispatched to a GPU later by accelerate).
        requested: the configuration asked for, of which ``config`` may be the adjustment for the device
            (all resident on host memory): its kept layers are checked against the model before any
            weight is read, so options that would fail on a GPU fail everywhere.
    """
    hf_config = AutoConfig.from_pretrained(loader.path, trust_remote_code=False)  # never asks on stdin
    # The skeleton is plain fp: transformers must not try to apply its own AWQ integration.
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    layers = decoder_layers(model)
    if requested is not None:
        check_kept_layers(requested, len(layers))
    layer_prefixes = _module_names(model, layers)

    linears = [_quantized_linears(layer, prefix, loader) for layer, prefix in zip(layers, layer_prefixes)]
    if not any(linears):
        raise AWQFormatError(f"no decoder layer of {loader.path} holds an AWQ-quantized linear")
    shapes = {LinearShape(m.in_features, m.out_features) for per_layer in linears for m in per_layer.values()}
    context = KernelContext(
        device=kernel_device or device,
        dtype=dtype,
        group_size=loader.quant.group_size,
        dequant_chunk_bytes=config.dequant_chunk_bytes,
    )
    kernel = resolve_kernel(config.quant_kernel, context, sorted(shapes))
    plan = plan_residency(config, [list(per_layer) for per_layer in linears])

    bindings: dict[LayerIndex, LayerBinding] = {}
    resident_bytes = 0
    for index, (layer, prefix, per_layer) in enumerate(zip(layers, layer_prefixes, linears)):
        streamed_payload: dict[str, torch.Tensor] = {}
        streamed_modules: dict[str, StreamingQLinear] = {}
        for name, linear in per_layer.items():
            qlinear = StreamingQLinear(
                linear.in_features, linear.out_features, kernel=kernel, bias=linear.bias is not None
            )
            layer.set_submodule(name, qlinear)
            awq = loader.read_awq(f"{prefix}.{name}")
            _check_linear_shape(f"{prefix}.{name}", linear, awq.qweight, loader)
            payload = kernel.prepare(awq)
            if plan.is_streamed(LayerIndex(index), name):
                streamed_payload.update({f"{name}.{p}": t for p, t in payload.items()})
                streamed_modules[name] = qlinear
            else:
                qlinear.bind({p: t.to(device) for p, t in payload.items()})
                resident_bytes += sum(t.numel() * t.element_size() for t in payload.values())
        if streamed_modules:
            bindings[LayerIndex(index)] = LayerBinding(loader.pack_layer(streamed_payload), streamed_modules)

    _load_plain_tensors(model, loader, device=device, dtype=dtype)
    quantized = [
        f"{prefix}.{name}" for prefix, per_layer in zip(layer_prefixes, linears) for name in per_layer
    ]
    unused = _unused_tensors(model, loader, quantized)
    if any(name.endswith(".qweight") for name in unused):
        # A quantized linear the model never reads: config.json describes fewer layers (or other modules)
        # than the weights hold, and the model would run silently without them.
        raise AWQFormatError(
            f"{loader.path} holds quantized linears the model built from its config.json never reads "
            f"({', '.join(n for n in unused if n.endswith('.qweight'))[:200]}): does config.json (e.g. "
            "num_hidden_layers) belong to these weights?"
        )
    if unused:
        logger.warning(
            "%d checkpoint tensors are not used by the model (%s)", len(unused), ", ".join(unused[:5])
        )
    _warn_unquantized_weights(model, layer_prefixes, dtype)
    model.to(device)  # non-persistent buffers (rotary tables) were built on the host
    model.eval()
    scheduler = StreamingScheduler(
        layers=bindings, n_slots=config.n_staging_slots, transfer=make_transfer(device)
    )
    _install_hooks(model, layers, scheduler)
    # kvb_cache.fingerprint.EXTRA_WEIGHTS_ATTR: the streamed layers' weights live in host buffers, bound to
    # their modules only while they run, so the KV cache's model fingerprint (which names the disk and Redis
    # namespaces) would not see them: two fine-tunes differing only in streamed layers would share records.
    model.kvb_extra_weights = partial(_streamed_weights, bindings)
    return BuiltModel(
        model=model,
        scheduler=scheduler,
        plan=plan,
        kernel=kernel,
        resident_bytes=resident_bytes,
        transient_bytes=max(kernel.transient_bytes(shape) for shape in shapes),
    )


def _streamed_weights(bindings: Mapping[LayerIndex, LayerBinding]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every streamed layer's payloads (views of its packed host buffer), in layer
    order. The views, not the buffer: its alignment padding is uninitialized memory."""
    out = []
    for index in sorted(bindings):
        packed = bindings[index].packed
        out += [
            (f"streamed_layer.{int(index)}.{key}", packed.slices[key].view(packed.buffer))
            for key in packed.slices
        ]
    return out


def _module_names(model: nn.Module, modules: nn.ModuleList) -> list[str]:
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(module)] for module in modules]


def _check_linear_shape(name: str, linear: nn.Linear, qweight: torch.Tensor, loader: AWQLoader) -> None:
    """The checkpoint's linear has the shape the config gives it: an edited or borrowed config.json
    (``num_key_value_heads``, ``intermediate_size``) loaded, then failed in the first forward with a bare
    torch error, or ran with modules describing shapes they did not have."""
    have = (qweight.shape[0], qweight.shape[1] * 8)  # AWQ GEMM: [in, out / 8] int32 words
    want = (linear.in_features, linear.out_features)
    if have != want:
        raise AWQFormatError(
            f"{name}: the checkpoint holds a {have[0]} -> {have[1]} linear, config.json says "
            f"{want[0]} -> {want[1]}; does config.json belong to these weights ({loader.path})?"
        )


def _unused_tensors(model: nn.Module, loader: AWQLoader, quantized: list[str]) -> list[str]:
    """Checkpoint tensors the built model reads nowhere (a config with fewer layers than the weights)."""
    used = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    used |= {f"{prefix}.{suffix}" for prefix in quantized for suffix in AWQ_SUFFIXES}
    return sorted(name for name in loader.index if name not in used)


def _quantized_linears(layer: nn.Module, prefix: str, loader: AWQLoader) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of a decoder layer that the checkpoint stores as AWQ, by relative name."""
    found = {
        name: module
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and loader.is_quantized(f"{prefix}.{name}")
    }
    if not found:
        plain = [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
        if plain and all(f"{prefix}.{name}.weight" in loader for name in plain):
            # A layer the export kept in fp16 (AutoAWQ's modules_to_not_convert naming a whole layer): every
            # linear is a plain weight, loaded resident as the norms are; nothing of it streams.
            logger.info("decoder layer %s is not quantized in the checkpoint: kept resident in fp", prefix)
            return {}
        raise AWQFormatError(
            f"decoder layer {prefix} has no AWQ-quantized linear in {loader.path}{_naming_hint(prefix, loader)}"
        )
    return found


def _naming_hint(prefix: str, loader: AWQLoader) -> str:
    """Why a decoder layer found no quantized linear, when the checkpoint holds some under other names: a
    transformers-4 export (``language_model.model.layers.0``), whose names transformers 5 renames when it
    loads; the streaming loader reads names as they are."""
    quantized = sorted(name.removesuffix(".qweight") for name in loader.index if name.endswith(".qweight"))
    if not quantized:
        return " (it holds no .qweight tensor at all)"
    layer = prefix.rsplit(".", 1)[-1]
    like = next((n for n in quantized if f".{layer}." in n), quantized[0])
    return (
        f"; its quantized linears are named like {like!r}, not under {prefix!r}: the checkpoint uses other "
        "tensor names than the installed transformers builds for this config (an export from an older "
        "transformers?), and kvb_streaming reads names as they are (no renaming)"
    )


def _load_plain_tensors(
    model: PreTrainedModel, loader: AWQLoader, *, device: torch.device, dtype: torch.dtype
) -> None:
    """Fills every still-meta parameter/buffer (embeddings, norms, biases, LM head) from the checkpoint, and
    every persistent buffer the checkpoint holds.

    ``init_empty_weights`` leaves buffers real (the rotary tables must be computed, they are in no
    checkpoint), so a *persistent* buffer (in ``state_dict``: Gemma 4's ``layer_scalar``, a DeepSeek-V3-style
    router's ``e_score_correction_bias``) held its init value and the model ran silently wrong (an audit,
    2026-11-30: Gemma 4's logits off by 3.8x their spread). Such a buffer keeps its own dtype (transformers
    keeps router biases in fp32)."""
    persistent = set(model.state_dict())
    # The int4 payloads are StreamingQLinear buffers under the checkpoint's own names, already bound (read
    # once, converted by the kernel): not read again here.
    payloads = {
        f"{module_name}.{buffer_name}"
        for module_name, module in model.named_modules()
        if isinstance(module, StreamingQLinear)
        for buffer_name, _ in module.named_buffers(recurse=False)
    }
    for name, buffer in model.named_buffers():
        if buffer.is_meta or name in payloads or name not in persistent or name not in loader:
            continue
        value = loader.read(name)
        if value.shape != buffer.shape:
            raise AWQFormatError(
                f"{name}: the checkpoint holds {tuple(value.shape)}, the model built from config.json "
                f"{tuple(buffer.shape)}; does config.json belong to these weights ({loader.path})?"
            )
        with torch.no_grad():
            buffer.copy_(value)  # in place: its dtype kept, and a buffer two modules share stays shared
    missing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_meta:
            continue
        if name not in loader:
            missing.append(name)
            continue
        value = loader.read(name)
        set_module_tensor_to_device(
            model, name, device, value=value, dtype=dtype if value.is_floating_point() else None
        )
    tied: Mapping[str, str] = getattr(model, "_tied_weights_keys", None) or {}
    if missing and getattr(model.config, "tie_word_embeddings", False) and set(missing) <= set(tied):
        model.tie_weights()
        missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise AWQFormatError(
            f"the checkpoint at {loader.path} lacks tensors the model needs: {missing[:5]}"
            + _missing_hint(missing, loader)
        )


def _missing_hint(missing: list[str], loader: AWQLoader) -> str:
    """What the checkpoint holds instead of ``missing``, where that says why (a quantized LM head, experts
    quantized one by one)."""
    for name in missing:
        module = name.removesuffix(".weight")
        if f"{module}.qweight" in loader:
            return (
                f": {module} is int4 in the checkpoint, and only the decoder layers' linears may be (export it "
                "with the LM head and embeddings in fp16)"
            )
    if any(".experts." in name for name in missing) and any(
        ".experts.0." in name or "block_sparse_moe" in name for name in loader.index
    ):
        return (
            ": the checkpoint stores each MoE expert's linears on their own (AutoAWQ's layout, from "
            "transformers 4), while transformers 5 fuses a layer's experts into 3-D parameters, which stay fp16; "
            "per-expert int4 experts are not supported (kvb_streaming.packer.save_awq_checkpoint writes the fused "
            "layout)"
        )
    return ""


def _warn_unquantized_weights(model: nn.Module, layer_prefixes: list[str], dtype: torch.dtype) -> None:
    """Say so when decoder layers hold fused weights (3-D and more: MoE experts as one parameter, as
    transformers 5 keeps Mixtral's, Qwen-MoE's...): they are no ``nn.Linear``, so the checkpoint holds them
    unquantized and they are loaded resident in ``dtype``, neither int4 nor streamed."""
    prefixes = tuple(f"{prefix}." for prefix in layer_prefixes)
    fused = [(name, p) for name, p in model.named_parameters() if p.dim() >= 3 and name.startswith(prefixes)]
    if fused:
        size = sum(p.numel() * p.element_size() for _, p in fused)
        logger.warning(
            "%d fused weight tensors in the decoder layers (%.1f MiB, e.g. %s) are not AWQ linears: they are "
            "loaded resident in %s, neither int4 nor streamed",
            len(fused),
            size / 2**20,
            fused[0][0],
            str(dtype).removeprefix("torch."),
        )


def _install_hooks(model: nn.Module, layers: nn.ModuleList, scheduler: StreamingScheduler) -> None:
    model.register_forward_pre_hook(partial(_begin_forward, scheduler))
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(partial(_before_layer, scheduler, LayerIndex(index)))
        # always_call: a layer that raises must still release its slot.
        layer.register_forward_hook(partial(_after_layer, scheduler, LayerIndex(index)), always_call=True)


def _begin_forward(scheduler: StreamingScheduler, module: nn.Module, args: tuple[object, ...]) -> None:
    scheduler.begin_forward()


def _before_layer(
    scheduler: StreamingScheduler, index: LayerIndex, module: nn.Module, args: tuple[object, ...]
) -> None:
    scheduler.before_layer(index)


def _after_layer(
    scheduler: StreamingScheduler,
    index: LayerIndex,
    module: nn.Module,
    args: tuple[object, ...],
    output: object,
) -> None:
    scheduler.after_layer(index)
