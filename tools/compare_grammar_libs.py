"""xgrammar vs llguidance on this machine's tokenizers: compile time, mask time per token, correctness.

Tokenizers: the embedded SmolLM2's, plus two trained here on this venv's Python sources (no download): a
GPT-2-style byte-level BPE (50,257) and a Llama-style Metaspace BPE with byte fallback (32,000, pieces of at
most 16 characters as SentencePiece makes them). Both libraries compile compact JSON (no optional
whitespace). Per tokenizer and library:

* compile: time from schema to a ready matcher (xgrammar: ``GrammarCompiler.compile_json_schema`` with its
  cache off; llguidance: ``grammar_from_json_schema`` + ``LLMatcher``), median/max over the schemas;
* mask: time to fill one token bitmask, p50/p99 over every step of teacher-forced valid instances and of
  random constrained walks;
* correctness: every token of a valid instance accepted; random walks (uniform over allowed tokens, biased to
  close) that finish parse and validate with jsonschema; keywords a library cannot enforce (``not``,
  ``uniqueItems``, ``if``/``then``, look-around in ``pattern``) are refused, or ignored (outputs then
  violate the schema: counted over 30 walks).

Needs ``pip install xgrammar llguidance jsonschema``. Run: ``python tools/compare_grammar_libs.py``.
"""

from __future__ import annotations

import glob
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SMOLLM2 = Path.home() / ".cache" / "kvboost" / "smollm2-135m-instruct"
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["id", "tags"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    "bounds": {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["p", "n"],
    },
    "anyof": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}},
        "required": ["v"],
    },
    "pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["date", "code"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 8},
            "b": {"type": "integer"},
            "c": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
        },
        "required": ["a"],
    },
    "wide": {
        "type": "object",
        "properties": {f"f{i}": {"type": ["string", "integer", "null"]} for i in range(30)},
        "required": [f"f{i}" for i in range(0, 30, 3)],
    },
}
INSTANCES = {
    "flat": {"name": "Ada", "age": 36},
    "nested": {"user": {"id": 3, "tags": ["a", "bc"]}, "ok": True},
    "enum": {"color": "green", "size": "M"},
    "bounds": {"p": 0.25, "n": -3},
    "anyof": {"v": "abc"},
    "pattern": {"date": "2024-01-31", "code": "ABC"},
    "optional": {"a": "xy", "c": [1.5]},
    "wide": {f"f{i}": (i if i % 2 else "s") for i in range(0, 30, 3)},
}
UNENFORCEABLE = {
    "not": {"not": {"type": "string"}},
    "uniqueItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 3},
        "uniqueItems": True,
        "minItems": 3,
    },
    "lookahead pattern": {"type": "string", "pattern": "^(?=b)[ab]{3}$"},
    "if/then": {"type": "integer", "if": {"minimum": 0}, "then": {"multipleOf": 7}},
}


def _corpus(limit: int = 15_000_000):
    site = Path(json.__file__).parent.parent if "site-packages" not in sys.prefix else Path(sys.prefix)
    files = sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.py", recursive=True)) or sorted(
        glob.glob(f"{site}/**/*.py", recursive=True)
    )
    size = 0
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size += len(text)
        yield text
        if size > limit:
            return


def local_tokenizers() -> dict:
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=50257,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    llama = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    llama.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    llama.decoder = decoders.Sequence(
        [
            decoders.Metaspace(replacement="▁", prepend_scheme="first"),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    llama.train_from_iterator(
        _corpus(5_000_000),
        trainers.BpeTrainer(
            vocab_size=32000, special_tokens=specials, max_token_length=16, show_progress=False
        ),
    )
    data = json.loads(llama.to_str())
    # Byte tokens are ordinary vocabulary entries in Llama (byte fallback), not added tokens.
    data["added_tokens"] = [a for a in data["added_tokens"] if not a["content"].startswith("<0x")]
    llama = Tokenizer.from_str(json.dumps(data))
    return {
        "gpt2-style BPE": T.PreTrainedTokenizerFast(tokenizer_object=gpt2, eos_token="<|endoftext|>"),
        "llama-style BPE": T.PreTrainedTokenizerFast(
            tokenizer_object=llama, eos_token="</s>", bos_token="<s>", unk_token="<unk>"
        ),
    }


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.init_s = time.perf_counter() - t0
        self.vocab = vocab

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return grammar, time.perf_counter() - t0

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.init_s = time.perf_counter() - t0
        self.vocab = vocab

    def compile(self, schema):
        t0 = time.perf_counter()
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        elapsed = time.perf_counter() - t0
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])
        return grammar, elapsed

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, matcher, bitmask) -> None:
        row = bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def _allowed(bitmask, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.nonzero(bits)[0]


def _walk(lib, grammar, tok, eos, closing, rng, bitmask, masks, max_steps=200):
    matcher, out = lib.matcher(grammar), []
    for _ in range(max_steps):
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask)
        masks.append(time.perf_counter() - t0)
        allowed = _allowed(bitmask, lib.vocab)
        if eos in allowed and (rng.random() < 0.7 or len(allowed) == 1):
            return tok.decode(out)
        allowed = [t for t in allowed if t != eos]
        close = [t for t in allowed if t in closing]
        token = int(rng.choice(close if close and rng.random() < 0.5 else allowed))
        assert lib.accept(matcher, token)
        out.append(token)
    return None


