"""Secrets out of text before it is printed, logged or written to a tag.

:func:`redact` removes what a message may carry by accident: the user and password of a URI
(``http://alice:secret@host`` -> ``http://***@host``), bearer and basic authorization values,
query parameters that hold a credential (``token=``, ``password=``, ``X-Amz-Signature=``,
``AWSAccessKeyId=`` ...), AWS access key ids, and every secret value handed to it or
registered with :func:`register_secret` (a connection's token, an access key pair). The CLI's
log lines pass through :class:`RedactingFilter`; error messages and the ``graphtrim.error``
tags of a pipeline run go through :func:`redact` where they are made.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

MASK = "***"

# scheme://user[:password]@host: the userinfo goes, the scheme and host stay
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@?#'\"<>]+@")
# Authorization header values
_AUTH_VALUE = re.compile(r"(?i)\b(?P<kind>bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
_AUTH_HEADER = re.compile(
    r"(?i)(?P<key>['\"]?(?:authorization|x-api-key|x-amz-security-token)['\"]?\s*[:=]\s*['\"]?)"
    r"(?!(?:bearer|basic)\s)[^'\"\s,}]+"
)
# key=value pairs (query strings, config dumps) whose value is a credential
_SECRET_PARAM = re.compile(
    r"(?i)(?P<key>\b(?:access_token|refresh_token|id_token|token|api_key|apikey|password|passwd"
    r"|pwd|secret|client_secret|secret_access_key|aws_secret_access_key|session_token"
    r"|x-amz-signature|x-amz-credential|x-amz-security-token|awsaccesskeyid|signature|sig)"
    r"\s*=\s*)[^&\s'\"#,;)]+"
)
# AWS access key ids (long-term AKIA..., temporary ASIA...)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")

_lock = threading.Lock()
_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Remember ``value`` (a token, a password, a secret key) so that every later
    :func:`redact` in this process masks it wherever it appears. Values shorter than 4
    characters are not kept: masking them would garble ordinary text."""
    if value and len(value) >= 4:
        with _lock:
            _secrets.add(value)


def redact(text: object, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with credentials masked (see the module); ``secrets`` are extra values to mask."""
    out = str(text)
    with _lock:
        known = set(_secrets)
    known.update(s for s in secrets if s and len(s) >= 4)
    for value in sorted(known, key=len, reverse=True):  # longest first: no half-masked values
        out = out.replace(value, MASK)
    out = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", out)
    out = _AUTH_VALUE.sub(lambda m: f"{m.group('kind')} {MASK}", out)
    out = _AUTH_HEADER.sub(lambda m: f"{m.group('key')}{MASK}", out)
    out = _SECRET_PARAM.sub(lambda m: f"{m.group('key')}{MASK}", out)
    return _AWS_KEY_ID.sub(MASK, out)


class RedactingFilter(logging.Filter):
    """Masks credentials in a record's message and traceback text (see :func:`redact`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error path
            return True
        record.msg = redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Put a :class:`RedactingFilter` on every handler of ``logger`` (the root logger by
    default), once: a filter on a handler sees the records of every logger that reaches it."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def masked_command(command: Callable[[Any], int]) -> Callable[[Any], int]:
    """A CLI command whose errors leave it with their credentials masked (the CLI prints the
    message as its error line), and whose log lines are masked too: a URL with
    ``user:password@`` or a token in it must not reach the terminal or a CI log."""

    @functools.wraps(command)
    def run(args: Any) -> int:
        install_log_filter()  # MLflow's and boto's log lines too
        try:
            return command(args)
        except Exception as exc:
            if not isinstance(exc, OSError):  # an OSError's text is its errno and file name
                exc.args = tuple(redact(a) if isinstance(a, str) else a for a in exc.args)
            raise

    return run
