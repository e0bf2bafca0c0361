"""Every session of the project: tests, lint, typecheck, bench, demo, learn, fuzz, sglang.

``python3 -m nox -s tests`` is the test command (CI runs exactly it); ``python3 -m nox -s demo``
is the README's main job; ``python3 -m nox -s learn`` shows the loop learn (not part of tests).
"""

from __future__ import annotations

import pathlib

import nox

ROOT = pathlib.Path(__file__).parent
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False

PYTHON = "3.11"
# The CPU build of torch this machine kind ships; a range admitting newer releases would pull a
# multi-GB CUDA build on a CPU-only machine.
TORCH = "torch==2.13.0"
# The SGLang version the sglang backend's command lines are checked against (nox -s sglang).
SGLANG = "sglang==0.5.23"
# What sglang.srt.server_args imports besides torch: pure-Python or CPU packages (SGLang itself
# is installed without its dependencies, so none of its GPU stack, nor another torch, comes in).
SGLANG_IMPORTS = [
    "numpy",
    "msgspec",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "triton",
    "packaging",
    "pillow",
    "starlette",
    "pydantic",
    "pyzmq>=25.1.2",
    "tqdm",
    "ipython",
    "aiohttp",
]


def _local_distributions() -> list[str]:
    """Every plugin and contrib distribution in the repository (each has a pyproject.toml)."""
    dirs = sorted(ROOT.glob("plugins/*/pyproject.toml")) + sorted(
        ROOT.glob("contrib/*/pyproject.toml")
    )
    return [str(p.parent.relative_to(ROOT)) for p in dirs]


#: The build backend every local distribution names (pyproject.toml), installed once into the
#: session so that pip builds the ~20 editable distributions without a fresh isolated build
#: environment each (about a minute less on a 2-core machine; ``--no-build-isolation``).
BUILD = "setuptools>=70.1"


def _install_project(session: nox.Session, *extras: str) -> None:
    session.install(TORCH, BUILD)
    # `relax run --report` and `relax report` are the relax-report plugin's, one of the
    # distributions below.
    spec = f".[{','.join(extras)}]" if extras else "."
    args = ["-e", spec]
    for dist in _local_distributions():
        # Each distribution's own test extra (e.g. relax-hf's routers) comes with it.
        args += ["-e", f"{dist}[test]" if "test" in extras else dist]
    session.install("--no-build-isolation", *args)