def compare(walks: int = 20) -> list[dict]:
    import jsonschema
    import torch
    import transformers as T

    tokenizers = {"SmolLM2 (49,152)": T.AutoTokenizer.from_pretrained(SMOLLM2), **local_tokenizers()}
    rows = []
    for tok_name, tok in tokenizers.items():
        vocab, eos = len(tok), tok.eos_token_id
        closing = {i for i in range(vocab) if any(c in tok.decode([i]) for c in '"}],')}
        for lib_cls in (_XGrammar, _LLGuidance):
            lib = lib_cls(tok, vocab)
            bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
            compile_s, masks, valid, finished, rejected = [], [], 0, 0, 0
            rng = random.Random(0)
            for name, schema in SCHEMAS.items():
                grammar, seconds = lib.compile(schema)
                compile_s.append(seconds)
                text = json.dumps(INSTANCES[name], separators=(",", ":"))
                ids = tok("a" + text, add_special_tokens=False)["input_ids"]
                ids = [*next(ids[k:] for k in range(len(ids)) if tok.decode(ids[k:]) == text), eos]
                matcher = lib.matcher(grammar)
                for token in ids:
                    t0 = time.perf_counter()
                    lib.fill(matcher, bitmask)
                    masks.append(time.perf_counter() - t0)
                    if not lib.accept(matcher, token):
                        rejected += 1
                        break
                for _ in range(walks):
                    text = _walk(lib, grammar, tok, eos, closing, rng, bitmask, masks)
                    if text is not None:
                        finished += 1
                        try:
                            jsonschema.validate(json.loads(text), schema)
                            valid += 1
                        except (ValueError, jsonschema.ValidationError):
                            pass
            unenforced = {}
            for name, schema in UNENFORCEABLE.items():
                try:
                    grammar, _ = lib.compile(schema)
                except Exception as e:
                    unenforced[name] = "refused: " + str(e).splitlines()[0][-60:]
                    continue
                texts = [_walk(lib, grammar, tok, eos, closing, rng, bitmask, []) for _ in range(30)]
                bad = 0
                for text in texts:
                    try:
                        jsonschema.validate(json.loads(text), schema)
                    except (TypeError, ValueError, jsonschema.ValidationError):
                        bad += 1
                unenforced[name] = f"accepted: {bad}/30 outputs invalid"
            us = np.array(masks) * 1e6
            rows.append(
                {
                    "tokenizer": tok_name,
                    "library": lib.name,
                    "tokenizer_init_ms": lib.init_s * 1e3,
                    "compile_ms_median": statistics.median(compile_s) * 1e3,
                    "compile_ms_max": max(compile_s) * 1e3,
                    "mask_us_p50": float(np.percentile(us, 50)),
                    "mask_us_p99": float(np.percentile(us, 99)),
                    "valid_instances_rejected": rejected,
                    "walks_finished": finished,
                    "walks_valid": valid,
                    "unenforceable": unenforced,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    import torch

    torch.set_num_threads(1)
    rows = compare()
    print(
        "\n| tokenizer | library | compile ms median / max | mask us p50 / p99 | valid instances rejected | finished walks valid |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokenizer']} | {r['library']} | {r['compile_ms_median']:.1f} / {r['compile_ms_max']:.1f} | "
            f"{r['mask_us_p50']:.0f} / {r['mask_us_p99']:.0f} | {r['valid_instances_rejected']} | "
            f"{r['walks_valid']}/{r['walks_finished']} |"
        )
    print()
    for r in rows:
        print(r["tokenizer"], r["library"], r["unenforceable"])
    out = Path(__file__).resolve().parent.parent / "docs" / "compare_grammar_libs.json"
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
