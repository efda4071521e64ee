"""Reading the dumps: one pickle per rank, named ``<prefix><rank>``, in a folder."""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Set, Tuple

from .fr_logger import logger

exp = re.compile(r"([\w\-\_]*?)(\d+)$")  # a dump's name: its prefix, then its rank


def read_dump(prefix: str, filename: str) -> Dict[str, Any]:
    """The dump in ``filename`` (``prefix`` then the rank): its rank, ``host_rank<rank>`` as host
    name, and the dump's ``entries``, ``version`` and ``pg_config``."""
    rank = int(os.path.basename(filename)[len(prefix):])
    with open(filename, "rb") as infile:
        dump = pickle.load(infile)
    return {"host_name": f"host_rank{rank}", "rank": rank, "entries": dump["entries"], "version": dump["version"],
            "pg_config": dump["pg_config"]}


def _determine_prefix(files: List[str]) -> str:
    """The one prefix the names of ``files`` share before their rank numbers."""
    prefixes: Dict[str, Set[int]] = defaultdict(set)
    for name in files:
        found = exp.search(name)
        if found:
            prefixes[found.group(1)].add(int(found.group(2)))
    if len(prefixes) != 1:
        raise ValueError("Unable to automatically determine the common prefix for the trace file names. "
                         "Please specify --prefix argument manually")
    prefix = next(iter(prefixes))
    logger.debug("Inferred common prefix %s", prefix)
    return prefix


@contextmanager
def _disable_gc() -> Iterator[None]:
    """Garbage collection off meanwhile (the dumps unpickle into many small objects)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_dir(args: argparse.Namespace) -> Tuple[Dict[str, Dict[str, Any]], str]:
    """Every dump under ``args.trace_dir`` whose name holds ``args.prefix`` (inferred from the
    first folder's names when None), by file name; and the version of the first one read."""
    with _disable_gc():
        prefix = args.prefix
        details = {}
        version = ""
        start = time.time()
        if not os.path.isdir(args.trace_dir):
            raise AssertionError(f"folder {args.trace_dir} does not exist")
        for root, _, files in os.walk(args.trace_dir):
            if prefix is None:
                prefix = _determine_prefix(files)
            for name in files:
                offset = name.find(prefix)
                if offset == -1:
                    continue
                details[name] = read_dump(name[:offset] + prefix, os.path.join(root, name))
                version = version or str(details[name]["version"])
        if not details:
            raise AssertionError(f"no files loaded from {args.trace_dir} with prefix {prefix}")
        logger.debug("loaded %s files in %ss", len(details), time.time() - start)
        return details, version
