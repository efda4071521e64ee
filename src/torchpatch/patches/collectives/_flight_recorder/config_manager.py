"""``JobConfig``: the analyser's command line."""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

from .fr_logger import logger


class JobConfig:
    """The command line of ``fr_trace``: the dumps' folder and the analysis' options."""

    def __init__(self) -> None:
        parser = self.parser = argparse.ArgumentParser(description="PyTorch Flight recorder analyzing script.")
        parser.add_argument("trace_dir", nargs="?",
                            help="Directory containing one trace file per rank, named with <prefix>_<rank>.")
        parser.add_argument("--selected-ranks", default=None, nargs="+", type=int,
                            help="List of ranks we want to show traces for.")
        parser.add_argument("--allow-incomplete-ranks", action="store_true",
                            help="FR trace require all ranks to have dumps for analysis. This flag allows best-effort "
                            "partial analysis of results and printing of collected data.")
        parser.add_argument("--pg-filters", default=None, nargs="+", type=str,
                            help="List of filter strings, it could be pg name or pg desc. If specified, only show "
                            "traces for the given pg.")
        parser.add_argument("-o", "--output", default=None)
        parser.add_argument("-p", "--prefix", default=None,
                            help="Common filename prefix to strip such that rank can be extracted. If not specified, "
                            "will attempt to infer a common prefix.")
        parser.add_argument("-j", "--just_print_entries", action="store_true")
        parser.add_argument("-v", "--verbose", action="store_true")
        parser.add_argument("--print_stack_trace", action="store_true")
        parser.add_argument("--mismatch_cap", type=int, default=10,
                            help="Maximum number of mismatches we print (from earliest).")
        parser.add_argument("--transform-ft", action="store_true",
                            help="Transform PG config to use global ranks to analyze traces produced by torchft")
        parser.add_argument("--group-world-size", type=int, default=None,
                            help="The number of ranks in 1 torchft replica group. Must be specified if "
                            "--transform-ft is True")

    def parse_args(self, args: Optional[Sequence[str]]) -> argparse.Namespace:
        """Parse ``args`` (None: the command line); rank and group selection need ``-j``; ``-v``
        turns the logger to DEBUG."""
        parsed = self.parser.parse_args(args)
        if parsed.selected_ranks is not None and not parsed.just_print_entries:
            raise AssertionError("Not support selecting ranks without printing entries")
        if parsed.pg_filters is not None and not parsed.just_print_entries:
            raise AssertionError("Not support selecting pg filters without printing entries")
        if parsed.verbose:
            logger.set_log_level(logging.DEBUG)
        return parsed
