"""relax-sglang: the ``sglang`` engine backend (real SGLang servers) and the routers
``sglang-router`` / ``smg`` in front of a model's replica heads.

See ``docs/sglang.md``. Registered through the ``relax`` entry point (``relax_sglang.plugin``).
"""

from relax_sglang.engine import launch
from relax_sglang.fidelity import PROBES, ProbeServer
from relax_sglang.router import SGLANG_ROUTER, SMG, RouterKind, RouterServer, router_argv
from relax_sglang.server_args import check_launch, launch_server_argv

__all__ = [
    "PROBES",
    "SGLANG_ROUTER",
    "SMG",
    "ProbeServer",
    "RouterKind",
    "RouterServer",
    "check_launch",
    "launch",
    "launch_server_argv",
    "router_argv",
]
