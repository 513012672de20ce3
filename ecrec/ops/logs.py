"""Log lines of the ``ecrec-server`` processes: readable text, or one JSON object per line.

``--log-format json`` gives log collectors (Loki, Elasticsearch, CloudWatch...) one object per record:
``time`` (ISO 8601, UTC), ``level``, ``logger``, ``pid``, ``process`` (``coordinator``, ``server`` ...),
``message``, and ``exception`` when the record carries one.
"""

from __future__ import annotations

import datetime
import json
import logging

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (no newlines inside: tracebacks are a string field)."""

    def __init__(self, process_kind: str = ""):
        super().__init__()
        self.process_kind = process_kind

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if self.process_kind:
            entry["process"] = self.process_kind
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str = "INFO", log_format: str = "text", process_kind: str = "") -> None:
    """Sets up the root logger of this process (stderr) at ``level`` in ``log_format``."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(process_kind) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
