"""One warning line, not a traceback, for a request cut at shutdown.

When ``--shutdown-timeout`` passes, uvicorn cancels the handlers still running (the documented cut: a stream
ends without ``[DONE]``) and logs each as ``Exception in ASGI application`` at ERROR with the
``CancelledError`` traceback, about 65 lines that read as a crash (an audit, 2026-11-30).
"""

from __future__ import annotations

import asyncio
import logging

#: uvicorn's logger for protocol errors (its HTTP implementations log "Exception in ASGI application" there).
UVICORN_ERROR_LOGGER = "uvicorn.error"
#: The message uvicorn cancels its handlers with when the graceful-shutdown timeout passes; a CancelledError
#: without it (a bug cancelling something else) keeps its traceback.
UVICORN_SHUTDOWN_CANCEL = "timeout graceful shutdown exceeded"
CUT_MESSAGE = "a request still running when --shutdown-timeout passed was cut (its handler cancelled)"


class ShutdownCutFilter(logging.Filter):
    """Turns uvicorn's record of a handler it cancelled at shutdown (the CancelledError carrying its
    :data:`UVICORN_SHUTDOWN_CANCEL` message) into :data:`CUT_MESSAGE` at WARNING; every other record passes
    unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (
            isinstance(exc, asyncio.CancelledError)
            and UVICORN_SHUTDOWN_CANCEL in str(exc)
            and str(record.msg).startswith("Exception in ASGI application")
        ):
            record.msg, record.args = CUT_MESSAGE, ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install() -> None:
    """Add the filter to uvicorn's error logger, once (uvicorn's own logging setup keeps a logger's filters)."""
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    if not any(isinstance(f, ShutdownCutFilter) for f in logger.filters):
        logger.addFilter(ShutdownCutFilter())
