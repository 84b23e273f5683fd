"""pagedllm's log lines: one handler on the "pagedllm" logger, INFO by default, like vLLM's.

The level comes from $PAGEDLLM_LOGGING_LEVEL (read in config.py). Applications that configure logging
themselves can set `logging.getLogger("pagedllm").propagate = True` and remove the handler.
"""

from __future__ import annotations

import logging
import sys

from pagedllm.config import logging_level

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def configure_logging() -> None:
    logger = logging.getLogger("pagedllm")
    if getattr(logger, "_pagedllm_configured", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging_level())
    logger.propagate = False
    logger._pagedllm_configured = True  # type: ignore[attr-defined]
