"""SGLang's frontend language against an engine: ``python sglang_frontend_program.py URL``.

Prints one JSON object with what each program produced. Run in its own process by
``test_clients.py``: ``import sglang`` runs the package's ``__init__``, which imports SGLang's
server runtime and its GPU stack (triton); the frontend language (``sglang.lang``) needs none of
it, so this program registers an empty ``sglang`` package pointing at the installed files and
imports ``sglang.lang`` from there, leaving the server runtime out.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types


def _frontend() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package
    import sglang.lang.api as api
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    api.RuntimeEndpoint = RuntimeEndpoint  # type: ignore[attr-defined]
    return api


def main(url: str) -> None:
    sgl = _frontend()
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))

    @sgl.function
    def answer(s, question):  # type: ignore[no-untyped-def]
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    @sgl.function
    def pick(s):  # type: ignore[no-untyped-def]
        s += "The colour of the sea is"
        s += sgl.select("colour", choices=[" blue", " red", " green"])

    @sgl.function
    def number(s):  # type: ignore[no-untyped-def]
        s += "A number:"
        s += sgl.gen("n", max_tokens=6, regex=r"[0-9]{1,3}")

    single = answer.run(question="what is two plus two?")
    batch = answer.run_batch([{"question": "a"}, {"question": "b"}, {"question": "c"}])
    streamed = answer.run(question="what is two plus two?", stream=True)
    chunks = list(streamed.text_iter(var_name="answer"))
    chosen = pick.run()
    digits = number.run()
    print(
        json.dumps(
            {
                "single": single["answer"],
                "batch": [st["answer"] for st in batch],
                "stream_chunks": chunks,
                "stream_answer": streamed["answer"],
                "selected": chosen["colour"],
                "select_meta": chosen.get_meta_info("colour") is not None,
                "number": digits["n"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
