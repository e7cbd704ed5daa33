"""Structured logging: JSON lines by default (console rendering on a terminal), every line with `service`.

Per-request context (`request_id`) is bound with `structlog.contextvars.bind_contextvars` by the
servicers. Prompt and completion text are never logged unless the service runs with --log-prompts.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog + stdlib logging once per process. fmt: "json", "console" or "auto"."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
