"""relax-hf: a Hugging Face transformers engine speaking SGLang's HTTP protocol (CPU or CUDA).

The ``hf`` engine backend of Relax: ``relax-hf serve`` runs one engine server; the plugin
(:mod:`relax_hf.plugin`) registers the backend through the ``relax`` entry point so the
InferenceManager can launch it and drive it with :class:`relax_core.engine.control.ControlClient`.
"""

from relax_hf.plugin import HF_BACKEND, launch
from relax_hf.tiny import make_tiny_model

__version__ = "0.1.0"

__all__ = ["HF_BACKEND", "__version__", "launch", "make_tiny_model"]
