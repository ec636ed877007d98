"""Chunk cuts and chunk keys are deterministic functions of the token ids."""

from __future__ import annotations

import subprocess
import sys

from kvb_cache.chunking import Chunker, ChunkSpan
from kvb_cache.hashing import prefix_hash, root_hash, token_bytes
from kvb_cache.lookup import chunk_keys

IDS = list(range(1000, 1300))


def test_fixed_chunks_and_tail():
    spans = Chunker(128).split(IDS)
    assert spans == [ChunkSpan(0, 128, True), ChunkSpan(128, 256, True), ChunkSpan(256, 300, False)]


def test_boundary_window_slides_to_break_and_is_prefix_stable():
    breaks = frozenset({1000 + 125, 1000 + 250})
    chunker = Chunker(128, boundary_window=8, break_ids=breaks)
    spans = chunker.split(IDS)
    assert spans[0] == ChunkSpan(0, 126, True)  # token 125 is a break: cut right after it
    assert spans[1] == ChunkSpan(126, 251, True)
    for n in range(1, len(IDS)):
        complete = [s for s in chunker.split(IDS[:n]) if s.complete]
        assert complete == [s for s in spans if s.complete][: len(complete)]


def test_token_bytes_are_little_endian_uint32():
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_chain_depends_on_history():
    root = root_hash("fp")
    a = chunk_keys(root, [1, 2, 3, 4], Chunker(2).split([1, 2, 3, 4]))
    b = chunk_keys(root, [9, 9, 3, 4], Chunker(2).split([9, 9, 3, 4]))
    assert a.prefix[1] != b.prefix[1]  # same tokens, different history
    assert a.content[1] == b.content[1]
    assert a.prefix[1] == prefix_hash(prefix_hash(root, [1, 2]), [3, 4])


def test_keys_identical_across_processes():
    code = (
        "from kvb_cache.chunking import Chunker; from kvb_cache.hashing import root_hash;"
        "from kvb_cache.lookup import chunk_keys;"
        f"ids = {IDS!r}; k = chunk_keys(root_hash('fp'), ids, Chunker(64).split(ids));"
        "print(','.join(h.hex() for h in k.prefix + k.content))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert len(runs) == 1
    local = chunk_keys(root_hash("fp"), IDS, Chunker(64).split(IDS))
    assert runs.pop() == ",".join(h.hex() for h in local.prefix + local.content)
