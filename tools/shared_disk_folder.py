"""How much a disk-tier folder shared by several engine processes holds against their ``disk_cache_bytes``.

Each process runs its own prompts (none shared) through an engine on a tiny random Llama, all writing one
folder with the same budget; the folder's bytes are sampled while they run and at the end (CPU, ~1 minute).

    python tools/shared_disk_folder.py [--processes 2] [--budget-records 40] [--prompts 60]

Prints a table: the budget, the largest folder seen while they ran, the folder at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvb_cache import EngineConfig, KVBoost
from kvb_cache.tiers import TierConfig
torch.set_num_threads(1)
model_dir, folder, budget, index, prompts = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(model_dir)
tok = AutoTokenizer.from_pretrained(model_dir)
tiers = TierConfig(disk_cache_dir=folder, disk_cache_bytes=int(budget))
engine = KVBoost(model, tok, config=EngineConfig(tiers=tiers))
base = 1 + int(index) * 20_000
for i in range(int(prompts)):
    engine.generate([base + 70 * i + j for j in range(64)], max_new_tokens=1)
engine.close()
"""


def _tiny_model(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100_000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(folder)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.kvb") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--budget-records", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        model_dir, folder = Path(tmp) / "model", Path(tmp) / "cache"
        _tiny_model(model_dir)
        subprocess.run(
            [sys.executable, "-c", CHILD, str(model_dir), str(Path(tmp) / "probe"), str(1 << 30), "0", "1"],
            check=True,
        )
        record = _folder_bytes(Path(tmp) / "probe") // 4  # one 64-token prompt: four 16-token blocks
        budget = args.budget_records * record
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(model_dir),
                    str(folder),
                    str(budget),
                    str(i),
                    str(args.prompts),
                ]
            )
            for i in range(args.processes)
        ]
        peak = 0
        while any(p.poll() is None for p in procs):
            peak = max(peak, _folder_bytes(folder) if folder.exists() else 0)
            time.sleep(0.05)
        if any(p.returncode for p in procs):
            raise SystemExit("a child process failed")
        end = _folder_bytes(folder)
        peak = max(peak, end)
    print("| processes | budget each | largest folder seen | folder at the end |")
    print("|---|---|---|---|")
    print(
        f"| {args.processes} | {budget} B ({args.budget_records} records) | {peak} B ({peak / budget:.2f}x) "
        f"| {end} B ({end / budget:.2f}x) |"
    )


if __name__ == "__main__":
    main()
