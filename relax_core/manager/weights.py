"""Versioned checkpoint directories for the DCS weight source: each version written into
``ROOT/version-N/`` atomically (filled under a temporary name, then renamed)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable

_VERSION_DIR = re.compile(r"^version-(\d+)$")


class CheckpointDirectory:
    """A directory of ``version-N/`` checkpoints; only complete (renamed) ones are listed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def path(self, version: int) -> str:
        """The directory of ``version`` (it may not exist)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"checkpoint version {version!r}: use an integer >= 0")
        return os.path.join(self.root, f"version-{version}")

    def versions(self) -> list[int]:
        """Every complete version, ascending (empty when the root does not exist)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(
            int(m.group(1))
            for name in names
            if (m := _VERSION_DIR.match(name)) and os.path.isdir(os.path.join(self.root, name))
        )

    def latest(self) -> int | None:
        """The newest complete version, or ``None``."""
        versions = self.versions()
        return versions[-1] if versions else None

    def publish(self, version: int, write: Callable[[str], object]) -> str:
        """Publish ``version``: ``write(tmp_dir)`` fills a temporary directory, then renamed.
        :raises FileExistsError: ``version`` is already published."""
        target = self.path(version)
        if os.path.exists(target):
            raise FileExistsError(
                f"checkpoint {target} already exists; versions are immutable, publish "
                f"version {(self.latest() or 0) + 1} instead"
            )
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".version-{version}.tmp-", dir=self.root)
        try:
            write(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def publish_copy(self, version: int, source: str | os.PathLike[str]) -> str:
        """Publish ``version`` as a copy of the checkpoint directory ``source``."""
        return self.publish(version, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))
