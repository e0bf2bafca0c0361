"""Helpers of the tests that run a doc's walkthrough as written: a section of a Markdown page,
its fenced blocks, the files it shows (each block whose first line is ``# <path>``), the shell
commands it runs, and its distribution installed from those files into a private directory
(``pip install --target``, no build isolation, no index: the shared environment is never
touched), found by ``relax`` subprocesses through real entry-point discovery on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What a test adds to a walkthrough's ``pip install``: the distribution alone, built with
#: this environment's setuptools, nothing fetched, installed into a directory of the test.
ISOLATED = ("--no-deps", "--no-build-isolation", "--no-index", "--target")


def section(page: str, title: str) -> str:
    """The text of ``docs/<page>``'s ``## <title>`` section, up to the next ``## ``."""
    text = (ROOT / "docs" / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of language ``lang`` in ``text``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def files(text: str) -> dict[str, str]:
    """Every file ``text`` shows: path (its block's ``# path`` first line) -> its text."""
    out: dict[str, str] = {}
    for lang in ("toml", "python"):
        for block in blocks(text, lang):
            first = block.splitlines()[0]
            if re.fullmatch(r"# [\w./-]+\.(toml|py)", first):
                out[first[2:]] = block
    return out


def commands(text: str, program: str) -> list[list[str]]:
    """The ``bash`` lines of ``text`` that run ``program``, split as the shell splits them."""
    return [
        shlex.split(line, comments=True)
        for block in blocks(text, "bash")
        for line in block.splitlines()
        if line.startswith(f"{program} ")
    ]


def pythonpath(site: Path) -> str:
    """``site`` first on ``PYTHONPATH``, what was there after it."""
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def install(text: str, root: Path, *, skip: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Write the distribution ``text`` shows under ``root`` and install it as its ``pip
    install ./DIR`` line says, into ``root/site``; ``(its source directory, site)``. Files in
    ``skip`` (a job file) are not part of it."""
    (line,) = [c for c in commands(text, "pip") if c[1] == "install"]
    source = root / line[-1]
    for path, body in files(text).items():
        if path not in skip:
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            (source / path).write_text(body)
    site = root / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", *line[1:-1], *ISOLATED, str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return source, site


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(site)}


def own_tests_pass(source: Path, site: Path, *, passed: int = 1) -> None:
    """The installed distribution's own tests (``source/tests``) pass: ``passed`` of them."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=source,
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{passed} passed" in out.stdout


def plugins_row(site: Path, name: str) -> list[str]:
    """``relax plugins``' row of ``name`` with ``site`` on the path, split in words."""
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "plugins"],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (row,) = [line.split() for line in out.stdout.splitlines() if name in line]
    return row


def write_job(text: str, directory: Path, job: str) -> None:
    """Write the section's job file into ``directory`` and run its ``relax-hf`` commands there
    (the tiny models it names)."""
    (directory / job).write_text(files(text)[job])
    for command in commands(text, "relax-hf"):
        made = subprocess.run(
            [sys.executable, "-m", "relax_hf", *command[1:]],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert made.returncode == 0, made.stderr


def job_command(text: str, directory: Path, job: str) -> list[str]:
    """:func:`write_job`, then the section's one ``relax run`` command, checked to run ``job``
    with ``--json``."""
    write_job(text, directory, job)
    (command,) = commands(text, "relax run")
    assert command[:3] == ["relax", "run", job] and "--json" in command
    return command
