"""Rewrite the generated options tables: the README's (``kvb_cache.EngineArgs`` and kvboost's groups) and
docs/server.md's (``kvb_server.ServerConfig``'s declared options).

python tools/options_table.py          # rewrite both between their markers
python tools/options_table.py --check  # exit 1 when either table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvboost.args import (
    SERVER_TABLE_END,
    SERVER_TABLE_START,
    options_markdown,
    replace_options_table,
    server_options_markdown,
)

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when a table is stale")
    args = parser.parse_args()
    stale = 0
    for path, table, markers in (
        (ROOT / "README.md", options_markdown(), None),
        (ROOT / "docs" / "server.md", server_options_markdown(), (SERVER_TABLE_START, SERVER_TABLE_END)),
    ):
        text = path.read_text(encoding="utf-8")
        updated = (
            replace_options_table(text, table)
            if markers is None
            else replace_options_table(text, table, markers)
        )
        if updated != text:
            stale = 1
            if not args.check:
                path.write_text(updated, encoding="utf-8")
    return stale if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
