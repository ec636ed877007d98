"""Random engine-loop workloads and the invariants they must keep (driven by ``test_engine_stress.py``).

One seed is one workload: an engine over a tiny random model with small random limits (block size, pool
size, batch caps, prefill slices, chunk size, sometimes no prefix cache, sometimes stitching) and 20-80
random operations on it:

- requests added with caller-chosen ids drawn from a pool of five (so ids are reused after a request ends,
  and sometimes asked for while still live) or engine-chosen ones: RAG prompts with shuffled documents,
  prefixes and next turns of earlier prompts, tiny prompts, prompts that fill the pool; greedy or seeded
  sampling, penalties, stop tokens and stop strings taken from the request's own continuation (so they
  fire), ``min_tokens``, cache salts, a private 8-bit cache, ``logprobs`` and ``logit_bias`` (drawn from a
  second generator, :func:`add_extras`, so the seeds of the first still name the same workloads);
  sometimes a disk tier under the pool (:func:`add_disk_tier`), which evicted blocks go to and come back
  from;
- 1-5 steps; aborts of live, held, preparing, finished and unknown requests; idle work; ``clear_cache``;
  ``reset_cache``; library calls (``generate``, ``generate_batch``, a stream closed part-way, ``warm``,
  ``next_token_logits``) interleaved with the caller's own requests; deliberately invalid requests.

Everything is drawn from ``random.Random(seed)`` before the engine runs, so a seed names one workload
exactly. The checks raise :class:`StressFailure` naming what diverged:

- after every operation and step: every block's ``ref_count`` equals the requests holding it, the free
  queue is exactly the unowned blocks, ``paged_stats`` agrees with a recount of the pool, waiting requests
  hold no blocks, the engine's unfinished requests are the workload's live ones, prefix-cache counters
  never decrease;
- every output: one final output per request and none after an abort; streamed tokens, text and
  logprobs add up to the result; lengths and finish reasons agree with the parameters; logprobs are one
  per token of the returned text, name it, and rank their alternatives best first;
- every abort: the request is gone and holds no blocks (the pool check above sees them released);
- no hang: every step, the workload's and those of library loops, counts against a bound scaled to the
  workload's tokens; passing it raises :class:`Hang`, saying what each unfinished request is stuck on;
- at the end (requests drained, idle work run): no block is held; every finished request that neither
  stitched (approximate by design) nor used a private 8-bit cache produced the tokens, text and finish
  reason of the same request alone on an engine without a cache (fp32), except a greedy divergence where
  the no-cache top-2 logits tie (``NEAR_TIE``), and the logprobs it ran (within ``ATOL``); every pool
  block and stored chunk reachable by an exact
  prefix hash holds the no-cache KV of its prefix; a disk tier counted no error and no corrupt record;
  ``clear_cache`` empties the pool.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from conftest import make_model, make_tokenizer, words

from kvb_cache import (
    CacheBusyError,
    EngineConfig,
    GenerationResult,
    HitKind,
    KVBoost,
    KVBoostError,
    RequestOutput,
    SamplingParams,
    StitchConfig,
)
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.core.request import Request, RequestStatus
from kvb_cache.hashing import ChunkHash, salted_root
from kvb_cache.tiers import TierConfig

#: conftest's models: ``max_position_embeddings`` and the eos token id.
MODEL_CONTEXT = 512
EOS = 1
#: The ids callers pick: few, so a request's id is often reused once it ended (or asked for while live).
REQUEST_IDS = tuple(f"r{i}" for i in range(5))
#: A greedy divergence where the no-cache top-2 logits are closer than this is a float tie, not a bug:
#: batching may round the last bit differently (seen once in ~47,000 comparisons, an exact tie).
NEAR_TIE = 1e-3
#: fp32 tolerance of cached KV and logits against a plain no-cache forward.
ATOL = 1e-4
#: Steps a workload may take beyond its token-scaled share before it counts as hung: clean workloads stay
#: well inside the bound (at most 41% of it, over 280 measured on five architectures); hung ones never end.
STEP_SLACK = 2000
#: The last steps before the bound, over which preemptions are counted to tell a livelock from a stall.
LIVELOCK_WINDOW = 50


class StressFailure(AssertionError):
    """An invariant broke; the message says what diverged."""


class Hang(StressFailure):
    """The workload passed its step bound with requests still unfinished."""


# ================================================================================================ oracles
class World:
    """One architecture's tiny model, the tokenizer, the texts prompts are built from, and the oracles.

    Shared by every workload of that architecture: its memos only save recomputing the same forwards.
    """

    def __init__(self, arch: str) -> None:
        self.model = make_model(arch)
        self.tokenizer = make_tokenizer()
        self.system = self.encode(words(20, seed=900))
        self.docs = [
            self.encode(words(n, seed=1000 + i)) for i, n in enumerate((40, 33, 48, 24, 60, 36, 52, 28))
        ]
        self.questions = [self.encode(words(n, seed=2000 + i)) for i, n in enumerate((3, 5, 6, 8, 4, 7))]
        # Without a prefix cache (max_cache_bytes=0) every request on it computes its whole prompt, as if
        # it were alone on a fresh engine: the reference the workload's requests must reproduce.
        self.uncached = KVBoost(
            self.model,
            self.tokenizer,
            config=EngineConfig(max_cache_bytes=0, num_blocks=40, block_size=16),
        )
        self._solo: dict[tuple[tuple[int, ...], str], GenerationResult] = {}
        self._forwards: OrderedDict[tuple[int, ...], tuple[torch.Tensor, Any]] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def solo_run(self, prompt: list[int], params: SamplingParams) -> GenerationResult:
        """``prompt`` under ``params`` alone on the engine without a prefix cache."""
        key = (tuple(prompt), repr(params))
        if key not in self._solo:
            engine = self.uncached
            rid = engine.add_request(list(prompt), params)
            for _ in range(10 * MODEL_CONTEXT):
                finished = [out for out in engine.step() if out.request_id == rid and out.finished]
                if finished:
                    assert finished[0].error is None, f"the reference run failed: {finished[0].error!r}"
                    self._solo[key] = finished[0].result
                    break
            assert key in self._solo and not engine.has_unfinished(), "the reference run did not finish"
        return self._solo[key]

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, Any]:
        """A plain transformers forward over ``ids``: logits ``[len, vocab]`` and its cache."""
        key = tuple(ids)
        if key not in self._forwards:
            out = self.model(torch.tensor([ids]), use_cache=True)
            self._forwards[key] = (out.logits[0], output_cache(out))
            if len(self._forwards) > 64:  # the end-of-workload KV checks walk many prefixes of few prompts
                self._forwards.popitem(last=False)
        return self._forwards[key]

    def top2_margin(self, ids: list[int]) -> float:
        """No-cache top-1 minus top-2 logit of the token after ``ids``."""
        top = torch.topk(self.forward(ids)[0][-1], 2).values
        return float(top[0] - top[1])


# ============================================================================================= generation
# Every draw happens here, up front, in a fixed order: a seed is a workload. Stop tokens and strings are
# kept as fractions (positions in the request's reference continuation) and resolved when the request is
# added, since a next-turn prompt only exists once the earlier request has finished. The draws keep the
# order of the audit harness these workloads come from, so its seed numbers name the same workloads.


def make_config(rng: random.Random) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments (``stitching`` as ``StitchConfig`` keywords): small limits, so
    pools run out, prefills are sliced and requests are preempted."""
    block_size = rng.randint(2, 16)
    chunk_size = rng.randint(8, 32)
    config: dict[str, Any] = dict(
        block_size=block_size,
        chunk_size=chunk_size,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256]),
        prefill_chunk_size=rng.choice([None, None, rng.randint(4, 64)]),
        store_outputs=rng.random() < 0.85,
        store_partial_tail=rng.random() < 0.85,
    )
    if rng.random() < 0.05:
        config["max_cache_bytes"] = 0
    # From just enough blocks for the largest request to a roomy pool.
    tokens = rng.choice([64, 96, 128, 192, 256, 400])
    config["num_blocks"] = max(2, -(-tokens // block_size) + rng.choice([0, 1, 2, 4, 8, 32, 64]))
    if rng.random() < 0.45:
        stitching: dict[str, Any] = dict(
            recompute_strategy=rng.choice(["none", "selective", "cacheblend"]),
            idle_copies=rng.choice([1, 2]),
            keep_approximate=rng.random() < 0.3,
            min_reuse_tokens=rng.choice([chunk_size, 16]),
            collect_copies=rng.choice([1, 1, 2]),
            average_copies=rng.choice([1, 2]),
        )
        overlap_k = rng.choice([None, 0, 4, 16])
        if overlap_k is not None:
            stitching["overlap_k"] = overlap_k
        config["stitching"] = stitching
    return config


def capacity(config: dict[str, Any]) -> int:
    """Tokens one request may span (prompt + output): the pool or the model's context."""
    return min(config["num_blocks"] * config["block_size"], MODEL_CONTEXT)


def make_prompt(rng: random.Random, world: World, room: int, history: list[list[int]]) -> dict[str, Any]:
    """``{"kind": "ids", "ids": [...]}``, or ``{"kind": "turn", ...}``: an earlier request's prompt, its
    output and a question (resolved when added)."""
    r = rng.random()
    if r < 0.45:  # RAG: system prompt, documents in some order, a question
        docs = rng.sample(range(len(world.docs)), rng.randint(1, 4))
        system = world.system if rng.random() < 0.7 else []
        ids = [*system, *(t for d in docs for t in world.docs[d]), *rng.choice(world.questions)]
    elif r < 0.6 and history:  # a prefix of an earlier prompt: exact hits and tail matches
        prev = rng.choice(history)
        ids = prev[: rng.randint(1, len(prev))] + (rng.choice(world.questions) if rng.random() < 0.5 else [])
    elif r < 0.7 and history:
        return {"kind": "turn", "ref": rng.randrange(len(history)), "extra": rng.choice(world.questions)}
    elif r < 0.8:  # 1-4 tokens
        ids = [rng.randrange(5, 295) for _ in range(rng.randint(1, 4))]
    elif r < 0.9:  # as long as the request may be: the pool or the context is full
        docs = [t for i in rng.sample(range(len(world.docs)), len(world.docs)) for t in world.docs[i]]
        ids = (world.system + docs) * 4
    else:  # a document alone, or after the system prompt: common stitching sources
        ids = (world.system if rng.random() < 0.5 else []) + rng.choice(world.docs)
    return {"kind": "ids", "ids": ids[:room]}


def make_params(rng: random.Random) -> dict[str, Any]:
    """Sampling parameters; stop tokens / strings as positions (fractions) in the reference output."""
    p: dict[str, Any] = {"max_new": 1 if rng.random() < 0.15 else rng.randint(2, 40)}
    if rng.random() < 0.3:
        p.update(
            temperature=round(rng.uniform(0.5, 1.5), 2),
            seed=rng.randrange(1 << 30),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
        )
        if rng.random() < 0.3:
            p[rng.choice(["repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"])] = True
    p["ignore_eos"] = rng.random() < 0.5
    r = rng.random()
    if r < 0.15:
        p["stop_token_at"] = rng.random()
    elif r < 0.3:
        p["stop_string_at"] = (rng.random(), rng.random())
    elif r < 0.35:
        p["stop_token_at"] = rng.random()
        p["stop_string_at"] = (rng.random(), rng.random())
    if rng.random() < 0.1:
        p["min_tokens"] = rng.random()
    if rng.random() < 0.1:
        p["include_stop"] = True
    return p


def _request_op(rng: random.Random, world: World, cap: int, history: list[list[int]]) -> dict[str, Any]:
    params = make_params(rng)
    params["max_new"] = min(params["max_new"], cap - 1)
    prompt = make_prompt(rng, world, cap - params["max_new"], history)
    if prompt["kind"] == "ids":
        history.append(prompt["ids"])
    return {"prompt": prompt, "params": params}


def make_ops(rng: random.Random, world: World, config: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """``count`` operations (dicts keyed by ``"op"``), about a third of them requests."""
    cap = capacity(config)
    history: list[list[int]] = []  # prompts so far: later prompts and library calls reuse them
    ops: list[dict[str, Any]] = []
    for _ in range(count):
        r = rng.random()
        if r < 0.32:
            op = {"op": "add", **_request_op(rng, world, cap, history)}
            op["request_id"] = rng.choice(REQUEST_IDS) if rng.random() < 0.6 else None
            if rng.random() < 0.1:
                op["salt"] = rng.choice(["a", "b"])
            if rng.random() < 0.04:
                op["kv_bits"] = 8  # a solo request with a private quantized cache
            ops.append(op)
            if rng.random() < 0.15:  # before its first step
                ops.append({"op": "abort", "target": "last"})
        elif r < 0.35:  # an ended request's id again: its prompt or another
            op = {"op": "readd", **_request_op(rng, world, cap, history)}
            ops.append(op | {"pick": rng.random(), "same_prompt": rng.random() < 0.4})
        elif r < 0.38:
            target = rng.choice(["live", "live", "preparing", "finished", "unknown"])
            ops.append({"op": "abort", "target": target, "pick": rng.random()})
        elif r < 0.42:
            ops.append({"op": "run_idle", "max_steps": rng.choice([None, 1, 2, 3])})
        elif r < 0.45:
            ops.append({"op": "clear_cache"})
        elif r < 0.47:
            ops.append({"op": "reset_cache"})
        elif r < 0.49 and history:
            ops.append(
                {"op": "generate", "ids": rng.choice(history)[: cap - 8], "max_new": rng.randint(1, 8)}
            )
        elif r < 0.50 and history:
            ops.append({"op": "next_token_logits", "ids": rng.choice(history)})
        elif r < 0.51 and history:
            prompts = [rng.choice(history)[: cap - 8] for _ in range(rng.randint(1, 3))]
            ops.append({"op": "generate_batch", "prompts": prompts, "max_new": rng.randint(1, 8)})
        elif r < 0.52 and history:
            ids, max_new = rng.choice(history)[: cap - 10], rng.randint(1, 10)
            ops.append({"op": "stream", "ids": ids, "max_new": max_new, "read": rng.randint(0, 4)})
        elif r < 0.53 and history:
            ops.append({"op": "warm", "ids": rng.choice(history)[: cap - 1]})
        elif r < 0.55:
            ops.append(
                {"op": "invalid", "kind": rng.choice(["too_long", "duplicate_id", "bad_stop", "empty"])}
            )
        else:
            ops.append({"op": "step", "n": rng.choice([1, 1, 1, 2, 3, 5])})
    return ops


def add_extras(seed: int, ops: list[dict[str, Any]]) -> None:
    """Give some requests ``logprobs`` and ``logit_bias``, drawn from a generator of their own so the draws
    above (and the seed numbers that name their workloads) stay as they were. A +-100 bias forces or bans
    a token, smaller ones tilt the choice; a bias on eos ends or prolongs requests that do not ignore it."""
    rng = random.Random(f"extras-{seed}")
    for op in ops:
        if "params" not in op:
            continue
        if rng.random() < 0.2:
            op["params"]["logprobs"] = rng.choice([0, 1, 4])
        if rng.random() < 0.12:
            tokens = [EOS if rng.random() < 0.15 else rng.randrange(5, 295) for _ in range(rng.randint(1, 3))]
            op["params"]["logit_bias"] = [[t, rng.choice([-100.0, -3.0, 2.0, 100.0])] for t in tokens]


def add_disk_tier(seed: int, config: dict[str, Any]) -> None:
    """Sometimes a disk tier below the pool (``"disk_tier"``: its byte budget; the folder is the workload's
    own temporary one): blocks evicted from RAM are written behind to disk and a later prefix lookup
    restores them, so the end-of-workload checks also see KV that went through a record and back. Records
    keep KV as computed (``kv_cache_bits`` 16), so served requests must still equal no-cache."""
    rng = random.Random(f"disk-{seed}")
    if rng.random() < 0.25:
        # From a few blocks' records (the disk evicts too) to room for everything.
        config["disk_tier"] = rng.choice([8_000, 40_000, 1 << 24])


def make_workload(seed: int, world: World) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine config and the operations of workload ``seed``."""
    rng = random.Random(seed)
    config = make_config(rng)
    ops = make_ops(rng, world, config, rng.randint(20, 80))
    add_extras(seed, ops)
    add_disk_tier(seed, config)
    return config, ops


def step_bound(token_budget: int, ops: list[dict[str, Any]]) -> int:
    """Steps the whole workload may take: a slack, plus three per token it asks for at the step's token
    budget ``max_num_batched_tokens`` (a 1-token budget takes a step per prompt token)."""
    tokens = 0
    for op in ops:
        if "prompt" in op:  # a next turn is at most an earlier prompt + output + question: 40 covers it
            tokens += len(op["prompt"].get("ids", ())) + 40 + op["params"]["max_new"]
        tokens += sum(len(ids) + 10 for ids in (op.get("ids", ()), *op.get("prompts", ())) if ids)
    return STEP_SLACK + 3 * tokens // min(token_budget, 64)


def build_engine(world: World, config: dict[str, Any], disk_dir: str | None = None) -> KVBoost:
    kwargs = dict(config)
    if "stitching" in kwargs:
        kwargs["stitching"] = StitchConfig(**kwargs["stitching"])
    if "disk_tier" in kwargs:
        budget = kwargs.pop("disk_tier")
        kwargs["tiers"] = TierConfig(disk_cache_dir=disk_dir, disk_cache_bytes=budget)
    return KVBoost(world.model, world.tokenizer, config=EngineConfig(**kwargs))


# ================================================================================================ running
@dataclass
class Tracked:
    """A request the workload made, and what it saw of it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    op: int  # the index of the operation that made it
    source: str  # "add_request", "solo" (a private 8-bit cache) or the library call's name
    status: str = "live"  # live | finished | aborted
    outputs: list[RequestOutput] = field(default_factory=list)
    result: GenerationResult | None = None

    @property
    def name(self) -> str:
        return f"request {self.request_id!r} (added by op {self.op})"


def _stitched(result: GenerationResult) -> bool:
    """Whether a result reused KV at a new position (approximate by design, so not compared exactly)."""
    return bool(result.recomputed_tokens) or any(c.kind is HitKind.STITCHED for c in result.chunks)


class Workload:
    """Runs operations (``make_ops``'s format) on a fresh engine built from ``config`` (``make_config``'s
    format; keys left out take ``EngineConfig``'s defaults), checking the invariants as it goes (see the
    module docstring); ``where`` names the operation being run when a check fails. ``max_steps`` replaces
    the step bound derived from the workload's tokens (a short workload known to finish quickly)."""

    def __init__(
        self,
        world: World,
        config: dict[str, Any],
        ops: list[dict[str, Any]],
        *,
        max_steps: int | None = None,
    ) -> None:
        self.world = world
        self.config, self.ops = config, ops
        self._disk = tempfile.TemporaryDirectory(prefix="kvb-stress-") if "disk_tier" in config else None
        self.engine = build_engine(world, config, self._disk.name if self._disk else None)
        pool, scheduler = self.engine.kv.pool, self.engine.core.scheduler
        self.cap = min(pool.num_blocks * pool.block_size, MODEL_CONTEXT)  # capacity(config)
        self.stitching = "stitching" in config
        self.tracked: list[Tracked] = []
        self.by_op: dict[int, Tracked] = {}
        self.salts: set[str] = set()
        self.op_index = -1
        self.where = "engine construction"
        #: What the workload exercised: a targeted test asserts it reached its path; counts per seed also
        #: guide which seeds to run by default.
        self.coverage: Counter[str] = Counter()
        self.last_stats = self.engine.paged_stats()
        # Every step goes through the count: the workload's own, and those of library loops and run_idle.
        self.step_bound = max_steps or step_bound(scheduler.max_num_batched_tokens, ops)
        self.steps = 0
        self._preemptions_before_window = 0
        self._core_step = self.engine.core.step
        self.engine.core.step = self._counted_step

    @classmethod
    def from_seed(cls, world: World, seed: int) -> Workload:
        return cls(world, *make_workload(seed, world))

    # ------------------------------------------------------------------------------------------- driver
    def run(self) -> None:
        """Every operation, then drain, idle work and the end-of-workload checks; raises StressFailure."""
        try:
            self._run()
        finally:
            if self._disk is not None:
                self.engine.close()
                self._disk.cleanup()

    def _run(self) -> None:
        handlers = {
            "add": self._add,
            "readd": self._readd,
            "abort": self._abort,
            "step": self._steps,
            "run_idle": self._run_idle,
            "clear_cache": self._clear_cache,
            "reset_cache": self._reset_cache,
            "generate": self._generate,
            "generate_batch": self._generate_batch,
            "stream": self._stream,
            "warm": self._warm,
            "next_token_logits": self._next_token_logits,
            "invalid": self._invalid,
        }
        for i, op in enumerate(self.ops):
            self.op_index = i
            self.where = f"op {i} of {len(self.ops)}: {json.dumps(op)[:300]}"
            handlers[op["op"]](op)
        self.op_index = len(self.ops)
        self.where = "drain (all operations done, stepping until nothing is unfinished)"
        while self.engine.has_unfinished():
            self._step()
        self._check_quiescent("after the drain")
        self.where = "idle work after the drain"
        self.engine.run_idle()
        self._check_engine("after run_idle")
        self._check_quiescent("after run_idle")
        self.where = "end-of-workload checks"
        self._check_exactness()
        self._check_pool_kv()
        self._check_store_kv()
        self.coverage["preemptions"] = self.engine.paged_stats().preemptions
        self._check_tiers()
        self.engine.clear_cache()
        self._check_pool_empty("clear_cache at the end")

    def fail(self, message: str) -> NoReturn:
        raise StressFailure(message)

    def _counted_step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.step_bound - LIVELOCK_WINDOW:
            self._preemptions_before_window = self.engine.core.scheduler.preemptions
        if self.steps > self.step_bound:
            # Described now: a library loop aborts its own request on the way out.
            raise Hang(self._describe_hang())
        return self._core_step()

    def _describe_hang(self) -> str:
        core = self.engine.core
        queued = [r for r in (*core.scheduler.running, *core.scheduler.waiting) if not r.internal]
        preemptions = core.scheduler.preemptions - self._preemptions_before_window
        if preemptions >= LIVELOCK_WINDOW // 2:
            kind = f"a preemption livelock: {preemptions} preemptions in the last {LIVELOCK_WINDOW} steps"
        elif core.deferred and not queued and not core.preparing and not core.solo:
            kind = "a deadlock: every unfinished request is held, waiting for another to compute its prompt"
        else:
            kind = f"no progress ({preemptions} preemptions in the last {LIVELOCK_WINDOW} steps)"
        stuck = [f"{r.request_id} held (deferred stitched prompt)" for r in core.deferred.requests()]
        stuck += [f"{r.request_id} preparing (stitched prompt repair)" for r in core.preparing.requests()]
        stuck += [
            f"{r.request_id} {r.status.value}, {r.num_computed}/{len(r.tokens)} tokens computed, "
            f"preempted {r.preemptions}x"
            for r in queued
        ]
        stuck += [f"{rid} solo" for rid in core.solo]
        return f"hang, {kind}; unfinished after {self.step_bound} steps: {'; '.join(stuck) or 'none'}"

    # ------------------------------------------------------------------------------------------ tracking
    def _live(self) -> list[Tracked]:
        return [t for t in self.tracked if t.status == "live"]

    def _holder(self, request_id: str) -> Tracked | None:
        """The live request with this id (ids are reused: only one may be live at a time)."""
        return next(
            (t for t in reversed(self.tracked) if t.request_id == request_id and t.status == "live"), None
        )

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            t = self._holder(out.request_id)
            if t is None:
                self.fail(
                    f"an output for {out.request_id!r}, which is not live (aborted, finished or unknown)"
                )
            t.outputs.append(out)
            if out.error is not None:
                self.fail(f"{t.name} ended with an error: {out.error!r}")
            if out.result is not None:
                t.status, t.result = "finished", out.result
                self._check_result(t)

    def _track_library_result(self, ids: list[int], max_new: int, result: GenerationResult, how: str) -> None:
        """A library call's greedy ``ignore_eos`` result: exactly ``max_new`` tokens, compared at the end."""
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        name = f"<{how}>"
        self.tracked.append(Tracked(name, list(ids), params, self.op_index, how, "finished", result=result))
        if len(result.output_ids) != max_new or result.finish_reason != "length":
            self.fail(
                f"{how} with ignore_eos returned {len(result.output_ids)} of {max_new} tokens "
                f"(finish_reason {result.finish_reason!r})"
            )

    # ---------------------------------------------------------------------------------------- requests
    def _resolve_prompt(self, spec: dict[str, Any]) -> list[int]:
        if spec["kind"] == "ids":
            return list(spec["ids"])
        # A next turn: the prompt and output of an earlier add (its output once it finished).
        adds = [i for i, op in enumerate(self.ops[: self.op_index]) if op["op"] == "add"]
        base = self.by_op.get(adds[spec["ref"] % len(adds)]) if adds else None
        if base is None:
            return list(spec["extra"])
        output = base.result.output_ids if base.result is not None else []
        return [*base.prompt, *output, *spec["extra"]]

    def _resolve_params(self, prompt: list[int], p: dict[str, Any]) -> SamplingParams:
        kw: dict[str, Any] = dict(max_new_tokens=p["max_new"], ignore_eos=p["ignore_eos"])
        if "temperature" in p:
            kw.update(temperature=p["temperature"], seed=p["seed"], top_k=p["top_k"], top_p=p["top_p"])
        penalties = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, min_p=0.05)
        kw.update({name: value for name, value in penalties.items() if name in p})
        if "logprobs" in p:
            kw["logprobs"] = p["logprobs"]
        if "logit_bias" in p:
            kw["logit_bias"] = {token: bias for token, bias in p["logit_bias"]}
        if "stop_token_at" in p or "stop_string_at" in p:
            # Taken from what this request generates alone, so the stop does fire.
            reference = self.world.solo_run(prompt, SamplingParams(**{**kw, "ignore_eos": True})).output_ids
            if "stop_token_at" in p:
                kw["stop_token_ids"] = [reference[int(p["stop_token_at"] * len(reference))]]
            if "stop_string_at" in p:
                at, cut = p["stop_string_at"]
                j = int(at * len(reference))
                text = self.world.tokenizer.decode(reference[j : j + 2])  # may span two tokens
                kw["stop"] = [text[: max(1, int(cut * len(text)) + 1)].strip() or text]  # may cut a token
        if "min_tokens" in p:
            kw["min_tokens"] = int(p["min_tokens"] * p["max_new"])
        if p.get("include_stop"):
            kw["include_stop_str_in_output"] = True
        return SamplingParams.build(**kw)

    def _add(self, op: dict[str, Any]) -> None:
        prompt = self._resolve_prompt(op["prompt"])[: max(1, self.cap - op["params"]["max_new"])]
        if not prompt:
            return
        params = self._resolve_params(prompt, op["params"])
        request_id = op["request_id"]
        in_use = request_id is not None and self._holder(request_id) is not None
        try:
            got = self.engine.add_request(
                prompt,
                params,
                request_id=request_id,
                cache_salt=op.get("salt"),
                kv_cache_bits=op.get("kv_bits"),
            )
        except KVBoostError as exc:
            if in_use and "already in use" in str(exc):
                return
            self.fail(f"add_request refused a valid request ({len(prompt)} prompt tokens, {params}): {exc!r}")
        if in_use:
            self.fail(f"add_request accepted the id {request_id!r}, which a live request holds")
        self.salts.update([op["salt"]] if op.get("salt") else [])
        source = "solo" if op.get("kv_bits") else "add_request"
        self.coverage["reused_id"] += any(t.request_id == got for t in self.tracked)
        self.coverage["held_at_add"] += got in self.engine.core.deferred
        t = Tracked(got, prompt, params, self.op_index, source)
        self.tracked.append(t)
        self.by_op[self.op_index] = t
        self._check_engine(f"after adding {got!r}")

    def _readd(self, op: dict[str, Any]) -> None:
        """An ended request's id again (what a caller reusing its own ids does)."""
        ended = [
            t
            for t in self.tracked
            if t.status != "live" and t.source == "add_request" and self._holder(t.request_id) is None
        ]
        if not ended:
            return
        t = ended[-1] if op["pick"] < 0.5 else ended[int(op["pick"] * len(ended))]
        prompt = {"kind": "ids", "ids": t.prompt} if op["same_prompt"] else op["prompt"]
        self._add({"op": "add", "prompt": prompt, "params": op["params"], "request_id": t.request_id})

    def _abort(self, op: dict[str, Any]) -> None:
        core = self.engine.core
        target = op["target"]
        if target == "unknown":
            if self.engine.abort("never-added"):
                self.fail("abort() of an id never added returned True")
            return
        if target == "finished":
            ended = [t for t in self.tracked if t.status != "live" and self._holder(t.request_id) is None]
            if ended and self.engine.abort(ended[int(op["pick"] * len(ended))].request_id):
                self.fail("abort() of an ended request returned True")
            return
        if target == "last":  # right after its add, before any step
            if self.tracked and self.tracked[-1].status == "live":
                self._abort_live(self.tracked[-1])
            return
        candidates = self._live()
        if target == "preparing":  # a held or preparing request, when there is one
            held = [t for t in candidates if t.request_id in core.preparing or t.request_id in core.deferred]
            candidates = held or candidates
        if candidates:
            self._abort_live(candidates[int(op["pick"] * len(candidates))])

    def _abort_live(self, t: Tracked) -> None:
        queued: Request | None = self.engine.core.scheduler.find(t.request_id)
        self.coverage["aborted"] += 1
        if not self.engine.abort(t.request_id):
            self.fail(f"abort() of live {t.name} returned False")
        t.status = "aborted"
        if self.engine.core.knows(t.request_id):
            self.fail(f"aborted {t.name} is still known to the engine")
        if queued is not None and (queued.blocks or queued.status is not RequestStatus.FINISHED):
            self.fail(f"aborted {t.name} still holds {len(queued.blocks)} blocks ({queued.status.value})")
        self._check_engine(f"after aborting {t.name}")

    # ------------------------------------------------------------------------------------- engine calls
    def _step(self) -> None:
        self._route(self.engine.step())
        self._check_engine("after a step")

    def _steps(self, op: dict[str, Any]) -> None:
        for _ in range(op["n"]):
            self._step()

    def _run_idle(self, op: dict[str, Any]) -> None:
        busy = bool(self._live())
        steps = self.engine.run_idle(op["max_steps"])
        if busy and steps:
            self.fail(f"run_idle ran {steps} steps while a request was unfinished")
        self._check_engine("after run_idle")
        if not busy:
            self._check_quiescent("after run_idle")

    def _clear_cache(self, op: dict[str, Any]) -> None:
        idle = not self._live()
        self.engine.clear_cache()
        self._check_engine("after clear_cache")
        if idle:
            self._check_pool_empty("clear_cache on an idle engine")

    def _reset_cache(self, op: dict[str, Any]) -> None:
        idle = not self._live()
        try:
            self.engine.reset_cache()
        except CacheBusyError:
            if idle:
                self.fail("reset_cache refused an idle engine")
            return
        if not idle:
            self.fail(
                f"reset_cache accepted an engine with live requests {[t.request_id for t in self._live()]}"
            )
        self._check_engine("after reset_cache")
        self._check_pool_empty("reset_cache")

    def _generate(self, op: dict[str, Any]) -> None:
        ids = op["ids"][: self.cap - op["max_new"]]
        if ids:
            result = self.engine.generate(ids, max_new_tokens=op["max_new"], ignore_eos=True)
            # The workload's own requests keep running during a library call: their outputs are set aside.
            self._route(self.engine.take_unfollowed_outputs())
            self._track_library_result(ids, op["max_new"], result, "generate")
            self._check_engine("after generate")

    def _generate_batch(self, op: dict[str, Any]) -> None:
        prompts = [ids for ids in op["prompts"] if ids]
        if prompts:
            results = self.engine.generate_batch(prompts, max_new_tokens=op["max_new"], ignore_eos=True)
            self._route(self.engine.take_unfollowed_outputs())
            for ids, result in zip(prompts, results):
                self._track_library_result(ids, op["max_new"], result, "generate_batch")
            self._check_engine("after generate_batch")

    def _stream(self, op: dict[str, Any]) -> None:
        """A stream read for ``read`` events, then closed: finished, or aborted with nothing left behind."""
        if not op["ids"]:
            return
        stream = self.engine.stream(op["ids"], max_new_tokens=op["max_new"], ignore_eos=True)
        events = []
        try:
            for _ in range(op["read"]):
                event = next(stream, None)
                if event is None:
                    break
                events.append(event)
                if event.result is not None:
                    break
        finally:
            stream.close()
        self._route(self.engine.take_unfollowed_outputs())
        if events and events[-1].result is not None:
            result = events[-1].result
            if [tok for e in events for tok in e.token_ids] != result.output_ids:
                self.fail("a stream's token_ids do not add up to its result's output_ids")
            if "".join(e.delta_text for e in events) != result.output_text:
                self.fail("a stream's delta_text does not add up to its result's output_text")
            self._track_library_result(op["ids"], op["max_new"], result, "stream")
        elif self.engine.core.knows(stream.request_id):
            self.fail(f"the stream {stream.request_id!r} was closed, but its request is still unfinished")
        self._check_engine("after a stream")

    def _warm(self, op: dict[str, Any]) -> None:
        if op["ids"]:
            result = self.engine.warm(op["ids"])
            self._route(self.engine.take_unfollowed_outputs())
            if result.tokens != len(op["ids"]):
                self.fail(f"warm reported {result.tokens} tokens for a {len(op['ids'])}-token prompt")
            self._check_engine("after warm")

    def _next_token_logits(self, op: dict[str, Any]) -> None:
        ids = op["ids"][: self.cap]
        result = self.engine.next_token_logits(ids)
        self._route(self.engine.take_unfollowed_outputs())
        if not self.stitching:  # stitched logits are approximate by design
            diff = float((result.logits - self.world.forward(ids)[0][-1]).abs().max())
            if diff > ATOL:
                self.fail(
                    f"next_token_logits of a {len(ids)}-token prompt ({result.cached_tokens} cached) differ "
                    f"from a no-cache forward by {diff:.2e}"
                )
        self._check_engine("after next_token_logits")

    def _invalid(self, op: dict[str, Any]) -> None:
        """A request made invalid on purpose: a typed error, and nothing queued."""
        kind, engine = op["kind"], self.engine
        if kind == "duplicate_id" and not self._live():
            return
        before = (len(engine.core.scheduler.waiting), engine.core.running)
        try:
            if kind == "too_long":
                engine.add_request([7] * self.cap, SamplingParams(max_new_tokens=1))
            elif kind == "duplicate_id":
                engine.add_request(
                    [7, 8, 9], SamplingParams(max_new_tokens=2), request_id=self._live()[0].request_id
                )
            elif kind == "bad_stop":
                engine.add_request([7, 8, 9], SamplingParams.build(max_new_tokens=2, stop_token_ids=[10_000]))
            else:
                engine.add_request([], SamplingParams(max_new_tokens=2))
        except KVBoostError:
            if (len(engine.core.scheduler.waiting), engine.core.running) != before:
                self.fail(f"the rejected {kind} request left state behind")
            return
        self.fail(f"an invalid request ({kind}) was accepted")

    # -------------------------------------------------------------------------------------------- checks
    def _check_result(self, t: Tracked) -> None:
        """One finished request's outputs against its parameters."""
        r, p = t.result, t.params
        out = list(r.output_ids)
        streamed = [tok for o in t.outputs for tok in o.token_ids]
        if streamed != out:
            self.fail(f"{t.name}: streamed token_ids {streamed} do not add up to output_ids {out}")
        if "".join(o.delta_text for o in t.outputs) != r.output_text:
            self.fail(f"{t.name}: streamed delta_text does not add up to output_text {r.output_text!r}")
        if any(o.finished for o in t.outputs[:-1]):
            self.fail(f"{t.name}: more than one final output")
        self._check_logprobs(t)
        if not 1 <= len(out) <= p.max_new_tokens:
            self.fail(f"{t.name}: {len(out)} output tokens, max_new_tokens={p.max_new_tokens}")
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        early = [i for i, tok in enumerate(out[:-1]) if tok in stops]
        if early:
            self.fail(f"{t.name}: stop token {out[early[0]]} at position {early[0]} did not end it: {out}")
        if r.finish_reason == "length":
            if len(out) != p.max_new_tokens or out[-1] in stops:
                self.fail(
                    f"{t.name}: finish_reason 'length' after {len(out)} of {p.max_new_tokens} tokens {out}"
                )
        elif r.finish_reason == "stop":
            if out[-1] not in stops and r.stop_reason not in p.stop:
                self.fail(
                    f"{t.name}: finish_reason 'stop' with no stop token or string "
                    f"(stop_reason {r.stop_reason!r})"
                )
        else:
            self.fail(f"{t.name}: unexpected finish_reason {r.finish_reason!r}")
        if r.prompt_tokens != len(t.prompt) or not 0 <= r.cached_tokens <= r.prompt_tokens:
            self.fail(
                f"{t.name}: {r.cached_tokens} cached of {r.prompt_tokens} prompt tokens "
                f"for a {len(t.prompt)}-token prompt"
            )
        if r.chunks:
            spans = [(c.start, c.end) for c in r.chunks]
            if [s for s, _ in spans] != [0, *(e for _, e in spans[:-1])] or spans[-1][1] != r.prompt_tokens:
                self.fail(f"{t.name}: result.chunks {spans} do not tile the {r.prompt_tokens}-token prompt")
            if sum(c.cached_tokens for c in r.chunks) != r.cached_tokens:
                self.fail(f"{t.name}: the chunks' cached_tokens do not add up to {r.cached_tokens}")

    def _check_logprobs(self, t: Tracked) -> None:
        """Logprobs only when asked, one per generated token, naming it; alternatives best first; streamed
        ones add up to the result's."""
        r, k = t.result, t.params.logprobs
        streamed = [lp for o in t.outputs for lp in o.logprobs]
        if k is None:
            if r.logprobs is not None or streamed:
                self.fail(f"{t.name}: logprobs returned although none were asked for")
            return
        got = list(r.logprobs or ())
        if streamed != got:
            self.fail(f"{t.name}: streamed logprobs do not add up to the result's")
        # A stop string cut from the text takes the logprobs of the tokens after the cut with it (they
        # spell the returned text, Emitter.covered); every other output has one per token.
        cut = isinstance(r.stop_reason, str) and not t.params.include_stop_str_in_output
        named = [lp.token_id for lp in got]
        if named != list(r.output_ids)[: len(named) if cut else None]:
            self.fail(f"{t.name}: logprobs name tokens {named}, output {r.output_ids}")
        for i, lp in enumerate(got):
            values = [v for _, _, v in lp.top]
            if len(lp.top) != k or values != sorted(values, reverse=True) or not lp.logprob <= 1e-6:
                self.fail(f"{t.name}: logprobs at {i}: {lp} (asked for {k} alternatives, best first)")
            if values and lp.logprob > values[0] + ATOL:
                self.fail(f"{t.name}: the chosen token's logprob {lp.logprob} beats the best {values[0]}")

    def _check_engine(self, when: str) -> None:
        """Pool bookkeeping and the engine's view of the live requests (after every operation and step)."""
        engine, live = self.engine, self._live()
        scheduler, pool = engine.core.scheduler, engine.kv.pool
        stats = engine.paged_stats()
        if stats.running + stats.waiting != len(live) or engine.has_unfinished() != bool(live):
            self.fail(
                f"{when}: the engine has {stats.running} running + {stats.waiting} waiting requests "
                f"(has_unfinished={engine.has_unfinished()}), the workload {len(live)} live: "
                f"{[t.request_id for t in live]}"
            )
        owners: Counter[int] = Counter()
        for req in (*scheduler.running, *scheduler.waiting):
            if req.status is RequestStatus.WAITING and req.blocks:
                self.fail(f"{when}: waiting request {req.request_id!r} holds {len(req.blocks)} blocks")
            if len({b.id for b in req.blocks}) != len(req.blocks):
                self.fail(f"{when}: request {req.request_id!r} holds a block twice")
            owners.update(b.id for b in req.blocks)
        for block in pool.blocks:
            if block.ref_count != owners[block.id]:
                self.fail(
                    f"{when}: block {block.id} has ref_count {block.ref_count} but {owners[block.id]} "
                    "owner(s) among the engine's requests (leaked or released twice)"
                )
        unowned = {b.id for b in pool.blocks if b.ref_count == 0}
        free_queue = set(pool._free)  # what the pool hands out next: exactly the unowned blocks
        if free_queue != unowned:
            self.fail(
                f"{when}: the free queue disagrees with ref_count: unowned but not free "
                f"{sorted(unowned - free_queue)}, free but owned {sorted(free_queue - unowned)}"
            )
        cached = sum(pool.blocks[b].indexed for b in unowned)
        recount = (pool.num_blocks - len(unowned), cached, len(unowned) - cached)
        reported = (stats.blocks_used, stats.blocks_cached, stats.blocks_free)
        if reported != recount or sum(reported) != stats.blocks_total:
            self.fail(
                f"{when}: paged_stats (used, cached, free) = {reported} of {stats.blocks_total} blocks, "
                f"a recount of the pool gives {recount}"
            )
        before = self.last_stats
        for name in ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "steps"):
            if getattr(stats, name) < getattr(before, name):
                self.fail(f"{when}: {name} decreased from {getattr(before, name)} to {getattr(stats, name)}")
        if stats.prefix_cache_hits > stats.prefix_cache_queries:
            self.fail(
                f"{when}: {stats.prefix_cache_hits} prefix-cache hits > {stats.prefix_cache_queries} queries"
            )
        self.last_stats = stats

    def _check_tiers(self) -> None:
        """A disk tier wrote and read records without an error or a corrupt one."""
        for tier in self.engine.cache_stats().get("tiers", []):
            self.coverage["tier_hits"] += tier["hits"]
            self.coverage["tier_stores"] += tier["stores"]
            if tier["errors"] or tier["corrupt"]:
                self.fail(f"the {tier.get('name', 'lower')} tier counted errors: {tier}")

    def _check_quiescent(self, when: str) -> None:
        """Nothing unfinished: no block held but by the engine's own idle prompt, no queue entry left."""
        core, stats = self.engine.core, self.engine.paged_stats()
        idle = {
            b.id for r in (*core.scheduler.running, *core.scheduler.waiting) if r.internal for b in r.blocks
        }
        if stats.running or stats.waiting or stats.blocks_used != len(idle):
            self.fail(
                f"{when}: nothing is unfinished, yet {stats.running} running, {stats.waiting} waiting, "
                f"{stats.blocks_used} blocks used ({len(idle)} by the idle prompt): leaked blocks"
            )
        if core.preparing or core.deferred or core.solo:
            self.fail(f"{when}: nothing is unfinished, yet requests are left preparing, held or solo")

    def _check_pool_empty(self, when: str) -> None:
        stats = self.engine.paged_stats()
        if stats.blocks_used or stats.blocks_cached or self.engine.has_idle_work():
            self.fail(
                f"after {when}: {stats.blocks_used} blocks used, {stats.blocks_cached} cached, idle work "
                f"left: {self.engine.has_idle_work()} (expected an empty pool)"
            )

    def _check_exactness(self) -> None:
        """Finished requests served exactly (prefix hits or no cache) equal their solo no-cache runs."""
        for t in self.tracked:
            if t.status != "finished" or t.source == "solo":
                continue
            if _stitched(t.result):
                self.coverage["stitched"] += 1
                continue
            self.coverage["compared_exactly"] += 1
            expected, got = self.world.solo_run(t.prompt, t.params), t.result
            want, have = list(expected.output_ids), list(got.output_ids)
            if want == have:
                ends = (got.finish_reason, got.stop_reason, got.output_text)
                want_ends = (expected.finish_reason, expected.stop_reason, expected.output_text)
                if ends != want_ends:
                    self.fail(
                        f"{t.name}: same tokens as its solo no-cache run, but (finish_reason, stop_reason, "
                        f"text) {ends} != {want_ends}"
                    )
                self._compare_logprobs(t, expected)
                continue
            at = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            diverged = at < min(len(have), len(want))
            margin = self.world.top2_margin(t.prompt + want[:at]) if diverged else float("nan")
            if diverged and t.params.greedy and margin < NEAR_TIE:
                continue  # an fp32 tie between the top two tokens: either is a correct greedy choice
            mode = "greedy" if t.params.greedy else f"seeded sampling (seed {t.params.seed})"
            self.fail(
                f"{t.name}, {mode}, {len(t.prompt)} prompt tokens ({got.cached_tokens} cached): output_ids "
                f"differ from its solo no-cache run at position {at}: expected {want[at : at + 4]}, got "
                f"{have[at : at + 4]} (finish_reason expected {expected.finish_reason!r}, got "
                f"{got.finish_reason!r}; no-cache top-2 logit margin there {margin:.2e})"
            )

    def _compare_logprobs(self, t: Tracked, expected: GenerationResult) -> None:
        """The logprobs of a request served exactly equal those of its solo no-cache run (fp32)."""
        for i, (a, b) in enumerate(zip(t.result.logprobs or (), expected.logprobs or ())):
            pairs = [(a.logprob, b.logprob), *((x[2], y[2]) for x, y in zip(a.top, b.top))]
            diff = max(abs(x - y) for x, y in pairs)
            if diff > ATOL:
                self.fail(
                    f"{t.name}: logprobs at position {i} differ from its solo no-cache run by {diff:.2e} "
                    f"({t.result.cached_tokens} prompt tokens cached): {a} vs {b}"
                )
        self.coverage["logprobs_compared"] += t.params.logprobs is not None

    def _roots(self) -> set[ChunkHash]:
        """The chain roots: the engine's, and each salt's."""
        return {self.engine.root} | {salted_root(self.engine.root, salt) for salt in self.salts}

    def _check_pool_kv(self) -> None:
        """Every pool block reachable by an exact prefix hash holds the no-cache KV of its prefix: stitched
        (approximate) KV indexed under a prefix hash would be served to later requests as an exact hit."""
        pool, storage, roots = self.engine.kv.pool, self.engine.kv.storage, self._roots()
        for block in pool.blocks:
            if not block.indexed:
                continue
            prefix = _chain_tokens(block.token_ids, block.parent, pool.lookup, roots, pool.num_blocks)
            if prefix is None:
                continue
            n = len(block.token_ids)
            slots = torch.arange(block.id * pool.block_size, block.id * pool.block_size + n)
            self._expect_exact_kv(storage.read(slots), prefix, f"pool block {block.id} ({n} tokens)")

    def _check_store_kv(self) -> None:
        """Every exact chunk of the stitching store holds the no-cache KV of its prefix."""
        entries = self.engine.store._entries  # no public iteration over the store
        roots = self._roots()
        for entry in list(entries.values()):
            if not entry.exact or entry.encoded is not None:
                continue
            prefix = _chain_tokens(entry.token_ids, entry.parent, entries.get, roots, len(entries))
            if prefix is None:
                continue
            if len(prefix) != entry.start + entry.num_tokens:
                self.fail(
                    f"a stored chunk starts at {entry.start}, "
                    f"its chain puts it at {len(prefix) - entry.num_tokens}"
                )
            self._expect_exact_kv(
                entry.dense(), prefix, f"stored chunk at {entry.start} ({entry.num_tokens} tokens)"
            )

    def _expect_exact_kv(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], prefix: list[int], what: str
    ) -> None:
        """``layers`` (per layer ``(keys, values)`` of the last tokens of ``prefix``) equal a no-cache
        forward's."""
        cache = self.world.forward(prefix)[1]
        for i, (keys, values) in enumerate(layers):
            expected = cache.layers[i]
            if expected.keys.shape[2] != len(prefix):
                continue  # a sliding-window layer: the reference cache keeps only the window
            n = keys.shape[2]
            diff = max(
                float((keys - expected.keys[:, :, -n:]).abs().max()),
                float((values - expected.values[:, :, -n:]).abs().max()),
            )
            if diff > ATOL:
                self.fail(
                    f"{what}, reachable by an exact prefix hash of {len(prefix)} tokens, holds KV that "
                    f"differs from a no-cache forward by {diff:.2e} at layer {i}"
                )


def _chain_tokens(
    token_ids: Sequence[int], parent: Any, lookup: Callable[[Any], Any], roots: set[ChunkHash], bound: int
) -> list[int] | None:
    """The tokens of a block's (or chunk's) whole prefix: its own after those of the chain of parents
    ``lookup`` finds back to one of ``roots``; None when the chain breaks or outgrows the model's context."""
    prefix = list(token_ids)
    for _ in range(bound):  # a chain back to a root, or unreachable
        previous = None if parent in roots else lookup(parent)
        if previous is None:
            break
        prefix, parent = [*previous.token_ids, *prefix], previous.parent
    return prefix if parent in roots and len(prefix) <= MODEL_CONTEXT else None
