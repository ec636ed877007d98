"""Cache tiers and KV codecs on the embedded SmolLM2-135M (CPU, one thread).

1. Restore vs recompute: next-token latency of a 512- and 2048-token prompt, cold (full prefill) vs its
   KV restored from RAM, disk and Redis on loopback (a redis-server started here on a free port).
2. Codec error: SNR (dB) of every codec on the model's real KV of a 2048-token prompt, in the records the
   engine writes (one per ``block_size``-token block), and the bytes of those records (header included)
   against the block's KV in fp16.
3. Codec fidelity through the tiers: a writer engine stores each prompt's prefix in a disk tier (Redis with
   the ``absmax8`` wire codec); a fresh reader engine (RAM empty) restores it and scores the next tokens
   teacher-forced against a no-cache forward: first-token and teacher-forced top-1 agreement, KL, the
   largest logit difference, and greedy 16-token agreement. (The RAM pool never holds quantized KV, so a
   single engine measures nothing but the exact path.)

Writes docs/tiers.json and docs/tiers.png; prints tables. Timings are medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.codecs import AbsmaxInt8Codec, EncodedKV, KiviCodec, chunk_snr_db
from kvb_cache.embedded import embedded_model_path
from kvb_cache.hashing import content_hash, prefix_hash, root_hash
from kvb_cache.kv import slice_kv
from kvb_cache.records import RecordFormat, encode_record
from kvb_cache.store import ChunkEntry
from kvb_cache.tiers import TierConfig
from kvb_cache.tiers.bench import bench_restore, format_table
from kvb_cache.tiers.text import benchmark_token_ids

DOCS = Path(__file__).resolve().parent.parent / "docs"


def start_redis(*extra: str) -> tuple[subprocess.Popen | None, str | None]:
    """A redis-server on a free loopback port (``extra``: more of its options); (None, None) without one."""
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found: skipping the Redis tier")
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
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


def _codecs() -> list:
    return [
        KiviCodec(bits=8, group_size=32),
        KiviCodec(bits=4, group_size=32),
        KiviCodec(bits=8, group_size=128),
        KiviCodec(bits=4, group_size=128),
        AbsmaxInt8Codec(),
    ]


def codec_snr(model, ids: list[int], *, block_size: int) -> list[dict]:
    """Each codec on the real KV of ``ids``, block by block as the engine writes records."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = output_cache(out)
    fmt_root = root_hash("bench")
    rows = []
    for codec in _codecs():
        snrs, ratios = [], []
        fmt = RecordFormat(fingerprint="bench", codec=codec)
        for start in range(0, len(ids) - block_size + 1, block_size):
            kv = slice_kv(cache, start, start + block_size)
            snrs.append(chunk_snr_db(kv, EncodedKV.from_dense(codec, kv)))
            tokens = ids[start : start + block_size]
            entry = ChunkEntry(
                key=prefix_hash(fmt_root, tokens),
                parent=fmt_root,
                content=content_hash(fmt_root, tokens),
                token_ids=tuple(tokens),
                kv=tuple((k.contiguous(), v.contiguous()) for k, v in kv),
                start=start,
            )
            fp16_bytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in kv)
            ratios.append(len(encode_record(entry, fmt)) / fp16_bytes)
        rows.append(
            {
                "codec": codec.name,
                "snr_db_mean": sum(snrs) / len(snrs),
                "snr_db_min": min(snrs),
                "record_bytes_vs_fp16": sum(ratios) / len(ratios),
            }
        )
    return rows


def agreement(
    model, tokenizer, prompts, *, bits: int, tiers: TierConfig, steps: int, greedy_prompts: int
) -> dict:
    """Prefixes restored from ``tiers`` by a fresh engine vs uncompressed no-cache logits.

    A writer engine stores each prompt's prefix (all but its last ``steps`` tokens) in the tiers; a reader
    engine with an empty RAM pool restores it and scores the next ``steps`` positions teacher-forced.
    """
    config = EngineConfig(kv_cache_bits=bits, tiers=tiers)
    writer = KVBoost(model, tokenizer, config=config)
    for ids in prompts:
        writer.warm(ids[:-steps])
    writer.close()  # drains the write-behind queue
    reader = KVBoost(model, tokenizer, config=config)
    first, top1, positions, kls, worst, restored = 0, 0, 0, [], 0.0, []
    for ids in prompts:
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0].float()
        prefix = len(ids) - steps
        for j in range(steps):
            got = reader.next_token_logits(ids[: prefix + j])
            if j == 0:
                restored.append(got.cached_tokens)
            logits, want = got.logits.float(), ref[prefix + j - 1]
            same = int(logits.argmax() == want.argmax())
            first += same if j == 0 else 0
            top1 += same
            positions += 1
            kls.append(
                torch.nn.functional.kl_div(
                    logits.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="sum"
                ).item()
            )
            worst = max(worst, (logits - want).abs().max().item())
    tokens_same, tokens_all = 0, 0
    plain = KVBoost(model, tokenizer, config=EngineConfig(max_cache_bytes=0))
    for ids in prompts[:greedy_prompts]:
        fresh = KVBoost(model, tokenizer, config=config)  # restores the prefix from the tier again
        cached = fresh.generate(ids[:-steps], max_new_tokens=16, ignore_eos=True).output_ids
        fresh.close()
        expected = plain.generate(ids[:-steps], max_new_tokens=16, ignore_eos=True).output_ids
        tokens_same += sum(a == b for a, b in zip(cached, expected))
        tokens_all += len(expected)
    reader.close()
    return {
        "first_token_top1": first / len(prompts),
        "teacher_forced_top1": top1 / positions,
        "positions": positions,
        "kl_mean": sum(kls) / len(kls),
        "kl_max": max(kls),
        "max_abs_logit_diff": worst,
        "greedy16_token_agreement": tokens_same / max(tokens_all, 1),
        "restored_tokens_mean": sum(restored) / len(restored),
        "prompts": len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="fidelity prompts for top-1 agreement")
    parser.add_argument("--steps", type=int, default=16, help="teacher-forced positions per prompt")
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
    snr = codec_snr(model, ids[:2048], block_size=EngineConfig().block_size)
    for row in snr:
        print(
            f"{row['codec']:>11}  SNR mean {row['snr_db_mean']:.1f} dB (min {row['snr_db_min']:.1f})  "
            f"record bytes/fp16 {row['record_bytes_vs_fp16']:.3f}"
        )
    prompts = fidelity_prompts(tokenizer, args.prompts)
    fidelity = {}
    proc, url = start_redis()
    try:
        with tempfile.TemporaryDirectory() as folder:
            settings = [("kivi8-g32", 8), ("kivi4-g32", 4)]
            for name, bits in settings:
                fidelity[name] = agreement(
                    model,
                    tokenizer,
                    prompts,
                    bits=bits,
                    tiers=TierConfig(disk_cache_dir=Path(folder) / name),
                    steps=args.steps,
                    greedy_prompts=args.greedy_prompts,
                )
                print(f"{name:>15}: {fidelity[name]}")
            if url is not None:
                fidelity["absmax8 (wire)"] = agreement(
                    model,
                    tokenizer,
                    prompts,
                    bits=16,
                    tiers=TierConfig(remote_url=url, remote_codec="absmax8"),
                    steps=args.steps,
                    greedy_prompts=args.greedy_prompts,
                )
                print(f"{'absmax8 (wire)':>15}: {fidelity['absmax8 (wire)']}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
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
