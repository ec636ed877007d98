"""Rewrite the README's options table from the option classes (``kvb_cache.EngineArgs`` and kvboost's groups).

python tools/options_table.py          # rewrite README.md between the options-table markers
python tools/options_table.py --check  # exit 1 when the README's table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvboost.args import options_markdown, replace_options_table

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when the table is stale")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    updated = replace_options_table(text, options_markdown())
    if args.check:
        return int(updated != text)
    README.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
