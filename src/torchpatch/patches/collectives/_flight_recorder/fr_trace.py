"""``main``: the analyser's command (``python -m torch.distributed.flight_recorder.fr_trace DIR``):
read one dump per rank, match the collectives across ranks (logging every mismatch), and with
``-o FILE`` pickle ``(types, database)`` there."""

from __future__ import annotations

import pickle
from typing import Optional, Sequence

from .builder import build_db, transform_ft
from .config_manager import JobConfig
from .loader import read_dir
from .records import types


def main(args: Optional[Sequence[str]] = None) -> None:
    parsed = JobConfig().parse_args(args)
    if not parsed.trace_dir:
        raise AssertionError("Trace directory trace_dir is required")
    details, version = read_dir(parsed)
    if parsed.transform_ft:
        if not parsed.group_world_size:
            raise AssertionError("World size is required for transform_ft")
        details = transform_ft(details, parsed.group_world_size)
    db = build_db(details, parsed, version)
    if parsed.output:
        with open(parsed.output, "wb") as f:
            pickle.dump((types, db), f)
