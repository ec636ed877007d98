"""A 404 that says so when a client calls an OpenAI (or vLLM) route this server does not serve.

Client libraries reach for routes beyond text generation with the same base URL: LangChain's
``OpenAIEmbeddings`` and LlamaIndex's ``OpenAIEmbedding`` post to ``/v1/embeddings``, moderation chains to
``/v1/moderations``. The generic "Unknown route POST /v1/embeddings." reads like a typo in the base URL; the
message built here names what the route is and what this server serves instead, so the client's
``NotFoundError`` explains itself. The status stays 404, as OpenAI answers a URL it does not have.
"""

from __future__ import annotations

import re

# (route prefix, what it serves): OpenAI's API reference, then vLLM's pooling routes.
UNSERVED_ROUTES: tuple[tuple[str, str], ...] = (
    ("/v1/embeddings", "embeddings"),
    ("/v1/moderations", "moderations"),
    ("/v1/images", "image generation"),
    ("/v1/audio", "audio (speech, transcription, translation)"),
    ("/v1/files", "file uploads"),
    ("/v1/uploads", "file uploads"),
    ("/v1/batches", "the Batch API"),
    ("/v1/fine_tuning", "fine-tuning"),
    ("/v1/assistants", "the Assistants API"),
    ("/v1/threads", "the Assistants API"),
    ("/v1/vector_stores", "vector stores"),
    ("/v1/realtime", "the Realtime API"),
    ("/v1/conversations", "the Conversations API"),
    ("/v1/rerank", "reranking"),
    ("/v1/score", "scoring"),
    ("/pooling", "pooling"),
    ("/classify", "classification"),
)

SERVED = "/v1/completions, /v1/chat/completions and /v1/responses"

#: Routes under a served prefix that are not served (the SDKs expose them: openai-node's
#: ``chat.completions.list/retrieve``, ``responses.cancel/compact``, ``models.delete``): (methods, path
#: pattern after the /v1 mount, why). Their generic answer was "Unknown route" or a bare 405.
UNSERVED_METHODS: tuple[tuple[frozenset[str], re.Pattern[str], str], ...] = (
    (
        frozenset({"GET", "POST", "DELETE"}),
        re.compile(r"/chat/completions(/[^/]+(/messages)?)?"),
        "stored chat completions are not kept (OpenAI's store): a chat completion is returned once, by "
        "POST /v1/chat/completions",
    ),
    (
        frozenset({"POST"}),
        re.compile(r"/responses/[^/]+/cancel"),
        "only background responses can be cancelled, and this server runs none (background is refused)",
    ),
    (
        frozenset({"POST"}),
        re.compile(r"/responses/compact"),
        "this server does not compact responses; send the conversation, or previous_response_id",
    ),
    (frozenset({"DELETE"}), re.compile(r"/models/.+"), "the served models cannot be deleted"),
)


def _matches(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, also behind a ``--root-path`` mount prefix."""
    path = path.rstrip("/")
    return path.endswith(prefix) or f"{prefix}/" in f"{path}/"


def _unserved_method(method: str, path: str) -> str | None:
    for methods, pattern, why in UNSERVED_METHODS:
        if method in methods and re.search(f"/v1{pattern.pattern}/?$", path):
            return f"{method} {path} is not served: {why}."
    return None


def method_not_allowed_message(method: str, path: str) -> str:
    """The 405 message for ``method path`` (a served path, another method)."""
    return _unserved_method(method, path) or f"Method Not Allowed: {method} {path}."


def not_found_message(method: str, path: str) -> str:
    """The 404 message for ``method path``: what the route is when it is one we know we do not serve."""
    known = _unserved_method(method, path)
    if known is not None:
        return known
    for prefix, what in UNSERVED_ROUTES:
        if _matches(path, prefix):
            return (
                f"{method} {path} is not served: this server serves a causal language model "
                f"({SERVED}), not {what}."
            )
    return f"Unknown route {method} {path}."
