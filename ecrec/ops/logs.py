"""Log lines of the ``ecrec-server`` processes: readable text, or one JSON object per line.

``--log-format json`` gives log collectors (Loki, Elasticsearch, CloudWatch...) one object per record:
``time`` (ISO 8601, UTC), ``level``, ``logger``, ``pid``, ``process`` (``coordinator``, ``server`` ...),
``message``, ``exception`` and ``stack`` when the record carries them; warnings, uncaught errors of any thread and a
command's last word (:func:`fatal`: why it stops) are such objects too.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (no newlines inside: tracebacks are a string field)."""

    def __init__(self, process_kind: str = ""):
        super().__init__()
        self.process_kind = process_kind

    def format(self, record: logging.LogRecord) -> str:
        try:
            message = record.getMessage()
        except (TypeError, ValueError) as exc:  # arguments that do not fit the format: the line, not a traceback
            message = f"{record.msg!r} % {record.args!r} (the arguments do not fit: {exc})"
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": message,
        }
        if self.process_kind:
            entry["process"] = self.process_kind
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
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
    if log_format == "json":  # every line on stderr a JSON object: libraries' warnings and uncaught errors too
        logging.captureWarnings(True)
        threading.excepthook = _log_thread_exception
        sys.excepthook = _log_exception


def _log_thread_exception(args) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    logging.getLogger("ecrec").critical("uncaught exception in thread %s", thread,
                                        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _log_exception(exc_type, exc_value, exc_traceback) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc_value, exc_traceback)
        return
    logging.getLogger("ecrec").critical("uncaught exception", exc_info=(exc_type, exc_value, exc_traceback))


def fatal(text: str) -> None:
    """A command's last word (why it stops): a line on stderr, a JSON object under ``--log-format json``."""
    root = logging.getLogger()
    if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        logging.getLogger("ecrec").critical("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)
