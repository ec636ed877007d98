"""Tool calling for the chat endpoint: request validation, prompt rendering, constraining grammar, parsing.

See docs/tools.md for the formats, what each ``tool_choice`` does and the system-prompt fallback.
"""

from kvb_server.tool_calls.grammar import tool_grammar
from kvb_server.tool_calls.parse import PartialCall, scan_calls, split_reply
from kvb_server.tool_calls.prompt import template_messages, tools_system_prompt
from kvb_server.tool_calls.spec import MAX_PARALLEL_CALLS, Tool, ToolPlan, parse_tools, tool_plan
from kvb_server.tool_calls.stream import ToolCallStream
from kvb_server.tool_calls.syntax import ToolSyntax, detect

__all__ = [
    "MAX_PARALLEL_CALLS",
    "PartialCall",
    "Tool",
    "ToolCallStream",
    "ToolPlan",
    "ToolSyntax",
    "detect",
    "parse_tools",
    "scan_calls",
    "split_reply",
    "template_messages",
    "tool_grammar",
    "tool_plan",
    "tools_system_prompt",
]
