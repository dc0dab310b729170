"""One log format for every minicore process: vLLM's.

Mirrors vllm/logger.py (init_logger, the default logging config) and vllm/logging_utils/
formatter.py (NewLineFormatter): each line reads
    (APIServer pid=123) INFO 11-24 01:23:45 [api_server.py:277] message
with the process named as vLLM names it (APIServer for the frontend, EngineCore_DP0 for an
engine, set by the process's entry point), and a message's later lines carry the same prefix.
uvicorn's loggers propagate to the same handler (uvicorn_log_config), so the access log and
uvicorn's own lines read the same. Left out: colour, JSON logs, a logging config file, and
VLLM_LOGGING_* environment variables (MINICORE_LOGGING_LEVEL sets the level).
"""

import logging
import os
import sys

_FORMAT = "(%(process_name)s pid=%(process)d) %(levelname)s %(asctime)s " \
          "[%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class NewLineFormatter(logging.Formatter):
    """vLLM's formatter with the process name baked in: each line of a multi-line message (a
    traceback included) starts with the prefix, so logs of several processes stay attributable."""

    def __init__(self, process_name: str):
        super().__init__(_FORMAT, _DATE_FORMAT)
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        record.process_name = self.process_name
        msg = super().format(record)
        if record.message:
            prefix = msg.split(record.message)[0]
            msg = msg.replace("\n", "\r\n" + prefix)
        return msg


def init_logger(name: str) -> logging.Logger:
    """vLLM's init_logger: the module's logger (configure_logging sets where it goes)."""
    return logging.getLogger(name)


def configure_logging(process_name: str) -> None:
    """Send this process's logs, minicore's and its libraries' (uvicorn's included), to stderr in
    vLLM's format, naming the process. Called once by each process's entry point; a process that
    configured logging its own way (a test's caplog, an embedding application) is left alone."""
    root = logging.getLogger()
    if any(getattr(h, "minicore", False) for h in root.handlers):
        for handler in root.handlers:
            handler.setFormatter(NewLineFormatter(process_name))
        return
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.minicore = True
    handler.setFormatter(NewLineFormatter(process_name))
    root.addHandler(handler)
    root.setLevel(os.environ.get("MINICORE_LOGGING_LEVEL", "INFO").upper())
    # As vLLM: httpx (transformers' hub client, the proxy's client) is chatty at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def uvicorn_log_config(log_level: str) -> dict:
    """uvicorn.Config's log_config: its loggers keep no handlers of their own and propagate to
    the root's, in the format above, at --uvicorn-log-level."""
    level = log_level.upper()
    loggers = {name: {"handlers": [], "level": level, "propagate": True}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    return {"version": 1, "disable_existing_loggers": False, "loggers": loggers}
