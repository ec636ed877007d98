"""uvicorn's record of a handler cancelled at --shutdown-timeout becomes one warning line."""

from __future__ import annotations

import asyncio
import logging
import logging.config

from kvb_server import shutdown_log


def _record(exc: BaseException, msg: str = "Exception in ASGI application\n") -> logging.LogRecord:
    try:
        raise exc
    except BaseException as caught:
        info = (type(caught), caught, caught.__traceback__)
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, (), info)


def test_a_cancelled_handler_is_one_warning_line_and_other_errors_pass() -> None:
    cut = _record(asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded"))
    assert shutdown_log.ShutdownCutFilter().filter(cut)
    assert (cut.levelno, cut.getMessage(), cut.exc_info) == (logging.WARNING, shutdown_log.CUT_MESSAGE, None)
    for other in (
        RuntimeError("boom"),
        asyncio.CancelledError(),
        asyncio.CancelledError("a bug's own cancel"),
    ):
        record = _record(other)
        assert shutdown_log.ShutdownCutFilter().filter(record)
        assert record.levelno == logging.ERROR and record.exc_info is not None, other


def test_the_filter_survives_uvicorns_logging_setup() -> None:
    import uvicorn.config

    logger = logging.getLogger(shutdown_log.UVICORN_ERROR_LOGGER)
    before = list(logger.filters)
    try:
        shutdown_log.install()
        shutdown_log.install()  # once only
        logging.config.dictConfig(uvicorn.config.LOGGING_CONFIG)  # what uvicorn.run does before serving
        assert sum(isinstance(f, shutdown_log.ShutdownCutFilter) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before
