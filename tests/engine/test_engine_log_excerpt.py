"""An engine that fails to start says why: its error quotes the last traceback of its own log.

The unit tests read real log text (an hf engine's uvicorn start-up failure, as written); the
last test starts the real ``hf`` engine on a model it cannot load.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_core.engine._logtail import excerpt, quote_log
from relax_core.engine.process import SubprocessEngineProcess
from relax_core.errors import LifecycleError
from relax_core.records import EngineLaunchSpec

#: What the hf engine wrote when its model directory named an unknown ``model_type``.
UVICORN_STARTUP_FAILURE = """\
relax-hf: serving /models/broken on cpu at http://127.0.0.1:60727
[transformers] You are using a model of type `no-such-arch` to instantiate a model of type ``.
ERROR:    Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/transformers/models/auto/configuration_auto.py", line 438, in from_pretrained
    config_class = CONFIG_MAPPING[config_dict["model_type"]]
                   ~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/transformers/models/auto/configuration_auto.py", line 117, in __getitem__
    raise KeyError(key)
KeyError: 'no-such-arch'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/starlette/routing.py", line 661, in lifespan
    async with self.lifespan_context(app) as maybe_state:
  File "/relax/plugins/relax-hf/relax_hf/server.py", line 495, in lifespan
    runner = await asyncio.to_thread(ModelRunner.from_config, config)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/transformers/models/auto/auto_factory.py", line 340, in from_pretrained
    config, kwargs = AutoConfig.from_pretrained(
                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/transformers/models/auto/configuration_auto.py", line 440, in from_pretrained
    raise ValueError(
ValueError: The checkpoint you are trying to load has model type `no-such-arch` but Transformers does not recognize this architecture.

You can update Transformers with the command `pip install --upgrade transformers`.

ERROR:    Application startup failed. Exiting.
"""  # noqa: E501


def test_a_uvicorn_startup_failure_quotes_the_last_exception_and_its_last_frames() -> None:
    lines, from_traceback = excerpt(UVICORN_STARTUP_FAILURE)
    assert from_traceback
    assert lines == [
        '  File "/venv/lib/python3.11/site-packages/transformers/models/auto/auto_factory.py", '
        "line 340, in from_pretrained",
        "    config, kwargs = AutoConfig.from_pretrained(",
        '  File "/venv/lib/python3.11/site-packages/transformers/models/auto/configuration_auto.py"'
        ", line 440, in from_pretrained",
        "    raise ValueError(",
        "ValueError: The checkpoint you are trying to load has model type `no-such-arch` but "
        "Transformers does not recognize this architecture.",
        "… ERROR:    Application startup failed. Exiting.",
    ]


def test_a_log_without_a_traceback_quotes_its_last_non_empty_lines() -> None:
    log = "loading\n" + "".join(f"step {i}\n" for i in range(10)) + "\nerror: no GPU left\n\n"
    lines, from_traceback = excerpt(log)
    assert not from_traceback
    assert lines == ["step 6", "step 7", "step 8", "step 9", "error: no GPU left"]


def test_quoted_lines_lose_terminal_colours_and_are_cut_short() -> None:
    lines, _ = excerpt("\x1b[31mERROR\x1b[0m: " + "x" * 1000 + "\n")
    assert lines[0].startswith("ERROR: xxx") and len(lines[0]) == 300 and lines[0][-1] == "…"


def test_a_traceback_every_line_of_which_a_forwarder_prefixed_is_read_without_the_prefix() -> None:
    log = "".join(
        f"(pid=42) {line}\n"
        for line in [
            "Traceback (most recent call last):",
            '  File "engine.py", line 3, in <module>',
            "    load()",
            "RuntimeError: CUDA out of memory",
        ]
    )
    assert excerpt(log) == (
        [
            '  File "engine.py", line 3, in <module>',
            "    load()",
            "RuntimeError: CUDA out of memory",
        ],
        True,
    )


def test_quote_log_names_the_log_and_indents_each_quoted_line(tmp_path: Path) -> None:
    log = tmp_path / "judge_replica-0-gen1.log"
    log.write_text(UVICORN_STARTUP_FAILURE)
    quoted = quote_log(str(log))
    first, *rest = quoted.splitlines()
    assert first == f"last error in its log ({log}):"
    assert len(rest) == 6 and all(line.startswith("    ") for line in rest)
    assert "ValueError: The checkpoint" in rest[4]


def test_quote_log_says_when_the_log_is_empty_or_missing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("\n\n")
    assert quote_log(str(empty)) == f"its log ({empty}) is empty"
    missing = tmp_path / "missing.log"
    assert quote_log(str(missing)) == (
        f"its log ({missing}) cannot be read: No such file or directory"
    )
    assert quote_log(None) == "it wrote no log"


def test_only_the_end_of_a_long_log_is_read(tmp_path: Path) -> None:
    log = tmp_path / "long.log"
    with log.open("w") as f:
        f.write("Traceback (most recent call last):\nOldError: long gone\n")
        f.write("noise\n" * 50_000)
        f.write("ready to die\n")
    assert quote_log(str(log)).splitlines()[1:] == ["    noise"] * 4 + ["    ready to die"]


# -- a real engine that fails at start -----------------------------------------------------------


@pytest.fixture
def unloadable_model(tmp_path: Path) -> Path:
    """A tiny hf model whose config.json is valid JSON naming a ``model_type`` nobody knows."""
    from tests.support.manager import tiny_model

    model = tmp_path / "unloadable"
    shutil.copytree(tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "no-such-arch"
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture
def procs() -> Iterator[list[SubprocessEngineProcess]]:
    started: list[SubprocessEngineProcess] = []
    yield started
    for p in started:
        p.kill()


def test_the_hf_engine_failing_at_start_raises_with_its_exception_and_log_path(
    unloadable_model: Path, tmp_path: Path, procs: list[SubprocessEngineProcess]
) -> None:
    from relax_hf.plugin import launch

    log = tmp_path / "judge_replica-0-gen1.log"
    p = launch(
        EngineLaunchSpec(
            engine_id="judge/replica-0", model_path=str(unloadable_model), log_path=str(log)
        )
    )
    procs.append(p)
    with pytest.raises(LifecycleError) as info:
        p.wait_ready(120)
    msg = str(info.value)
    assert "judge/replica-0" in msg and "before it was ready" in msg
    assert f"last error in its log ({log}):" in msg
    assert "ValueError: The checkpoint you are trying to load has model type `no-such-arch`" in msg
    assert len(msg.splitlines()) <= 8
    assert p.poll() is not None
