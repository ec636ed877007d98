"""Processes of the reliability harness: a ``kvboost-server`` and a ``redis-server``, loopback only.

Both bind 127.0.0.1 on a free port and are stopped by their own PID (never by name). A server can be
killed with SIGKILL and started again on the same flags (the same disk folder, the same Redis), and Redis
can be killed and restarted on the same port, for the fault runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def http_json(url: str, body: dict | None = None, *, timeout: float = 120.0) -> tuple[int, Any]:
    """``(status, parsed JSON or text)`` of a GET (no body) or a JSON POST; HTTP errors are returned."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Server:
    """One ``python -m kvb_server`` process; ``start`` / ``kill`` / ``stop`` may be repeated."""

    flags: tuple[str, ...]
    log_dir: Path
    name: str = "server"
    port: int = field(default_factory=free_port)
    threads: int | None = None
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvb_server",
            "--model",
            MODEL,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.flags,
        ]

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def start(self, timeout_s: float = 180.0) -> Server:
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as sink:
            self.proc = subprocess.Popen(
                self.argv,
                env=server_env(self.threads),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if http_json(self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"{self.name} did not start: {' '.join(self.argv)}\n{tail}")
            time.sleep(0.3)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush (what a crash or the OOM killer does)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM (graceful shutdown: requests finish, tier writes flushed), then SIGKILL after 60 s."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def rss_mb(self) -> float:
        """Resident set size of the server process (VmRSS), MiB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stats(self) -> dict:
        status, body = http_json(self.url + "/v1/stats", timeout=60)
        if status != 200:
            raise RuntimeError(f"/v1/stats answered {status}: {body}")
        return body

    def tier(self, name: str) -> dict:
        """The counters of tier ``name`` (``disk`` / ``redis``) from ``/v1/stats``."""
        for tier in self.stats()["tiers"] or []:
            if tier["name"] == name:
                return tier
        raise KeyError(name)

    def wait_idle(self, timeout_s: float = 120.0) -> dict:
        """``/v1/stats`` once nothing runs or waits (aborted requests are freed within a step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            q = stats["queue"]
            if (
                q["running"] == 0
                and q["waiting"] == 0
                and q["in_flight"] == 0
                and not stats["paged"]["running"]
            ):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.5)

    def complete(self, prompt: str, *, max_tokens: int = 4, timeout: float = 300.0) -> tuple[int, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return http_json(self.url + "/v1/completions", body, timeout=timeout)

    def reset_ram(self) -> dict:
        """Drop the RAM pool (``/v1/cache/reset`` without ``lower_tiers``): the next lookup reads the tiers."""
        status, body = http_json(self.url + "/v1/cache/reset", {}, timeout=60)
        if status != 200:
            raise RuntimeError(f"/v1/cache/reset answered {status}: {body}")
        return body


@dataclass
class Redis:
    """A throwaway ``redis-server`` (no persistence): killing it loses every record."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def binary() -> str | None:
        return shutil.which("redis-server")

    def start(self, timeout_s: float = 20.0) -> Redis:
        import redis

        binary = self.binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client, deadline = self.client(), time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def filler_text(seed: int, words: int) -> str:
    """Deterministic prose-like text (distinct per ``seed``); ~3 tokens a word on SmolLM2."""
    import random

    rng = random.Random(seed)
    vocab = [
        "cache", "block", "river", "engine", "stone", "window", "garden", "signal", "paper", "orbit",
        "lantern", "meadow", "copper", "violet", "harbor", "thunder", "pencil", "marble", "falcon", "summit",
    ]  # fmt: skip
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(words))
