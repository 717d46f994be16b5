"""Tandem's one logging setup: structured lines, each about a request carrying its request id.

`setup_logging()` installs one handler on the root logger (calling it again replaces it, so the
router, the controller and every Ray actor call it at start). Lines are JSON objects by default,
`key=value` pairs with `TANDEM_LOG_FORMAT=kv`; the level comes from `TANDEM_LOG_LEVEL` (default
INFO). Code that works on a request wraps it in `with bind_request(request_id):`; every record
logged inside, by any logger, in that task or thread, carries `request_id` (and any other fields
bound with it). The binding lives in a ContextVar, so concurrent asyncio tasks do not mix ids.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import time
from typing import Any, Iterator, TextIO

LEVEL_ENV = "TANDEM_LOG_LEVEL"
FORMAT_ENV = "TANDEM_LOG_FORMAT"
FORMATS = ("json", "kv")

# The fields bound to the current request: {"request_id": ..., "session_id": ..., ...}.
_request_fields: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "tandem_request_fields", default={})

# Attributes every LogRecord has; anything else on a record came in through `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_HANDLER_NAME = "tandem"


def current_request_id() -> str | None:
    return _request_fields.get().get("request_id")


@contextlib.contextmanager
def bind_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Tag every log record inside the block with `request_id` and `fields` (nested blocks add)."""
    token = _request_fields.set({**_request_fields.get(), "request_id": request_id, **fields})
    try:
        yield
    finally:
        try:
            _request_fields.reset(token)
        except ValueError:
            # the block is left in another context than it was entered in: an async generator
            # (a gRPC stream the client cancelled) closed by the event loop's finalizer. Our
            # fields were never bound in that context, so there is nothing to undo there.
            pass


# credentials in URLs (redis://:PASSWORD@host, scheme://user:PASSWORD@host) and password-like
# query parameters: masked in every line this setup writes, whoever logged them
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<secret>[^@/\s]+)@")
_SECRET_PARAMS = re.compile(r"(?i)(?P<key>\b(?:password|passwd|pwd|token|secret)=)(?P<secret>[^&\s'\"]+)")


def redact(text: str) -> str:
    """`text` with the secrets of URLs and password parameters replaced by `***`."""
    if "@" in text or "=" in text:
        text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
        text = _SECRET_PARAMS.sub(lambda m: f"{m['key']}***", text)
    return text


class RequestContextFilter(logging.Filter):
    """Copies the bound request fields onto each record (fields given with `extra=` win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _request_fields.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(record.created))}"
              f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": redact(record.getMessage()),
    }
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRS and not key.startswith("_"):
            out[key] = value
    if record.exc_info:
        out["exc"] = redact(formatter.formatException(record.exc_info))
    elif record.exc_text:
        out["exc"] = redact(record.exc_text)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then request fields and extras."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), default=str, ensure_ascii=False)


def _kv_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text, ensure_ascii=False)
    return text


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=info logger=router msg="..." request_id=...`, one record per line."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in _fields(record, self).items())


def _level(level: str | int | None) -> int:
    if level is None:
        level = os.environ.get(LEVEL_ENV, "INFO")
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"{LEVEL_ENV}: unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    return value


def setup_logging(level: str | int | None = None, fmt: str | None = None,
                  stream: TextIO | None = None) -> logging.Handler:
    """Install Tandem's handler on the root logger; returns it. Arguments override the env."""
    fmt = (fmt or os.environ.get(FORMAT_ENV) or "json").lower()
    if fmt not in FORMATS:
        raise ValueError(f"{FORMAT_ENV}: unknown log format {fmt!r}; use one of {FORMATS}")
    level = _level(level)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # grpc and Ray are chatty at DEBUG; keep them at INFO unless asked for by name.
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(root.level, logging.INFO))
    return handler
