"""relax-hf: a Hugging Face transformers engine speaking SGLang's HTTP protocol (CPU or CUDA).

The ``hf`` engine backend of Relax: ``relax-hf serve`` runs one engine server; the plugin
(:mod:`relax_hf.plugin`) registers the backend through the ``relax`` entry point so the
InferenceManager can launch it and drive it with :class:`relax_core.engine.control.ControlClient`.
It also registers ``relax demo`` (:mod:`relax_hf.demo`): ``relax run`` on an embedded job of three
tiny hf models on CPU.
"""

from relax_hf.demo import DEMO_JOB, DEMO_MODELS, make_demo_models
from relax_hf.plugin import HF_BACKEND, launch
from relax_hf.tiny import make_tiny_model

__version__ = "0.1.0"

__all__ = [
    "DEMO_JOB",
    "DEMO_MODELS",
    "HF_BACKEND",
    "__version__",
    "launch",
    "make_demo_models",
    "make_tiny_model",
]
