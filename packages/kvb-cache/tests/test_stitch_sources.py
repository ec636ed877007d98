"""Which pending requests a stitched prompt waits for: the memoized, chunk-walking implementation names the
same sources as the definition (every pending prompt re-hashed, its shared prefix counted token by token)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from kvb_cache.chunking import Chunker
from kvb_cache.core.deferred import Deferred, PlanRoom
from kvb_cache.hashing import content_hash, prefix_hash, root_hash
from kvb_cache.lookup import common_prefix_len
from kvb_cache.stitch_sources import stitch_sources
from kvb_cache.store import ChunkEntry, ChunkStore

ROOT = root_hash("m")
CHUNK = 4


def reference(store, root, req, pending, wanted):
    """The definition, written plainly (what ``stitch_sources`` computed before it memoized)."""
    prompt = req.tokens[: req.prompt_len]
    holders: dict = {}
    stored: dict = {}
    for other in pending:
        if other.root != req.root:
            continue
        theirs = other.tokens[: other.prompt_len]
        shared = common_prefix_len(theirs, prompt)
        for span in other.spans:
            if not span.complete or span.start < shared:
                continue
            tokens = tuple(theirs[span.start : span.end])
            key = content_hash(root, tokens)
            if key not in stored:
                stored[key] = sum(1 for e in store.by_content(key) if not e.derived and e.token_ids == tokens)
            occurs = any(
                prompt[i : i + len(tokens)] == list(tokens) for i in range(len(prompt) - len(tokens) + 1)
            )
            if stored[key] >= wanted or not occurs:
                continue
            holders.setdefault(key, {})[id(other)] = other
    sources: dict = {}
    for key, names in holders.items():
        if stored[key] + len(names) >= wanted:
            sources.update(names)
    return {id(r) for r in sources.values()}


def request(tokens, tenant=None):
    """The fields ``stitch_sources`` reads (a full Request needs a model's processor and emitter)."""
    return SimpleNamespace(
        tokens=[*tokens, 7, 7],  # generated tokens past the prompt must be ignored
        prompt_len=len(tokens),
        root=tenant,
        spans=tuple(Chunker(CHUNK).split(tokens)),
        stitch_pieces=None,
    )


def test_sources_match_the_definition_on_random_rag_prompts():
    rng = random.Random(0)
    system = [1, 2, 3, 4, 5, 6]
    docs = [[rng.randrange(10, 40) for _ in range(rng.choice((4, 8, 9)))] for _ in range(8)]
    checked = named = 0
    for trial in range(150):
        store = ChunkStore(max_bytes=1 << 20)
        for doc in rng.sample(docs, 3):  # some chunks already stored once (some derived)
            ids = tuple(doc[:CHUNK])
            store.put(
                ChunkEntry(
                    key=prefix_hash(ROOT, [trial, *ids]),
                    parent=ROOT,
                    content=content_hash(ROOT, ids),
                    token_ids=ids,
                    kv=((torch.zeros(1, 1, CHUNK, 2), torch.zeros(1, 1, CHUNK, 2)),),
                    start=0,
                    derived=rng.random() < 0.3,
                ),
                root=ROOT,
            )

        def prompt():
            head = system[: rng.randrange(len(system) + 1)]
            # Documents may repeat: a chunk straddling the end of a shared prefix can recur later.
            body = [t for doc in rng.choices(docs, k=rng.randrange(1, 5)) for t in doc]
            return head + body + [rng.randrange(50, 60) for _ in range(rng.randrange(3))]

        pending = [request(prompt(), tenant=rng.choice((None, None, b"t"))) for _ in range(12)]
        for _ in range(5):
            req = request(prompt(), tenant=rng.choice((None, b"t")))
            for wanted in (1, 2, 3):
                expected = reference(store, ROOT, req, pending, wanted)
                got = {id(r) for r in stitch_sources(store, ROOT, req, pending, wanted=wanted)}
                assert got == expected, f"trial {trial}, wanted {wanted}"
                checked += 1
                named += bool(expected)
            pending.append(req)  # it pends in turn, its pieces now memoized
    assert named > checked // 4  # the comparison covered prompts that do wait


def room() -> PlanRoom:
    return PlanRoom(tokens=10**9, count=10**9, planned=0)


def test_held_request_is_released_once_every_source_is_done():
    a, b = SimpleNamespace(done=False), SimpleNamespace(done=False)
    held = SimpleNamespace(request_id="h", status=None, prompt_len=8)
    deferred = Deferred()
    deferred.add(held, (a, b))
    pending = lambda s: not s.done  # noqa: E731
    assert deferred.release(pending, room()) == [] and "h" in deferred
    a.done = True
    assert deferred.release(pending, room()) == []
    b.done = True
    assert deferred.release(pending, room()) == [held] and "h" not in deferred


def test_release_plans_what_fits_oldest_first_and_passes_none_over():
    """Held requests ready to be planned are released while the room lasts; the first that does not fit
    stops the release (a smaller one behind it waits too), and the first of all always fits."""
    big, small, later = (
        SimpleNamespace(request_id=n, status=None, prompt_len=p) for n, p in (("b", 90), ("s", 5), ("l", 5))
    )
    deferred = Deferred()
    for req in (big, small, later):
        deferred.hold_for_room(req)
    assert deferred.awaiting_room == 3
    never = lambda s: False  # noqa: E731
    assert deferred.release(never, PlanRoom(tokens=50, count=4, planned=1)) == []
    assert deferred.awaiting_room == 3  # the big one does not fit: the small ones wait behind it
    assert deferred.release(never, PlanRoom(tokens=50, count=4, planned=0)) == [big]  # nothing planned: in
    assert deferred.release(never, PlanRoom(tokens=50, count=1, planned=1)) == [small]  # one more prompt
    assert deferred.awaiting_room == 1 and "l" in deferred
    assert deferred.release(never, room()) == [later] and deferred.awaiting_room == 0


def test_a_held_request_whose_prefix_was_read_holds_its_room_already():
    """A stitched prompt held while its prefix's tier records are read is counted as planned (its records are
    in memory): once read it is released whatever the room, or it waited for room it held itself (a
    deadlock, found writing the burst test)."""
    loaded = SimpleNamespace(request_id="r", status=None, prompt_len=8, tier_load=None)
    deferred = Deferred()
    deferred.add(loaded, (), SimpleNamespace(done=True))
    assert deferred.release(lambda s: False, PlanRoom(tokens=0, count=0, planned=2)) == [loaded]
    assert deferred.awaiting_room == 0


def test_requests_put_back_after_an_interrupt_keep_their_place():
    """Released prompts an interrupt kept from being planned went to the back of the held ones, without their
    place in the room queue (a review); put back, they are first again and wait for room."""
    old, new = (SimpleNamespace(request_id=n, status=None, prompt_len=4, tier_load=None) for n in ("o", "n"))
    deferred = Deferred()
    deferred.hold_for_room(new)
    deferred.put_back([old])
    assert deferred.awaiting_room == 2
    assert deferred.release(lambda s: False, PlanRoom(tokens=10, count=1, planned=1)) == [old]
    assert deferred.awaiting_room == 1 and "n" in deferred
