"""A 404 that says so when a client calls an OpenAI (or vLLM) route this server does not serve.

Client libraries reach for routes beyond text generation with the same base URL: LangChain's
``OpenAIEmbeddings`` and LlamaIndex's ``OpenAIEmbedding`` post to ``/v1/embeddings``, moderation chains to
``/v1/moderations``. The generic "Unknown route POST /v1/embeddings." reads like a typo in the base URL; the
message built here names what the route is and what this server serves instead, so the client's
``NotFoundError`` explains itself. The status stays 404, as OpenAI answers a URL it does not have.
"""

from __future__ import annotations

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


def _matches(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, also behind a ``--root-path`` mount prefix."""
    path = path.rstrip("/")
    return path.endswith(prefix) or f"{prefix}/" in f"{path}/"


def not_found_message(method: str, path: str) -> str:
    """The 404 message for ``method path``: what the route is when it is one we know we do not serve."""
    for prefix, what in UNSERVED_ROUTES:
        if _matches(path, prefix):
            return (
                f"{method} {path} is not served: this server serves a causal language model "
                f"({SERVED}), not {what}."
            )
    return f"Unknown route {method} {path}."
