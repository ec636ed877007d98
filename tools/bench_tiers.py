"""Cache tiers and KV codecs on the embedded SmolLM2-135M (CPU, one thread).

1. Restore vs recompute: next-token latency of a 512- and 2048-token prompt, cold (full prefill) vs its
   KV restored from RAM, disk and Redis on loopback (a redis-server started here on a free port).
2. Codec fidelity: SNR (dB) of every codec on the model's real KV of a 2048-token prompt, bytes against
   fp16, and first-token top-1 agreement of cached quantized prefixes against uncompressed no-cache
   logits on fidelity prompts (pydoc topics + chitchat conversations), plus greedy 16-token agreement.

Writes docs/tiers.json and docs/tiers.png; prints tables. Timings are medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.codecs import AbsmaxInt8Codec, EncodedKV, KiviCodec, bytes_ratio, chunk_snr_db
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fingerprint import model_fingerprint
from kvb_cache.hashing import root_hash
from kvb_cache.kv import slice_kv
from kvb_cache.store import ChunkStore
from kvb_cache.tiers import BackgroundWriter, TieredStore
from kvb_cache.tiers.bench import bench_restore, format_table
from kvb_cache.tiers.text import benchmark_token_ids

DOCS = Path(__file__).resolve().parent.parent / "docs"


def start_redis() -> tuple[subprocess.Popen | None, str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found: skipping the Redis tier")
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def fidelity_prompts(tokenizer, n: int) -> list[list[int]]:
    """Real prompts of 150-400 tokens: pydoc topics and chitchat conversations (when installed)."""
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics) if len(topics[k]) > 2000]
    try:
        import chitchat_dataset as ccc

        convos = ccc.Dataset()
        for i, (_, convo) in enumerate(convos.items()):
            if i >= n:
                break
            texts.append("\n".join(m["text"] for turn in convo["messages"] for m in turn))
    except Exception as exc:  # the dataset is optional for this tool
        print(f"chitchat-dataset unavailable ({exc}); pydoc topics only")
    prompts = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 150:
            prompts.append(ids[: 150 + (i * 37) % 250])
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def codec_snr(model, ids: list[int]) -> list[dict]:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    rows = []
    for codec in (
        KiviCodec(bits=8, group_size=32),
        KiviCodec(bits=4, group_size=32),
        KiviCodec(bits=8, group_size=128),
        KiviCodec(bits=4, group_size=128),
        AbsmaxInt8Codec(),
    ):
        snrs, ratios = [], []
        for start in range(0, len(ids) - 127, 128):
            kv = slice_kv(output_cache(out), start, start + 128)
            enc = EncodedKV.from_dense(codec, kv)
            snrs.append(chunk_snr_db(kv, enc))
            ratios.append(bytes_ratio(kv, enc, element_size=2))
        rows.append(
            {
                "codec": codec.name,
                "snr_db_mean": sum(snrs) / len(snrs),
                "snr_db_min": min(snrs),
                "bytes_vs_fp16": sum(ratios) / len(ratios),
            }
        )
    return rows


def agreement(model, tokenizer, prompts, *, bits: int, remote_codec: bool, greedy_prompts: int) -> dict:
    """Cached prefix (all but the last token) through the codec vs uncompressed no-cache logits."""
    config = EngineConfig(kv_cache_bits=bits)
    store = None
    if remote_codec:
        # What a Redis round trip through the wire codec returns: RAM entries held as absmax8.
        root = root_hash(model_fingerprint(model, config))
        store = TieredStore(
            ChunkStore(config.max_cache_bytes),
            root=root,
            codec=AbsmaxInt8Codec(),
            lower=[],
            writer=BackgroundWriter(1),
        )
    engine = KVBoost(model, tokenizer, config=config, store=store)
    top1, worst, tokens_same, tokens_all = 0, 0.0, 0, 0
    for i, ids in enumerate(prompts):
        engine.warm(ids[:-1])
        got = engine.next_token_logits(ids)
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, -1]
        top1 += int(got.logits.argmax() == ref.argmax())
        worst = max(worst, (got.logits - ref).abs().max().item())
        if i < greedy_prompts:
            cached = engine.generate(ids, max_new_tokens=16, ignore_eos=True).output_ids
            plain = (
                KVBoost(model, tokenizer, config=EngineConfig(max_cache_bytes=0))
                .generate(ids, max_new_tokens=16, ignore_eos=True)
                .output_ids
            )
            tokens_same += sum(a == b for a, b in zip(cached, plain))
            tokens_all += len(plain)
    return {
        "top1_agreement": top1 / len(prompts),
        "max_abs_logit_diff": worst,
        "greedy16_token_agreement": tokens_same / max(tokens_all, 1),
        "prompts": len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=60, help="fidelity prompts for top-1 agreement")
    parser.add_argument("--greedy-prompts", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = benchmark_token_ids(tokenizer, max(args.lengths) + 1)
    proc, url = start_redis()
    try:
        restore = bench_restore(
            model, tokenizer, ids, lengths=args.lengths, remote_url=url, repeats=args.repeats
        )
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    print(format_table(restore))
    snr = codec_snr(model, ids[:2048])
    for row in snr:
        print(
            f"{row['codec']:>11}  SNR mean {row['snr_db_mean']:.1f} dB (min {row['snr_db_min']:.1f})  bytes/fp16 {row['bytes_vs_fp16']:.3f}"
        )
    prompts = fidelity_prompts(tokenizer, args.prompts)
    fidelity = {}
    for name, bits, wire in (("kivi8-g32", 8, False), ("kivi4-g32", 4, False), ("absmax8 (wire)", 16, True)):
        fidelity[name] = agreement(
            model, tokenizer, prompts, bits=bits, remote_codec=wire, greedy_prompts=args.greedy_prompts
        )
        print(f"{name:>15}: {fidelity[name]}")
    result = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread (shared CPU)",
        "model": "SmolLM2-135M-Instruct fp32",
        "restore": [
            {
                "tokens": r.tokens,
                "source": r.source,
                "median_ms": r.median_ms,
                "cached_tokens": r.cached_tokens,
                "speedup": r.speedup,
            }
            for r in restore
        ],
        "codec_snr": snr,
        "fidelity": fidelity,
    }
    DOCS.mkdir(exist_ok=True)
    (DOCS / "tiers.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        sources = [s for s in ("cold", "ram", "disk", "redis") if any(r.source == s for r in restore)]
        width = 0.8 / len(sources)
        for j, source in enumerate(sources):
            vals = [
                next(r.median_ms for r in restore if r.tokens == n and r.source == source)
                for n in args.lengths
            ]
            ax.bar([i + j * width for i in range(len(args.lengths))], vals, width, label=source)
        ax.set_xticks(
            [i + width * (len(sources) - 1) / 2 for i in range(len(args.lengths))],
            [str(n) for n in args.lengths],
        )
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms to next-token logits (median)")
        ax.set_yscale("log")
        ax.set_title("SmolLM2-135M, CPU 1 thread: recompute vs restore")
        ax.legend()
        fig.tight_layout()
        fig.savefig(DOCS / "tiers.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
