"""``relax_core.testing`` on an install without pytest (the pip route installs none): its helpers
import and work, and its fixtures are simply not there; with pytest they are."""

from __future__ import annotations

import json

import relax_core.testing
from tests.support import commands


def test_the_helpers_import_without_pytest_and_the_fixtures_need_it() -> None:
    script = (
        "import json, sys\n"
        "sys.modules['pytest'] = None  # as if it were not installed\n"
        "import relax_core.testing as t\n"
        "t.wait_for(lambda: True, timeout=1.0, what='nothing')\n"
        "print(json.dumps([sorted(t.__all__), hasattr(t, 'plugin_manager'), t.free_port() > 0]))\n"
    )
    out = commands.python(script)
    assert out.returncode == 0, out.stderr[-2000:]
    names, fixtures, port = json.loads(out.stdout.strip().splitlines()[-1])
    assert names == ["free_port", "run_stages", "serve_app", "wait_for"]
    assert (fixtures, port) == (False, True)
    # With pytest (here), the fixtures are there too.
    assert {"plugin_manager", "core_plugin_manager", "ray_local"} <= set(relax_core.testing.__all__)
