"""Fuzz each role gateway against its OpenAPI document with schemathesis (``nox -s fuzz``).

Starts a real upstream server process and a gateway for every installed role (with its
plugin's adapter and record) on loopback, then runs ``schemathesis run`` on each gateway's
``/{role}/openapi.json``. The checks: every status and content type is documented (so no 5xx
other than the documented 502/503/504), responses match their schemas, and data the document
calls invalid is rejected with a 4xx. Exits non-zero on any failure.

Usage: ``python tests/fuzz_gateways.py [--max-examples N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support import gateway as gs

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    ]
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=60)
    args = parser.parse_args()
    from relax_core import PluginManager

    # The installed role plugins, as in a served gateway.
    pm = PluginManager.create()
    failed = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        engine = stack.enter_context(gs.upstream("fuzz-engine"))
        tok = gs.make_tokenizer(Path(tmp))
        for role in sorted(pm.registered("roles")):
            model = "m"
            registry = gs.Registry(gs.snapshot(role, {model: {"urls": [engine.url]}}))
            url = stack.enter_context(
                gs.gateway(
                    role,
                    registry,
                    plugin_manager=pm,
                    model_paths={model: str(tok)},
                    timeout=30.0,
                )
            )
            cmd = [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{url}/{role}/openapi.json",
                "--checks",
                CHECKS,
                "--max-examples",
                str(args.max_examples),
                "--workers",
                "1",
                "--suppress-health-check",
                "all",
            ]
            print(f"== fuzzing the {role} gateway at {url}", flush=True)
            if subprocess.run(cmd, check=False, cwd=tmp).returncode != 0:
                failed.append(role)
    if failed:
        print(f"fuzz: failures in the {', '.join(failed)} gateway(s)", file=sys.stderr)
        return 1
    print("fuzz: every role gateway passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
