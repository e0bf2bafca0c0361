"""The memory tags an engine releases and resumes (SGLang's), one definition for the engine and
the manager; resuming goes weights, KV cache, CUDA graphs."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class ResidentTag(enum.StrEnum):
    """A piece of engine memory that can be released and resumed on its own."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


#: Every tag in resume order (weights, KV cache, CUDA graphs), as the plain strings the engine
#: protocol carries (so messages list ``'weights'``, not the enum member).
TAG_ORDER: tuple[str, ...] = tuple(str(t) for t in ResidentTag)
ALL_TAGS: frozenset[str] = frozenset(TAG_ORDER)


def normalize_tags(tags: Iterable[str] | None, *, where: str = "tags") -> frozenset[str]:
    """``None`` means every tag; otherwise check each name.
    :raises ValueError: an unknown tag (the message lists the known ones), or no tag at all."""
    if tags is None:
        return ALL_TAGS
    if isinstance(tags, str):
        tags = (tags,)
    out = frozenset(str(t) for t in tags)
    if unknown := out - ALL_TAGS:
        raise ValueError(
            f"{where}: unknown resident tags {sorted(unknown)}; known: {list(TAG_ORDER)}"
        )
    if not out:
        raise ValueError(f"{where}: give at least one tag, or None for all of {list(TAG_ORDER)}")
    return out


def ordered(tags: Iterable[str]) -> tuple[str, ...]:
    """``tags`` in resume order, as plain strings (unknown names are dropped)."""
    wanted = {str(t) for t in tags}
    return tuple(str(t) for t in TAG_ORDER if t in wanted)
