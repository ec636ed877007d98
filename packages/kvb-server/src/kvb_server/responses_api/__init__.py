"""OpenAI's Responses API (``/v1/responses``) as a translator over the chat-completions machinery."""

from kvb_server.responses_api.schemas import ResponsesRequest
from kvb_server.responses_api.store import ResponseStore

__all__ = ["ResponseStore", "ResponsesRequest"]
