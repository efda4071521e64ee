"""torchpatch's log lines: the handler, a rank tag, and the one summary line per job.

A job is a tree of processes: a launcher (torchrun's agent, a plain ``python train.py``), its ranks,
and what each rank spawns (DataLoader workers, helpers). All of them activate torchpatch, and all
of them inherit the environment, so the first process to activate leaves a claim in it:
``_TORCHPATCH_SUMMARY=<rank or ->|<marker file>``. A process whose ``RANK`` equals the claim it
inherited is a child of that rank and stays silent; a rank under a launcher touches the launcher's
marker file, so the launcher knows ranks exist and leaves the line to rank 0. The name does not
start with ``TORCHPATCH_`` so that it is never taken for a per-patch switch.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, MutableMapping, Optional

from . import _versions
from ._outcome import APPLIED, FAILED
from ._version import __version__

if TYPE_CHECKING:
    from ._outcome import Outcome

CLAIM = "_TORCHPATCH_SUMMARY"
NO_RANK = "-"
log = logging.getLogger("torchpatch")


class _Formatter(logging.Formatter):
    """``torchpatch: ...``; under a launcher, other lines than the summary name the rank."""

    def format(self, record: logging.LogRecord) -> str:
        rank = os.environ.get("RANK")
        tag = f" (rank {rank})" if rank is not None and not getattr(record, "summary", False) else ""
        return f"torchpatch{tag}: {record.getMessage()}"


def configure_logging(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.CRITICAL + 1 if level == "off" else getattr(logging, level.upper()))


class JobSummary:
    """Decides, at activation, whether this process is the one that prints the job's summary."""

    def __init__(self, environ: MutableMapping[str, str] = os.environ) -> None:
        self._environ = environ
        rank = environ.get("RANK", NO_RANK)
        claim = environ.get(CLAIM)
        self.marker: Optional[str] = None  # this launcher's, if it is the job's first process
        if claim is None:
            import tempfile

            marker = os.path.join(tempfile.gettempdir(), f"torchpatch-job-{os.getpid()}-{os.urandom(4).hex()}")
            self.marker = marker if rank == NO_RANK else None
            self.owner = True
        else:
            claimed_rank, _, marker = claim.partition("|")
            self.owner = rank != claimed_rank
            if self.owner and claimed_rank == NO_RANK and marker:
                _touch(marker)
        if self.owner:
            environ[CLAIM] = f"{rank}|{marker}"

    def should_print(self) -> bool:
        """At exit: rank 0, or the launcher of a job whose ranks never activated torchpatch."""
        if not self.owner:
            return False
        rank = self._environ.get("RANK", NO_RANK)
        if rank != NO_RANK:
            return rank == "0"
        if self.marker is None:
            return True
        ranks_seen = os.path.exists(self.marker)
        if ranks_seen:
            try:
                os.remove(self.marker)
            except OSError:
                pass
        return not ranks_seen


def _touch(path: str) -> None:
    try:
        with open(path, "a"):
            pass
    except OSError:  # a read-only temporary directory: the launcher prints its line too
        pass


def summary_line(outcome: "Outcome") -> str:
    """Versions, the patches applied and those that failed (and were taken back)."""
    failed = outcome.with_status(FAILED)
    line = (
        f"{__version__} on torch {_versions.torch_version() or '(none)'}, "
        f"Python {_versions.python_version()}: applied {', '.join(outcome.with_status(APPLIED)) or 'none'}"
    )
    if failed:
        line += f"; failed and taken back {', '.join(failed)}"
    return line


def log_summary(outcome: "Outcome") -> None:
    log.info("%s", summary_line(outcome), extra={"summary": True})
