"""HTTP routes, one module per concern; each exposes a router factory taking the server's parts."""

from kvb_server.routes.admin import admin_router
from kvb_server.routes.openai import openai_router
from kvb_server.routes.tokenize import tokenize_router

__all__ = ["admin_router", "openai_router", "tokenize_router"]
