"""The server's logs: JSON lines on stderr (``{"time", "level", "logger", "event", ...}``), written through
the ``specdec.serving`` logger; ``configure_logging`` routes uvicorn's loggers the same way."""
from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("specdec.serving")


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger and the record's message / ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
                 "level": record.levelname.lower(), "logger": record.name}
        entry.update(getattr(record, "fields", None) or {"message": record.getMessage()})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def log_event(event: str, **fields) -> None:
    log.info(event, extra={"fields": {"event": event, **fields}})


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    for name in ("specdec.serving", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
