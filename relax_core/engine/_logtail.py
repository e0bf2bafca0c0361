"""What a start-up error quotes from an engine's log: the last traceback's last frames and its
exception (plus the log's last line when something followed it), else the log's last non-empty
lines; always bounded and naming the log file."""

from __future__ import annotations

import os
import re

#: How much of the log's end is searched for the last traceback.
_READ_BYTES = 64 * 1024
#: Frames of the last traceback quoted (each: its ``File …`` line and its source line).
_FRAMES = 2
#: Lines of the exception quoted (its first line and what continues it, up to a blank line).
_EXCEPTION_LINES = 3
#: Non-empty lines quoted from a log without a traceback.
_LAST_LINES = 5
#: Characters kept of each quoted line.
_LINE_CHARS = 300

_HEADER = "Traceback (most recent call last):"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: The caret and tilde lines Python draws under a frame's source line.
_MARKERS = re.compile(r"^[\s^~]+$")


def _cut(line: str) -> str:
    line = line.rstrip()
    return line if len(line) <= _LINE_CHARS else line[: _LINE_CHARS - 1] + "…"


def _traceback(lines: list[str], header: int) -> tuple[list[str], int]:
    """The quoted lines of the traceback whose header is ``lines[header]``, and the index of
    the last line that belongs to it."""
    # A prefix the header carries on every line (a log forwarder's ``(pid=…)``, an exception
    # group's ``  | ``) is taken off; one only the header has (``ERROR:    ``) stays put.
    prefix = lines[header][: lines[header].index(_HEADER)]
    frames: list[list[str]] = []
    exception: list[str] = []
    end = header
    for i in range(header + 1, len(lines)):
        line = lines[i]
        if prefix and line.startswith(prefix):
            line = line[len(prefix) :]
        if not exception:
            if not line.strip():
                continue
            if line[:1].isspace():
                if line.lstrip().startswith('File "'):
                    frames.append([line])
                elif frames and not _MARKERS.match(line) and len(frames[-1]) < 2:
                    frames[-1].append(line)
                end = i
                continue
            exception.append(line)
            end = i
        elif not line.strip() or len(exception) == _EXCEPTION_LINES:
            break
        else:
            exception.append(line)
            end = i
    quoted = [line for frame in frames[-_FRAMES:] for line in frame] + exception
    return quoted, end


def excerpt(text: str) -> tuple[list[str], bool]:
    """The lines of ``text`` (the end of a log) that say why its process failed, and whether
    they come from a traceback (see the module); ``([], False)`` for an empty log."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((i for i in range(len(lines) - 1, -1, -1) if _HEADER in lines[i]), None)
    if header is None:
        quoted = [line for line in lines if line.strip()][-_LAST_LINES:]
        return [_cut(line) for line in quoted], False
    quoted, end = _traceback(lines, header)
    after = [line for line in lines[end + 1 :] if line.strip()]
    if after:
        quoted.append("… " + after[-1].strip())
    return [_cut(line) for line in quoted], True


def read_end(path: str, max_bytes: int) -> tuple[str, bool]:
    """The last ``max_bytes`` of the file at ``path`` as text, and whether it was cut.
    :raises OSError: it cannot be read."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read()
    return data.decode("utf-8", errors="replace"), size > max_bytes


def quote_log(path: str | None, indent: str = "    ") -> str:
    """A clause for an error message quoting the log at ``path`` (``last error in its log
    (PATH):`` and each line on a new line after ``indent``). Never raises."""
    if not path:
        return "it wrote no log"
    try:
        text, cut = read_end(path, _READ_BYTES)
    except OSError as exc:
        return f"its log ({path}) cannot be read: {exc.strerror or exc}"
    # The first line of a cut end is most likely cut itself; it is not quoted.
    lines, from_traceback = excerpt(text.partition("\n")[2] if cut else text)
    if not lines:
        return f"its log ({path}) is empty"
    what = "last error in its log" if from_traceback else "last lines of its log"
    return f"{what} ({path}):" + "".join(f"\n{indent}{line}" for line in lines)
