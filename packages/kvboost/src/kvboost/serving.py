"""The full-stack engine composer ``kvboost-server`` and ``kvboost serve`` use (entry point
``kvb_server.engine_composers``): every flag of :class:`kvb_cache.EngineArgs` and :mod:`kvboost.args`
becomes one :meth:`kvboost.KVBoost.from_args` call."""

from __future__ import annotations

import argparse

from kvb_cache.engine_args import EngineArgs
from kvb_cache.options import from_namespace
from kvboost.args import PART_ARGS, SpeculativeArgs, StreamingArgs
from kvboost.compose import KVBoost


class FullStack:
    """Stitching, speculative decoding, AWQ layer streaming, kernels and the block pool in one engine
    (the planner gate and the HTTP layer stay kvb-server's)."""

    name = "kvboost"

    def option_classes(self) -> tuple[type, ...]:
        return PART_ARGS

    def build_engine(self, model: str, args: argparse.Namespace) -> KVBoost:
        return KVBoost.from_args(
            model,
            from_namespace(EngineArgs, args),
            speculative=from_namespace(SpeculativeArgs, args),
            streaming=from_namespace(StreamingArgs, args),
        )
