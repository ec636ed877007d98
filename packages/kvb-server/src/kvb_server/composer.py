"""Engine composers: who builds the served engine from the command line, found by entry point.

``kvboost-server`` alone serves a plain ``kvb_cache.KVBoost``. A distribution that composes more parts
into the engine (the meta-package ``kvboost``: speculative decoding, layer streaming, kernels) registers a
composer under the :data:`ENTRY_POINT_GROUP` entry-point group; the server then adds the composer's option
groups to its flags and lets it build the engine. The server never imports the composer's distribution.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

from kvb_server.engine import ServingEngine

logger = logging.getLogger(__name__)

#: ``[project.entry-points."kvb_server.engine_composers"] name = "module:factory"``; the factory takes no
#: arguments and returns an :class:`EngineComposer`.
ENTRY_POINT_GROUP = "kvb_server.engine_composers"


@runtime_checkable
class EngineComposer(Protocol):
    """Builds the served engine from parsed flags."""

    @property
    def name(self) -> str:
        """Shown in logs and ``--help`` (e.g. ``"kvboost"``)."""
        ...

    def option_classes(self) -> tuple[type, ...]:
        """Options classes (:mod:`kvb_cache.options`) whose flags join the server's, besides ``EngineArgs``."""
        ...

    def build_engine(self, model: str, args: argparse.Namespace) -> ServingEngine:
        """Load ``model`` with every option in ``args`` (``EngineArgs``' and :meth:`option_classes`')."""
        ...


def find_composer() -> EngineComposer | None:
    """The installed composer (the first by entry-point name), or None: serve a plain kvb-cache engine."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        return None
    if len(found) > 1:
        logger.warning(
            "several engine composers installed (%s); using %s", [e.name for e in found], found[0].name
        )
    composer = found[0].load()()
    if not isinstance(composer, EngineComposer):
        raise TypeError(
            f"entry point {found[0].value} must return an EngineComposer, got {type(composer).__name__}"
        )
    return composer
