"""Rewrite a wheel without the parts of it a run does not import, so it ships in less space.

    python tools/slim_wheel.py IN.whl OUT_DIR PREFIX [PREFIX ...]

Every file whose path inside the wheel starts with one of the prefixes is left out, and the
wheel's ``RECORD`` lists only what is kept (the other lines, hashes included, are the
original's), so ``pip install`` takes it as any wheel. Used by ``tools/h200-wheels.sh`` on
Ray's wheel (79 MB → ~40 MB without the Java jars, the dashboard's web build and the
libraries — RLlib, Tune, Train, Serve, Data — that ``relax run`` never imports).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def slim(source: Path, out_dir: Path, prefixes: tuple[str, ...]) -> Path:
    """Write ``out_dir/<source's name>`` without the files under ``prefixes``; its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    with (
        zipfile.ZipFile(source) as src,
        zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record or info.filename.startswith(prefixes):
                continue
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
        kept = [
            line
            for line in src.read(record).decode().splitlines()
            if line and not line.split(",", 1)[0].startswith(prefixes)
        ]
        dst.writestr(record, "\n".join(kept) + "\n")
    return target


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, out_dir, prefixes = Path(argv[0]), Path(argv[1]), tuple(argv[2:])
    target = slim(source, out_dir, prefixes)
    before, after = source.stat().st_size / 1e6, target.stat().st_size / 1e6
    print(f"{source.name}: {before:.1f} MB -> {after:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
