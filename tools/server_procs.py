"""Server processes for tools/bench_server.py: kvboost-server and ``transformers serve``, one at a time.

Both bind 127.0.0.1 on a free port, get the same torch thread count through ``OMP_NUM_THREADS`` (neither
server sets its own: torch reads the variable when it starts) and ``HF_HUB_OFFLINE=1``. ``transformers
serve`` runs from its own venv (transformers pinned, torch the local CPU build), made once and reused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TORCH_PIN = "torch==2.13.0"  # the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build
TRANSFORMERS_VERSION = "5.23.0"
#: ``transformers serve`` needs fastapi, uvicorn and openai: the ``serving`` extra.
TRANSFORMERS_PIN = f"transformers[serving]=={TRANSFORMERS_VERSION}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """How to start one server and which ``model`` string its chat endpoint accepts."""

    name: str
    argv: tuple[str, ...]  # without --port, which is appended
    model_field: str
    python: str  # the interpreter of the server's environment (to record its versions)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningServer:
    """A started server: its base URL, the seconds until ``/health`` answered, and its log file."""

    url: str
    startup_s: float
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(threads: int) -> dict[str, str]:
    """Environment of a server process: its torch/OpenMP thread count, offline hub."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def kvboost_spec(
    model_path: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    extra: tuple[str, ...] = (),
) -> ServerSpec:
    """``python -m kvb_server`` (the ``kvboost-server`` entry point) of this interpreter's environment;
    ``device`` / ``dtype`` unset leave the server's defaults; ``extra``: more of its flags, as given."""
    argv = (
        sys.executable,
        "-m",
        "kvb_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
        *(("--device", device) if device else ()),
        *(("--dtype", dtype) if dtype else ()),
        *extra,
    )
    return ServerSpec(name="kvboost", argv=argv, model_field=model_path, python=sys.executable)


def transformers_spec(
    venv: Path,
    model_path: str,
    *,
    cb_max_memory_percent: float | None = None,
    device: str = "cpu",
    dtype: str | None = None,
) -> ServerSpec:
    """``transformers serve`` pinned to ``model_path`` (preloaded before ``/health`` answers).

    ``cb_max_memory_percent``: its paged cache's share of free memory (its default, 0.6-0.9, got the peer
    OOM-killed on a shared 24 GiB machine); None leaves its default.

    NOTE: a pinned server answers 400 unless a request's ``model`` is exactly the pinned string, so the
    folder path is sent as ``model`` (responses name it ``<path>@main``).
    """
    argv = (
        str(venv / "bin" / "transformers"),
        "serve",
        model_path,
        "--continuous-batching",
        "--device",
        device,
        *(("--dtype", dtype) if dtype else ()),
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
    )
    if cb_max_memory_percent is not None:
        argv = (*argv, "--cb-max-memory-percent", str(cb_max_memory_percent))
    return ServerSpec(
        name="transformers", argv=argv, model_field=model_path, python=str(venv / "bin" / "python")
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running(
    spec: ServerSpec, *, threads: int, log_dir: Path, startup_timeout_s: float
) -> Iterator[RunningServer]:
    """Start ``spec`` on a free loopback port, wait for ``/health``, stop it on exit (terminate, then kill).

    Raises:
        RuntimeError: the process exited or did not answer ``/health`` in ``startup_timeout_s``; the message
            holds the end of its log.
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{spec.name}-server.log"
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [*spec.argv, "--port", str(port)],
            env=server_env(threads),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() - t0 > startup_timeout_s:
                why = (
                    f"exited with {proc.returncode}"
                    if proc.poll() is not None
                    else f"no /health in {startup_timeout_s:.0f} s"
                )
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{spec.name} server {why}: {' '.join(spec.argv)}\n--- log tail ---\n{tail}"
                )
            time.sleep(0.5)
        yield RunningServer(url=url, startup_s=time.monotonic() - t0, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def torch_threads_seen(python: str, threads: int) -> int:
    """``torch.get_num_threads()`` of ``python`` started with :func:`server_env` (what each server computes with)."""
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.get_num_threads())"],
        env=server_env(threads),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(out.stdout.strip())


def versions(python: str) -> dict[str, str]:
    """torch / transformers versions importable by ``python``."""
    code = "import json, torch, transformers; print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__}))"
    out = subprocess.run(
        [python, "-c", code], env=server_env(1), capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout)


def ensure_transformers_venv(venv: Path) -> Path:
    """Create (once) a venv with the local CPU torch and ``transformers[serving]``; reuse it when it matches.

    torch is installed first and pinned, so resolving transformers never replaces it with a CUDA build.
    """
    transformers_cli = venv / "bin" / "transformers"
    if transformers_cli.exists():
        with contextlib.suppress(subprocess.SubprocessError, ValueError, KeyError):
            if versions(str(venv / "bin" / "python"))["transformers"] == TRANSFORMERS_VERSION:
                return venv
    logger.warning("creating %s (torch CPU + %s; a few minutes, once)", venv, TRANSFORMERS_PIN)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=600)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True, timeout=1800)
    subprocess.run([*pip, TORCH_PIN, TRANSFORMERS_PIN], check=True, timeout=1800)
    return venv


def save_results(results: dict, out: Path, plot: Callable[[dict, Path], bool], png_name: str) -> None:
    """Write a benchmark's ``results`` as JSON to ``out`` and its plot beside it (``plot`` returns False when
    matplotlib is missing), then say where, with the run's ``elapsed_s``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))  # paths in the config
    png = out.with_name(png_name)
    wrote = f"{out} and {png}" if plot(results, png) else str(out)
    print(f"\nwrote {wrote} ({results['elapsed_s']:.0f} s in all)")
