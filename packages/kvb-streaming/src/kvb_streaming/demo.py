"""Command-line demo: load an AWQ checkpoint with streaming and report load time, memory, TTFT and tok/s.

Example::

    python -m kvb_streaming.demo --model ./qwen2.5-32b-awq --residency-mode partial_resident \\
        --keep-first-k 8 --prompt "Explain PCIe in one paragraph."
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from kvb_streaming.config import QUANT_KERNELS, RESIDENCY_MODES, StreamingConfig
from kvb_streaming.errors import AWQFormatError, StreamingError
from kvb_streaming.model import StreamingCausalLM, get_runtime
from kvb_streaming.scheduler import StreamingStats

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class TokenClock(BaseStreamer):
    """``generate`` streamer that timestamps every new token (the first ``put`` is the prompt)."""

    times: list[float] = field(default_factory=list)
    _saw_prompt: bool = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoReport:
    """What the demo measured.

    Attributes:
        load_s: model load time.
        peak_memory_bytes: peak device memory (CUDA) or peak host RSS (CPU/MPS).
        peak_memory_kind: ``"device"`` or ``"host RSS"``.
        ttft_s: time from ``generate`` call to the first new token.
        decode_tok_s: steady-state decode rate (tokens after the first), None with fewer than 2 tokens.
        new_tokens: generated token count.
        text: decoded completion.
        stats: the scheduler's counters after generation.
        streaming_enabled: whether any layer was streamed.
        kernel: the int4 GEMM backend used.
    """

    load_s: float
    peak_memory_bytes: int
    peak_memory_kind: str
    ttft_s: float
    decode_tok_s: float | None
    new_tokens: int
    text: str
    stats: StreamingStats
    streaming_enabled: bool
    kernel: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Generate with an AWQ int4 model whose layers stream from host RAM; print timings.",
    )
    parser.add_argument("--model", required=True, help="local AWQ GEMM checkpoint folder")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    parser.add_argument("--prompt", required=True, help="prompt text (used as is, no chat template)")
    parser.add_argument(
        "--max-new-tokens", type=_positive_int, default=32, help="tokens to generate (greedy)"
    )
    parser.add_argument(
        "--residency-mode",
        choices=RESIDENCY_MODES,
        default=None,
        help="what stays on the device (default: partial_resident when --keep-* is given, else full_stream)",
    )
    parser.add_argument(
        "--keep-first-k", type=_non_negative_int, default=0, help="leading decoder layers kept resident"
    )
    parser.add_argument(
        "--keep-last-k", type=_non_negative_int, default=0, help="trailing decoder layers kept resident"
    )
    parser.add_argument(
        "--n-staging-slots", type=_positive_int, default=2, help="device staging slots for streamed layers"
    )
    parser.add_argument("--quant-kernel", choices=QUANT_KERNELS, default="auto", help="int4 GEMM backend")
    parser.add_argument(
        "--device", default=None, help="compute device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="activation dtype")
    parser.add_argument("--no-pin", action="store_true", help="do not pin streamed layers in host memory")
    parser.add_argument(
        "--simulate-on-host",
        action="store_true",
        help="run the streaming machinery on CPU/MPS too (no speed-up there; for debugging)",
    )
    return parser


def run(args: argparse.Namespace) -> DemoReport:
    mode = args.residency_mode or (
        "partial_resident" if args.keep_first_k or args.keep_last_k else "full_stream"
    )
    config = StreamingConfig(
        residency_mode=mode,
        keep_first_k=args.keep_first_k,
        keep_last_k=args.keep_last_k,
        n_staging_slots=args.n_staging_slots,
        quant_kernel=args.quant_kernel,
        pin_memory=not args.no_pin,
        simulate_on_host=args.simulate_on_host,
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError) as exc:
        raise AWQFormatError(
            f"no tokenizer could be loaded from {args.tokenizer or args.model} ({str(exc).strip()[:200]}); "
            "pass --tokenizer FOLDER (kvb_streaming.packer saves weights and config only)"
        ) from exc
    cuda = torch.cuda.is_available() and (args.device is None or str(args.device).startswith("cuda"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = StreamingCausalLM.from_pretrained(
        args.model, streaming_config=config, device=args.device, dtype=_DTYPES.get(args.dtype)
    )
    load_s = time.perf_counter() - start
    runtime = get_runtime(model)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(runtime.device)
    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    new_ids = output[0, input_ids.shape[1] :]
    times = clock.times
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return DemoReport(
        load_s=load_s,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes(),
        peak_memory_kind="device" if cuda else "host RSS",
        ttft_s=times[0] - start if times else float("nan"),
        decode_tok_s=decode,
        new_tokens=len(new_ids),
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        stats=runtime.stats(),
        streaming_enabled=runtime.streaming_enabled,
        kernel=runtime.kernel_name,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except StreamingError as exc:  # a bad option or checkpoint: usage error, not a traceback
        parser.error(str(exc))
    decode = f"{report.decode_tok_s:.2f} tok/s" if report.decode_tok_s is not None else "n/a (< 2 tokens)"
    print(f"load time        : {report.load_s:.2f} s")
    print(f"peak memory      : {report.peak_memory_bytes / 2**30:.2f} GiB ({report.peak_memory_kind})")
    print(f"TTFT             : {report.ttft_s * 1000:.1f} ms")
    print(f"steady decode    : {decode} over {report.new_tokens} new tokens")
    stats = report.stats
    hit_rate = f"{stats.hit_rate:.3f}" if stats.hit_rate is not None else "n/a"
    print(f"streaming        : {'on' if report.streaming_enabled else 'off'} (kernel {report.kernel})")
    print(
        f"scheduler        : {stats.forwards} forwards, hits {stats.hits}, misses {stats.misses}, "
        f"hit rate {hit_rate}, {stats.bytes_moved / 2**30:.3f} GiB moved"
    )
    print(f"completion       : {report.text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
