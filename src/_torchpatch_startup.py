"""torchpatch's start-up hook, run in every Python process by ``torchpatch.pth`` (or, on Python
3.15+, ``torchpatch.start``, PEP 829) and by the sitecustomize that ``torchpatch run`` puts first
on ``PYTHONPATH``.

It reads only ``os.environ``. With ``TORCHPATCH`` unset or off it imports nothing, installs no
finder and wraps nothing. This module stays tiny on purpose: it is outside the torchpatch package
so that reading the flag never costs the package's import.
"""

import os
import sys

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off", "")


def parse_flag(name, value):
    """``True``/``False`` for an accepted spelling (any case), ``None`` (and one stderr line) else."""
    text = value.strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    sys.stderr.write(
        "torchpatch: ignoring %s=%r: accepted values are 1/true/yes/on and 0/false/no/off "
        "(any case)\n" % (name, value)
    )
    return None


_started = False


def start():
    """Activate torchpatch if ``TORCHPATCH`` says so; otherwise do nothing at all.

    Runs once per process even when several hooks call it (a venv's ``lib64 -> lib`` link makes
    ``site`` process the same ``.pth`` twice; ``torchpatch run`` adds a sitecustomize).
    """
    global _started
    if _started:
        return
    _started = True
    value = os.environ.get("TORCHPATCH")
    if value is None or not parse_flag("TORCHPATCH", value):
        return
    try:
        import torchpatch
    except ImportError as exc:  # a half-removed install must not break every Python process
        sys.stderr.write("torchpatch: TORCHPATCH=%s but torchpatch cannot be imported: %s\n" % (value, exc))
        return
    torchpatch._activate_at_startup()

