"""How long a running stream stalls when a request whose prefix lives in Redis arrives (tier lookups).

A chat request decodes; after its 8th token a request arrives whose 1.4k-token prompt (a pydoc document) was
computed by an earlier engine and is held in Redis only (this engine's RAM is empty). We record the running
request's inter-token gaps after the arrival, its median gap before, and the arrival's TTFT, for:

- ``in the step``: the lookup runs inside the step that admits the request (kvb-cache before the lookups
  moved off the loop; emulated by running ``BlockTiers.fetch_async``'s work inline);
- ``off the loop``: the lookup runs on a loader thread and the request is admitted once its records are in
  memory (:mod:`kvb_cache.core.tier_loads`);

each with Redis healthy and with Redis stalled for ``--stall`` seconds (``DEBUG SLEEP`` sent just before the
arrival: a busy or paused Redis; ``--remote-timeout`` is set above it, so the records still arrive).

A redis-server is started here on a free port. SmolLM2-135M-Instruct fp32, CPU, one torch thread; medians
over ``--repeats`` runs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import Future
from pydoc_data.topics import topics

import torch
from bench_tiers import start_redis
from stall_probe import gaps_around_arrival
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.embedded import embedded_model_path
from kvb_cache.tiers import TierConfig

MODES = ("in the step", "off the loop")


def _inline(self: BlockTiers, keys) -> Future:
    """The lookup done where it was before: in the caller's thread (the engine step)."""
    future: Future = Future()
    future.set_result(self._fetch_or_nothing(tuple(keys)))
    return future


def document(tokenizer, tokens: int) -> list[int]:
    text = "\n\n".join(topics[k] for k in sorted(topics, key=lambda k: -len(topics[k]))[:3])
    return tokenizer(text)["input_ids"][:tokens]


def run_once(model, tokenizer, url: str, ids: list[int], *, mode: str, stall_s: float) -> dict[str, float]:
    import redis

    tiers = TierConfig(remote_url=url, remote_timeout_s=stall_s + 5.0)
    config = EngineConfig(tiers=tiers)
    writer = KVBoost(model, tokenizer, config=config)
    writer.next_token_logits(ids)  # its blocks go to Redis
    writer.close()
    engine = KVBoost(model, tokenizer, config=config)  # empty RAM: the prompt is in Redis only
    original = BlockTiers.fetch_async
    if mode == "in the step":
        BlockTiers.fetch_async = _inline

    def stall() -> None:  # Redis busy for stall_s from now: the arrival's lookup waits for it
        client = redis.Redis.from_url(url)
        threading.Thread(target=client.execute_command, args=("DEBUG", "SLEEP", stall_s)).start()
        time.sleep(0.05)  # the SLEEP is running when the lookup arrives

    def arrive() -> str:
        return engine.add_request(ids, SamplingParams(max_new_tokens=2, ignore_eos=True))

    try:
        gaps = gaps_around_arrival(engine, arrive, until_finished=True, prepare=stall if stall_s else None)
    finally:
        BlockTiers.fetch_async = original
        engine.close()
    result = gaps["result"]
    return {
        "max_gap": gaps["max_gap"],
        "median_gap_before": gaps["median_gap_before"],
        "ttft": gaps["ttft"],
        "cached": result.cached_tokens if result is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1400, help="the arriving prompt's length")
    parser.add_argument("--stall", type=float, default=1.0, help="seconds Redis sleeps in the stalled case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = document(tokenizer, args.tokens)
    proc, url = start_redis("--enable-debug-command", "local")  # DEBUG SLEEP, from this machine only
    if proc is None:
        raise SystemExit("this benchmark needs redis-server")
    try:
        print(
            "| Redis | lookup | running request: max gap after arrival | its median gap before "
            "| arrival TTFT | arrival's tokens from Redis |"
        )
        print("|---|---|---|---|---|---|")
        for stall in (0.0, args.stall):
            for mode in MODES:
                runs = []
                for _ in range(args.repeats):
                    runs.append(run_once(model, tokenizer, url, ids, mode=mode, stall_s=stall))
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                redis_state = f"stalled {stall:g} s" if stall else "healthy"
                print(
                    f"| {redis_state} | {mode} | {med['max_gap'] * 1e3:.0f} ms "
                    f"| {med['median_gap_before'] * 1e3:.0f} ms | {med['ttft']:.2f} s "
                    f"| {med['cached']:.0f} of {len(ids)} |",
                    flush=True,
                )
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
