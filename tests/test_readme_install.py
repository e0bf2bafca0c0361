"""The README's ``pip install`` route to the ``relax`` command installs what ``nox -s demo``
installs: the same torch pin and every local distribution, each one a real distribution pip
can resolve, without a slow full install.

What ``nox -s demo`` installs is read from noxfile.py itself: its ``demo`` session runs against
a recording session (nox is replaced by a stub while the noxfile is loaded, so nox need not be
installed here).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: pip install as a check: resolve and prepare metadata only, from local paths only, with this
#: environment's setuptools, whatever is installed already; ``--report`` says what it would do.
DRY_RUN = (
    "--dry-run",
    "--no-deps",
    "--no-index",
    "--no-build-isolation",
    "--ignore-installed",
    "--report",
)


def _quickstart_install() -> list[list[str]]:
    """The README's pip-route line (beside the quickstart), as the commands it chains with
    ``&&``; the quickstart itself keeps exactly its two nox commands."""
    text = (ROOT / "README.md").read_text()
    quickstart = text[text.index("\n## Quickstart\n") :]
    quickstart = quickstart[: quickstart.index("\n## ", 1)]
    first, *others = re.findall(r"^```bash\n(.*?)^```$", quickstart, re.M | re.S)
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "python3 -m pip install nox && python3 -m nox -s demo",
        "python3 -m pip install nox && python3 -m nox -s tests",
    ]
    (line,) = [line for block in others for line in block.splitlines() if "pip install -r" in line]
    return [shlex.split(part) for part in line.split("&&")]


def _requirements_file() -> Path:
    (install,) = [c for c in _quickstart_install() if c[1:4] == ["-m", "pip", "install"]]
    return ROOT / install[install.index("-r") + 1]


def _entries(lines: list[str]) -> list[tuple[bool, str]]:
    """``(editable, requirement or path)`` of each requirement line, comments left out."""
    out = []
    for raw in lines:
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        parts = shlex.split(line)
        editable = parts[0] == "-e"
        out.append((editable, parts[-1]))
    return out


def _local(entry: str) -> Path | None:
    """The directory a requirement names (``.``, ``./plugins/x``, ``plugins/x``, each perhaps
    with extras: ``.[report]``), or None."""
    if entry.startswith((".", "/")) or "/" in entry:
        return (ROOT / re.sub(r"\[[\w,-]+\]$", "", entry)).resolve()
    return None


def _extras(entry: str) -> str:
    """A requirement's extras as written (``[report]``), or ``""``."""
    found = re.search(r"\[[\w,-]+\]$", entry)
    return found.group(0) if found else ""


class _Recorder:
    """A nox session that records what it is asked to install and runs nothing."""

    posargs: list[str] = []

    def __init__(self) -> None:
        self.installed: list[str] = []

    def install(self, *args: str) -> None:
        self.installed += args

    def run(self, *args: str, **kwargs: Any) -> None:
        pass


@pytest.fixture
def noxfile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """noxfile.py, loaded with a stub ``nox`` (its decorators leave the sessions as functions)."""
    stub = ModuleType("nox")
    stub.options = SimpleNamespace()  # type: ignore[attr-defined]
    stub.session = lambda **_: lambda fn: fn  # type: ignore[attr-defined]
    stub.Session = _Recorder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("relax_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_installs(noxfile: ModuleType) -> tuple[set[str], set[tuple[bool, Path, str]]]:
    """What ``nox -s demo`` installs: its requirements and its ``(editable, directory,
    extras)``s. The session's build backend (``noxfile.BUILD``, so that pip builds the local
    distributions without an isolated build environment each) and pip's own options are how
    it installs, not what: a pip reading the requirements file builds them in isolation."""
    session = _Recorder()
    noxfile.demo(session)
    specs: set[str] = set()
    local: set[tuple[bool, Path, str]] = set()
    args = iter(a for a in session.installed if a != noxfile.BUILD and not a.startswith("--"))
    for arg in args:
        editable = arg == "-e"
        entry = next(args) if editable else arg
        path = _local(entry)
        if path is None:
            specs.add(entry)
        else:
            local.add((editable, path, _extras(entry)))
    return specs, local


def test_the_readme_pip_route_line_installs_the_requirements_file_then_runs_relax_demo() -> None:
    # This reads the README's line; `nox -s install_route` (tests/install_route.py) runs it.
    commands = _quickstart_install()
    assert commands[-1] == ["relax", "demo"]
    assert _requirements_file().is_file()


def test_the_requirements_pin_torch_as_the_nox_sessions_do(noxfile: ModuleType) -> None:
    entries = _entries(_requirements_file().read_text().splitlines())
    remote = [entry for editable, entry in entries if _local(entry) is None]
    assert remote == [noxfile.TORCH] == ["torch==2.13.0"]


def test_every_local_path_of_the_requirements_is_a_distribution() -> None:
    for _, entry in _entries(_requirements_file().read_text().splitlines()):
        path = _local(entry)
        if path is not None:
            project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
            assert project["name"], entry


def test_the_requirements_cover_everything_the_nox_demo_session_installs(
    noxfile: ModuleType,
) -> None:
    specs, local = _demo_installs(noxfile)
    entries = _entries(_requirements_file().read_text().splitlines())
    assert {e for _, e in entries if _local(e) is None} == specs
    assert {
        (editable, _local(e), _extras(e)) for editable, e in entries if _local(e) is not None
    } == local
    # The core, and every plugin and contrib distribution of the repository.
    dirs = [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("contrib/*/pyproject.toml")]
    assert {path for _, path, _ in local} == {ROOT} | {p.parent.resolve() for p in dirs}


def test_pip_resolves_every_local_distribution_of_the_requirements(tmp_path: Path) -> None:
    """pip itself reads the file (from the repository root, as the README runs it) and
    prepares each local distribution's metadata: a dry run, no index, no dependencies. The
    torch pin is left out (nothing is fetched here; its pin is checked above)."""
    lines = _requirements_file().read_text().splitlines()
    local_only = tmp_path / "local.txt"
    local_only.write_text(
        "\n".join(line for line in lines if not re.match(r"\s*torch\b", line)) + "\n"
    )
    report = tmp_path / "report.json"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", *DRY_RUN, str(report), "-r", str(local_only)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    installs = json.loads(report.read_text())["install"]
    got = {item["metadata"]["name"]: item["download_info"]["url"] for item in installs}
    want = {}
    for _, entry in _entries(lines):
        path = _local(entry)
        if path is not None:
            name = tomllib.loads((path / "pyproject.toml").read_text())["project"]["name"]
            want[name] = path.as_uri()
    assert got == want