def _install_test_environment(session: nox.Session) -> None:
    """What the test sessions (``tests``, ``e2e``) run on: every distribution with its test
    extra, the SGLang sources, and the plugin distributions kept under tests/, found through
    real entry-point discovery (a reward adapter and policy, and a fourth role, prm, added with
    no core change)."""
    _install_project(session, "test")
    _install_sglang_sources(session)
    session.install(
        "--no-build-isolation",
        "-e",
        "tests/plugins/relax-testplugin",
        "-e",
        "tests/plugins/relax-prm",
    )


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite: core, every plugin, cross-plugin integration (CI runs this)."""
    _install_test_environment(session)
    session.run("pytest", *(session.posargs or DEFAULT_SESSION))


#: The default session: every test but the slow end-to-end runs (marked ``e2e``: ``nox -s e2e``),
#: on two workers, one module per worker at a time (a module's shared Ray and engines start once).
DEFAULT_SESSION = ("-q", "-m", "not e2e", "-n", "2", "--dist", "loadfile", "--durations=30")


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """The slow end-to-end runs (not part of ``tests``; each names the faster test of the
    default session that covers its contract): a SIGSTOPped engine during an offload, kill -9
    of genrm ending a sync run with retries off, a run over two Ray nodes, Ctrl-C while genrm
    judges, the two residency runs."""
    _install_test_environment(session)
    session.run("pytest", *(session.posargs or ("-q", "-m", "e2e")))


#: relax-hf's constrained decoding (its ``grammar`` extra) and the SGLang release whose protocol
#: it mirrors, both installed WITHOUT their GPU stacks: xgrammar's and sglang's requirements pull
#: triton, CUDA kernels and another torch, none of which the tests import.
SGLANG_NO_DEPS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2", "sglang==0.5.23")
#: The pure-Python packages that xgrammar and SGLang's frontend language (``sglang.lang``,
#: which the hf engine's client tests run) import.
SGLANG_FRONTEND_DEPS = ("pydantic", "numpy", "msgspec", "pybase64", "requests", "tqdm", "ipython")


def _install_sglang_sources(session: nox.Session) -> None:
    session.install("--no-deps", *SGLANG_NO_DEPS)
    session.install(*SGLANG_FRONTEND_DEPS)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.17,<0.18")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on the core."""
    session.install("mypy>=1.11,<3", "-e", ".[test]")
    session.run("mypy")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every registered benchmark (``relax bench NAME --json``; ``relax bench`` lists them, one
    a line: name, description, distribution), an alias once; pass names to run only some."""
    _install_project(session, "test")
    listing = session.run("relax", "bench", silent=True) or ""
    names = session.posargs or [
        line.split()[0] for line in listing.splitlines() if line and "alias of" not in line
    ]
    for name in names:
        session.run("relax", "bench", name, "--json")
    if not session.posargs:
        session.run("relax-hf", "bench", "--json")


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The soak suite (not part of ``tests``): 20,000 requests at concurrency 512 through a role
    gateway in front of real engines, 10% of callers leaving mid-stream, one engine killed and
    rebuilt; fails on a replay, RSS growth >= 10%, file-descriptor growth or > 2% errors."""
    _install_project(session, "test")
    session.run("python", "-m", "tests.soak", *session.posargs)


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The chaos session (not part of ``tests``): an asynchronous CPU run of 100 steps with an
    engine killed (SIGKILL) or stopped (SIGSTOP), or the connections to the externally served
    teacher reset by a proxy (TCP RST), every few steps and the driver itself killed
    once and resumed (``relax run --resume``); fails on a lost sample, a sample trained twice or
    a step neither committed nor reported failed (``--steps``, ``--fault-every``, ``--seed``)."""
    _install_project(session, "test")
    session.run("python", "-m", "tests.chaos", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README's main job: ``relax run`` on the embedded default job (three roles on tiny hf
    models on CPU, a defer layout with a declared GPU, three steps)."""
    _install_project(session)
    session.run("relax", "demo", *session.posargs)


@nox.session(python=PYTHON)
def learn(session: nox.Session) -> None:
    """30 steps of ``relax run`` on a rule reward: the tiny policy's mean reward must rise
    clearly (the end-to-end proof that batches reach the trainer and weights reach rollout);
    then 30 steps of distillation alone (the reward weighted 0, a teacher's top-8): its KL to
    the teacher must fall clearly (the distillation stage's fields reach the trainer)."""
    _install_project(session)
    session.run("python", "-m", "tests.run.learn", *session.posargs)


@nox.session(python=PYTHON)
def install_route(session: nox.Session) -> None:
    """The README's pip route for real (not part of ``tests``): a fresh virtual environment,
    ``pip install -r requirements-local.txt``, ``relax demo`` and the agent example, each
    phase timed (``--json FILE`` keeps the times)."""
    session.run("python", "-m", "tests.install_route", *session.posargs)


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """schemathesis against each role gateway's OpenAPI document: no undocumented 5xx."""
    _install_project(session, "test")
    session.install("schemathesis>=4.0,<5")
    session.run("python", "-m", "tests.fuzz_gateways", *session.posargs)


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """Every command line the sglang backend builds, for every example job, parsed by SGLang's
    own ``prepare_server_args`` at the pinned version (CI runs this)."""
    session.install(TORCH)
    session.install("--no-deps", SGLANG)
    # The core and the plugins the examples need, without their heavy dependencies (Ray, the
    # routers): building a command line starts nothing.
    session.install(
        *SGLANG_IMPORTS,
        "attrs",
        "pluggy",
        "httptools",
        "prometheus-client",
        "uvicorn",
        "pytest>=8.2,<10",
        "pytest-timeout>=2.3,<3",
    )
    # relax-hf too: the relax run examples' models are hf ones (only sglang models' command
    # lines are checked, but every model of an example is planned).
    local = [".", "plugins/relax-sglang", "plugins/relax-hf"] + [
        f"plugins/relax-{role}" for role in ("rollout", "genrm", "teacher")
    ]
    session.install("--no-deps", *(arg for path in local for arg in ("-e", path)))
    session.run(
        "pytest",
        "-q",
        "plugins/relax-sglang/tests/test_sglang_parser.py",
        *session.posargs,
        env={"RELAX_REQUIRE_SGLANG": "1"},
    )
