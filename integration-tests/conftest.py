"""Shared fixtures for cross-package tests on the embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

#: Model loads take minutes on an oversubscribed CPU.
SERVER_START_TIMEOUT_S = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(module: str, *flags: str, log: Path | None = None) -> Iterator[str]:
    """``python -m MODULE FLAGS --port P`` on a free loopback port (2 torch threads; stderr to ``log`` when
    given); waits for ``/health`` and yields the base URL; terminates the process afterwards."""
    port = free_port()
    command = [sys.executable, "-m", module, *flags, "--port", str(port)]
    with contextlib.ExitStack() as stack:
        err = stack.enter_context(open(log, "wb")) if log is not None else None
        proc = subprocess.Popen(command, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "2"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    tail = log.read_text()[-3000:] if log is not None else ""
                    raise AssertionError(f"server exited with {proc.returncode}: {tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvb_cache.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """``(model, tokenizer)``, fp32 on CPU."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return model, tokenizer


@pytest.fixture(autouse=True)
def _free_engines() -> Iterator[None]:
    """Collect after each test: an engine's block pool (2 GiB by default) is held by reference cycles, so
    without a collection the pools of finished tests pile up in this one process."""
    yield
    gc.collect()
