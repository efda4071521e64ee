"""``FlightRecorderLogger``: the one "Flight Recorder" logger (messages only, on stderr, INFO)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional


class FlightRecorderLogger:
    """A singleton over ``logging.getLogger("Flight Recorder")``; its first construction gives the
    logger a bare-message stderr handler at INFO level."""

    _instance: Optional[Any] = None
    logger: logging.Logger

    def __new__(cls) -> Any:
        if cls._instance is None:
            instance = super().__new__(cls)
            instance.logger = logging.getLogger("Flight Recorder")
            instance.logger.setLevel(logging.INFO)
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            instance.logger.addHandler(handler)
            cls._instance = instance
        return cls._instance

    def __init__(self) -> None:
        self.logger = logging.getLogger("Flight Recorder")

    def set_log_level(self, level: int) -> None:
        self.logger.setLevel(level)

    @property
    def debug(self) -> Callable[..., None]:
        return self.logger.debug

    @property
    def info(self) -> Callable[..., None]:
        return self.logger.info

    @property
    def warning(self) -> Callable[..., None]:
        return self.logger.warning

    @property
    def error(self) -> Callable[..., None]:
        return self.logger.error

    @property
    def critical(self) -> Callable[..., None]:
        return self.logger.critical


logger: FlightRecorderLogger = FlightRecorderLogger()
