"""Summary, targets, markdown tables and plot of tools/bench_server.py's results (a JSON-safe dict).

Per server and concurrency: TTFT p50/p90 from turn 2 on, tokens/s of the phase, per-request decode tokens/s;
greedy replies compared between the servers; the issue's targets (kvboost / transformers) as met / missed.
"""

from __future__ import annotations

from pathlib import Path

from plotting import pyplot  # tools/ is on sys.path when a script here runs

SERVERS = ("kvboost", "transformers")
# The issue's targets (kvboost / transformers): concurrency >= 2 uses the 4- and 8-session targets.
MULTI_TTFT_MAX, MULTI_TOKENS_MIN = 0.5, 1.25
SINGLE_TTFT_MAX, SINGLE_DECODE_MIN = 0.8, 1.0
LIBRARY_MIN = 2.5


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, ``q`` in [0, 1]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(phase: dict) -> dict:
    ok = [r for r in phase["requests"] if r["error"] is None]
    later = [r["ttft_ms"] for r in ok if r["turn"] >= 2]
    decode = [r["decode_tokens_per_s"] for r in ok if r["decode_tokens_per_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "requests": len(phase["requests"]),
        "errors": len(phase["requests"]) - len(ok),
        "timed_out": phase["timed_out"],
        "ttft_ms_turn2plus": {"p50": percentile(later, 0.5), "p90": percentile(later, 0.9), "n": len(later)},
        "ttft_ms_turn1_p50": percentile([r["ttft_ms"] for r in ok if r["turn"] == 1], 0.5),
        "completion_tokens": tokens,
        "wall_s": phase["wall_s"],
        "tokens_per_s": tokens / phase["wall_s"],
        "decode_tokens_per_s_p50": percentile(decode, 0.5),
    }


def compare_replies(a: list[dict], b: list[dict]) -> dict:
    """Greedy replies of two servers for the same sessions. After a session's first differing turn the
    histories differ, so its later turns are still counted but no longer a like-for-like comparison."""
    replies_b = {(r["session"], r["turn"]): r["reply"] for r in b if r["error"] is None}
    compared = identical = 0
    sessions: dict[int, dict] = {}
    for r in sorted(a, key=lambda r: (r["session"], r["turn"])):
        other = replies_b.get((r["session"], r["turn"]))
        if r["error"] is not None or other is None:
            continue
        compared += 1
        same = r["reply"] == other
        identical += same
        entry = sessions.setdefault(
            r["session"], {"session": r["session"], "turns_compared": 0, "first_differing_turn": None}
        )
        entry["turns_compared"] += 1
        if not same and entry["first_differing_turn"] is None:
            entry["first_differing_turn"] = r["turn"]
    return {"identical": identical, "compared": compared, "sessions": list(sessions.values())}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(results: dict) -> list[dict]:
    def row(name: str, measured: float | None, threshold: float, at_most: bool) -> dict:
        met = None if measured is None else (measured <= threshold if at_most else measured >= threshold)
        return {"target": name, "measured": measured, "threshold": threshold, "met": met}

    out = []
    for c, by_server in results["summary"].items():
        kvb, tf = by_server.get("kvboost"), by_server.get("transformers")
        ttft = ratio(kvb and kvb["ttft_ms_turn2plus"]["p50"], tf and tf["ttft_ms_turn2plus"]["p50"])
        if int(c) == 1:
            out.append(
                row("1 session: TTFT p50 (turn>=2) kvboost/transformers <= 0.8x", ttft, SINGLE_TTFT_MAX, True)
            )
            decode = ratio(kvb and kvb["decode_tokens_per_s_p50"], tf and tf["decode_tokens_per_s_p50"])
            out.append(
                row("1 session: decode tok/s kvboost/transformers >= 1.0x", decode, SINGLE_DECODE_MIN, False)
            )
        else:
            out.append(
                row(
                    f"{c} sessions: TTFT p50 (turn>=2) kvboost/transformers <= 0.5x",
                    ttft,
                    MULTI_TTFT_MAX,
                    True,
                )
            )
            tokens = ratio(kvb and kvb["tokens_per_s"], tf and tf["tokens_per_s"])
            out.append(
                row(f"{c} sessions: tok/s kvboost/transformers >= 1.25x", tokens, MULTI_TOKENS_MIN, False)
            )
    library = results.get("library") or {}
    out.append(
        row(
            "library: generate_batch tok/s kvboost/transformers >= 2.5x",
            library.get("speedup_kvboost_over_transformers_cb"),
            LIBRARY_MIN,
            False,
        )
    )
    return out


def analyze(results: dict, sessions: list[int]) -> None:
    """Add ``summary``, ``identical_replies`` and ``targets`` to ``results`` (from its raw per-request records)."""
    servers = results["servers"]
    results["summary"] = {
        c: {name: summarize(srv["phases"][c]) for name, srv in servers.items() if c in srv.get("phases", {})}
        for c in sessions
    }
    both = [s for s in SERVERS if s in servers]
    results["identical_replies"] = {
        c: compare_replies(*(servers[s]["phases"][c]["requests"] for s in both))
        for c in sessions
        if len(both) == 2 and all(c in servers[s].get("phases", {}) for s in both)
    }
    results["targets"] = targets(results)


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(results: dict) -> None:
    cfg = results["config"]
    print(
        f"\n### Chat sessions: {cfg['turns']} turns x {cfg['max_tokens']} greedy tokens, shared "
        f"{cfg['system_chars']}-char system prompt, {cfg['threads']} torch thread(s) per server\n"
    )
    print(
        "| sessions | server | TTFT p50 t>=2 (ms) | TTFT p90 t>=2 (ms) | TTFT p50 t1 (ms) | tok/s | decode tok/s "
        "| errors |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for c, by_server in results["summary"].items():
        for name, s in by_server.items():
            print(
                f"| {c} | {name} | {fmt(s['ttft_ms_turn2plus']['p50'])} | {fmt(s['ttft_ms_turn2plus']['p90'])} | "
                f"{fmt(s['ttft_ms_turn1_p50'])} | {fmt(s['tokens_per_s'], '.2f')} | "
                f"{fmt(s['decode_tokens_per_s_p50'], '.2f')} | {s['errors']}{' (timed out)' if s['timed_out'] else ''} |"
            )
    for c, same in results["identical_replies"].items():
        differing = [
            f"s{e['session']}@t{e['first_differing_turn']}"
            for e in same["sessions"]
            if e["first_differing_turn"] is not None
        ]
        print(
            f"\n{c} sessions: identical replies {same['identical']}/{same['compared']}"
            + (f"; first differing turn per session: {', '.join(differing)}" if differing else "")
        )
    for name, server in results["servers"].items():
        if "error" in server:
            print(f"\n{name} server failed: {server['error'].splitlines()[0]}")
    lib = results.get("library")
    if lib and "error" not in lib:
        print(
            f"\n### Library: {lib['prompts']} prompts (~{lib['prompt_tokens_mean']:.0f} tokens, {lib['system_tokens']}"
            f"-token shared system prompt), {lib['max_new_tokens']} greedy tokens, 1 torch thread\n"
        )
        print("| API | tokens | wall (s) | tok/s | identical to generate |")
        print("|---|---:|---:|---:|---:|")
        for label, key, same in (
            ("KVBoost.generate_batch", "kvboost", "kvboost_identical_to_generate"),
            ("transformers generate_batch", "transformers_cb", "transformers_cb_identical_to_generate"),
            ("model.generate, one by one", "reference_generate", None),
        ):
            run = lib[key]
            ident = f"{lib[same]}/{lib['prompts']}" if same else "(reference)"
            print(
                f"| {label} | {run['tokens']} | {run['wall_s']:.1f} | {run['tokens_per_s']:.2f} | {ident} |"
            )
        print(
            f"\nKVBoost / transformers generate_batch: {lib['speedup_kvboost_over_transformers_cb']:.2f}x "
            f"(transformers' warm-up call on 2 tiny prompts took {lib['transformers_cb']['warmup_s']:.1f} s)"
        )
    elif lib:
        print(f"\nlibrary phase failed: {lib['error'].splitlines()[0]}")
    print("\n### Targets\n\n| target | measured | met |\n|---|---:|---|")
    for t in results["targets"]:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "missed")
        measured = "n/a" if t["measured"] is None else f"{t['measured']:.2f}x"
        print(f"| {t['target']} | {measured} | {met} |")


def plot(results: dict, path: Path) -> bool:
    """Draw TTFT and tokens/s by concurrency; False (nothing written) when no server phase ran."""
    if not any(results["summary"].values()):
        return False
    plt = pyplot(path)
    if plt is None:
        return False

    fig, (ax_ttft, ax_tok) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, color in zip(SERVERS, ("tab:blue", "tab:orange")):
        points = [(int(c), s[name]) for c, s in results["summary"].items() if name in s]
        if not points:
            continue
        xs = [c for c, _ in points]
        ax_ttft.plot(
            xs,
            [s["ttft_ms_turn2plus"]["p50"] for _, s in points],
            marker="o",
            color=color,
            label=f"{name} p50",
        )
        ax_ttft.plot(
            xs,
            [s["ttft_ms_turn2plus"]["p90"] for _, s in points],
            ls="--",
            color=color,
            alpha=0.6,
            label=f"{name} p90",
        )
        ax_tok.plot(xs, [s["tokens_per_s"] for _, s in points], marker="o", color=color, label=name)
    ax_ttft.set(
        xlabel="concurrent chat sessions", ylabel="TTFT from turn 2 (ms)", title="time to first token"
    )
    ax_tok.set(xlabel="concurrent chat sessions", ylabel="generated tokens / s", title="throughput")
    for ax in (ax_ttft, ax_tok):
        ax.set_xticks(sorted({int(c) for c in results["summary"]}))
        ax.legend()
    fig.suptitle("kvboost-server vs transformers serve --continuous-batching, SmolLM2-135M, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
