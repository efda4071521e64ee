"""This process's installation: :func:`install`, :func:`uninstall`, :func:`status`, the start-up
activation, and the summary line at exit."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import traceback
from typing import Dict, Mapping, Optional

import _torchpatch_startup

from ._config import Config
from ._fixes import arm_exit_hint, disarm_exit_hint
from ._installation import Installation
from ._plan import plan
from ._summary import JobSummary, configure_logging, log, log_summary

_lock = threading.RLock()
_current: Optional[Installation] = None
_job: Optional[JobSummary] = None


def _log_summary() -> None:
    """At exit, one line per job: versions and what was applied (see ``_summary``). Not built where
    it would not be printed (``TORCHPATCH_LOG=off``/``warning``): finding torch's version reads the
    file system, and exit is no place for work nobody reads."""
    inst = _current
    if (inst is not None and "torch" in sys.modules and _job is not None and _job.should_print()
            and log.isEnabledFor(logging.INFO)):
        log_summary(inst.outcome())


def _switched_off() -> Dict[str, str]:
    """Patch id -> why it is off, for the patches that apply here but are switched off (exit hint)."""
    return _current.outcome().switched_off if _current is not None else {}


def install(environ: Optional[Mapping[str, str]] = None) -> None:
    """Apply the catalogue to this process, whatever ``TORCHPATCH`` says; opt-outs still apply.

    Idempotent: the start-up hook, a sitecustomize and explicit calls together install once.
    Nothing is imported from torch here: each patch applies when its torch module is imported
    (or at once, if that module already is).
    """
    global _current, _job
    with _lock:
        _torchpatch_startup.cancel()
        if _current is not None:
            return
        cfg = Config.from_environ(os.environ if environ is None else environ)
        configure_logging(cfg.log_level)
        plans = plan(cfg=cfg, only_applicable=True)
        for warning in cfg.warnings:
            log.warning("%s", warning)
        inst = Installation(plans, cfg.strict)
        _current = inst
        try:
            inst.start()
        except Exception:
            _current = None
            inst.stop()
            raise
        if _job is None:
            _job = JobSummary()
        atexit.register(_log_summary)
        arm_exit_hint(_switched_off)
        if cfg.report_dir:
            from . import _report

            inst.on_settled = _report.arm(cfg, inst.outcome)


def uninstall() -> None:
    """Take back everything :func:`install` did: finders, wrappers, served symbols and modules."""
    global _current
    with _lock:
        _torchpatch_startup.cancel()
        inst, _current = _current, None
        if inst is not None:
            atexit.unregister(_log_summary)
            disarm_exit_hint()
            inst.stop()


def is_installed() -> bool:
    """Whether torchpatch is active in this process: installed, or armed by ``TORCHPATCH=1`` and
    waiting for the first ``import torch``."""
    return _current is not None or _torchpatch_startup.pending()


def status() -> Dict[str, str]:
    """Patch id -> applied / not needed / failed / waiting for its module, for armed patches."""
    return _current.outcome().status if _current is not None else {}


def _activate_at_startup() -> None:
    """Called by the start-up hook at the first ``import torch`` when ``TORCHPATCH`` is on: never
    breaks the process unless ``TORCHPATCH_STRICT=1``, which makes a failure end it (exit 1)."""
    try:
        install()
    except Exception as exc:
        cfg = Config.from_environ()
        if cfg.strict:
            traceback.print_exc()
            raise SystemExit(f"torchpatch: activation failed: {type(exc).__name__}: {exc}") from exc
        if cfg.log_level != "off":
            sys.stderr.write(f"torchpatch: activation failed, continuing without torchpatch: {exc}\n")
