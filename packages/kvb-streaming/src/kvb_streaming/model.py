"""``StreamingCausalLM.from_pretrained``: an AWQ checkpoint as a plain Hugging Face causal LM."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import GENERATION_CONFIG_NAME

from kvb_streaming.builder import build_model
from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import NotAStreamingModelError, SaveUnsupportedError, StreamingConfigError
from kvb_streaming.loader import AWQLoader
from kvb_streaming.residency import ResidencyPlan
from kvb_streaming.scheduler import StreamingScheduler, StreamingStats

logger = logging.getLogger(__name__)

_RUNTIME_ATTR = "kvb_streaming"
# Devices whose memory is host memory (CPU) or shares it (Apple unified memory): streaming cannot help.
_HOST_MEMORY_DEVICES = ("cpu", "mps")


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamingRuntime:
    """The streaming state attached to a model loaded by :class:`StreamingCausalLM`.

    Attributes:
        requested: the configuration asked for.
        effective: the configuration in force (``full_resident`` when streaming was disabled on the device).
        streaming_enabled: whether any layer is streamed.
        device: compute device.
        plan: streamed linears per decoder layer.
        scheduler: the staging-slot scheduler (stats, slot state).
        kernel_name: the int4 GEMM backend in use.
        resident_int4_bytes: device bytes of resident int4 payloads.
        pinned: whether every streamed layer's host buffer is pinned.
        transient_bytes: the most bytes one quantized linear's kernel materializes at once beyond its input,
            output and payload (the ``"torch"`` kernel's dequantized block and its int32 temporaries, at most
            ``dequant_chunk_bytes``; 0 for kernels that read int4 directly). A forward's peak is higher by
            this much than the same model's in full precision, besides the staging slots; kvb-planner
            charges it as ``ModelShape.weight_transient_bytes`` (``kvboost serve`` sets it).
    """

    requested: StreamingConfig
    effective: StreamingConfig
    streaming_enabled: bool
    device: torch.device
    plan: ResidencyPlan
    scheduler: StreamingScheduler
    kernel_name: str
    resident_int4_bytes: int
    pinned: bool
    transient_bytes: int = 0

    def stats(self) -> StreamingStats:
        return self.scheduler.stats()


class StreamingCausalLM:
    """Factory, like ``transformers.AutoModelForCausalLM``: returns the architecture's own model class.

    The result is a regular ``PreTrainedModel`` (``model(input_ids=...)``, ``generate``, ``DynamicCache`` all
    work unchanged) whose decoder-layer linears are ``StreamingQLinear``; forward hooks on the decoder layers
    stage streamed weights. Its streaming state is ``get_runtime(model)``.
    """

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        streaming_config: StreamingConfig | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> PreTrainedModel:
        """Loads an AWQ GEMM checkpoint folder.

        Args:
            path: local checkpoint folder (``config.json`` with an AWQ ``quantization_config`` +
                ``*.safetensors``).
            streaming_config: what to stream; default :class:`StreamingConfig()` (stream every layer
                through 2 slots). On CPU/MPS streaming is disabled (logged) unless ``simulate_on_host``.
            device: compute device; default ``cuda`` when available, else ``cpu``.
            dtype: activation / non-quantized weight dtype (a ``torch.dtype`` or its name, ``"bfloat16"``);
                default fp16 on CUDA, fp32 elsewhere.

        Raises:
            StreamingConfigError: a bad ``streaming_config``, ``device`` (or CUDA asked for where there is none)
                or ``dtype``, or a configuration that does not fit the model.
            AWQFormatError: ``path`` is not an AWQ GEMM checkpoint folder.
            KernelUnavailableError: the requested ``quant_kernel`` cannot run here.
        """
        if streaming_config is not None and not isinstance(streaming_config, StreamingConfig):
            raise StreamingConfigError(
                f"streaming_config must be a StreamingConfig, got {type(streaming_config).__name__}; "
                "build one with StreamingConfig(residency_mode=..., ...)"
            )
        requested = streaming_config or StreamingConfig()
        target = _resolve_device(device) if device is not None else _default_device()
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        dtype = _resolve_dtype(dtype) or (torch.float16 if target.type == "cuda" else torch.float32)
        effective = requested
        if target.type in _HOST_MEMORY_DEVICES and not requested.simulate_on_host:
            if requested.residency_mode != "full_resident":
                logger.info(
                    "streaming disabled on %s: its memory is host memory, so every layer is loaded resident "
                    "(set simulate_on_host=True to run the streaming machinery anyway)",
                    target.type,
                )
            effective = dataclasses.replace(
                requested, residency_mode="full_resident", keep_first_k=0, keep_last_k=0
            )
        loader = AWQLoader(path, pin_memory=effective.pin_memory and target.type == "cuda")
        built = build_model(loader, effective, device=target, dtype=dtype, requested=requested)
        runtime = StreamingRuntime(
            requested=requested,
            effective=effective,
            streaming_enabled=bool(built.plan.streamed),
            device=target,
            plan=built.plan,
            scheduler=built.scheduler,
            kernel_name=built.kernel.name,
            resident_int4_bytes=built.resident_bytes,
            transient_bytes=built.transient_bytes,
            pinned=loader.allocator.pin_failures == 0 and loader.allocator.pin_requested,
        )
        setattr(built.model, _RUNTIME_ATTR, runtime)
        # transformers would write the int4 payloads under names no architecture reads, and the model would
        # load back (AutoModelForCausalLM: warnings only) with random linears.
        built.model.save_pretrained = functools.partial(_refuse_save, loader.path)
        # push_to_hub created the Hub repository (transformers' create_repo) before it reached
        # save_pretrained: refused before anything is sent.
        built.model.push_to_hub = functools.partial(_refuse_save, loader.path)
        # Like AutoModelForCausalLM: the checkpoint's generation defaults (extra EOS ids such as Llama 3's
        # <|eot_id|>, sampling settings) override those derived from config.json.
        if (loader.path / GENERATION_CONFIG_NAME).is_file():
            try:
                built.model.generation_config = GenerationConfig.from_pretrained(loader.path)
            except OSError as exc:  # unreadable / invalid JSON: transformers also keeps the derived config
                logger.warning("ignoring %s: %s", GENERATION_CONFIG_NAME, exc)
        return built.model


def _refuse_save(source: Path, *args: object, **kwargs: object) -> None:
    raise SaveUnsupportedError(
        "a model loaded by StreamingCausalLM.from_pretrained cannot be saved with save_pretrained (its int4 "
        f"linears would load back as random weights); the AWQ checkpoint it was loaded from, {source}, is "
        "already what to copy or upload (huggingface_hub.upload_folder), or pack a full-precision model with "
        "kvb_streaming.packer.save_awq_checkpoint"
    )


def get_runtime(model: torch.nn.Module) -> StreamingRuntime:
    """The :class:`StreamingRuntime` of a model loaded by :meth:`StreamingCausalLM.from_pretrained`."""
    runtime = getattr(model, _RUNTIME_ATTR, None)
    if not isinstance(runtime, StreamingRuntime):
        raise NotAStreamingModelError(
            f"{type(model).__name__} was not loaded by kvb_streaming.StreamingCausalLM.from_pretrained"
        )
    return runtime


def _resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` that exists in this process."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise StreamingConfigError(
            f"device={device!r} is not a torch device; pass e.g. 'cuda', 'cuda:1' or 'cpu'"
        ) from exc
    if target.type == "meta":
        raise StreamingConfigError(
            "device='meta' holds no data; pass a compute device such as 'cuda' or 'cpu'"
        )
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise StreamingConfigError(f"device={device!r} but MPS is not available here; pass device='cpu'")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise StreamingConfigError(f"device={device!r} but CUDA is not available here; pass device='cpu'")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise StreamingConfigError(
                f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return target


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating ``torch.dtype`` from a dtype or its name (``"float16"``, ``"torch.bfloat16"``); None stays None."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise StreamingConfigError(
            f"dtype={dtype!r} is not a floating-point torch dtype; pass torch.float16, torch.bfloat16 or "
            "torch.float32 (or None for the device's default)"
        )
    return resolved


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
