"""torchpatch's start-up hook, run in every Python process by ``torchpatch.pth`` (or, on Python
3.15+, ``torchpatch.start``, PEP 829) and by the sitecustomize that ``torchpatch run`` puts first
on ``PYTHONPATH``.

It reads only ``os.environ``. With ``TORCHPATCH`` unset or off it does nothing more. With it on,
it puts one tiny finder first on ``sys.meta_path`` that waits for the first ``import torch``: only
then is the torchpatch package imported and the catalogue installed, so a process that never
imports torch (a shell helper, pip, a data worker) pays next to nothing. This module stays tiny
and outside the package on purpose; it is also the one place that spells the accepted flag values.
"""

import os
import sys

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off", "")
TRIGGER = "torch"  # the import that activates torchpatch


def parse_flag(value):
    """``True``/``False`` for an accepted spelling (any case, spaces ignored), ``None`` otherwise."""
    text = value.strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    return None


def flag_warning(name, value):
    """The warning for a value ``parse_flag`` does not accept."""
    return "ignoring %s=%r: accepted values are 1/true/yes/on and 0/false/no/off (any case)" % (name, value)


def log_is_off():
    return os.environ.get("TORCHPATCH_LOG", "").strip().lower() == "off"


class _FirstTorchImport:
    """First on ``sys.meta_path`` until ``torch`` is imported: then installs torchpatch, leaves, and
    hands back torch's spec as the finders after it (torchpatch's own watcher first) find it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        cancel()
        _activate()
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is not None:
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None


_started = False
_pending = None


def start():
    """Arm torchpatch if ``TORCHPATCH`` says so; otherwise do nothing at all.

    Runs once per process even when several hooks call it (a venv's ``lib64 -> lib`` link makes
    ``site`` process the same ``.pth`` twice; ``torchpatch run`` adds a sitecustomize).
    """
    global _started, _pending
    if _started:
        return
    _started = True
    value = os.environ.get("TORCHPATCH")
    if value is None:
        return
    on = parse_flag(value)
    if on is None and not log_is_off():
        sys.stderr.write("torchpatch: %s\n" % flag_warning("TORCHPATCH", value))
    if not on:
        return
    if TRIGGER in sys.modules:  # imported before the hook ran (a sitecustomize that imports torch)
        _activate()
        return
    _pending = _FirstTorchImport()
    sys.meta_path.insert(0, _pending)


def cancel():
    """Stop waiting for torch (``install()`` or ``uninstall()`` came first, or torch is here)."""
    global _pending
    if _pending is not None and _pending in sys.meta_path:
        sys.meta_path.remove(_pending)
    _pending = None


def pending():
    """Whether torchpatch is armed and waiting for the first ``import torch``."""
    return _pending is not None


def _activate():
    strict = parse_flag(os.environ.get("TORCHPATCH_STRICT", "0"))
    try:
        import torchpatch
    except ImportError as exc:  # a half-removed install must not break every Python process
        message = "TORCHPATCH=%s but torchpatch cannot be imported: %s" % (os.environ.get("TORCHPATCH"), exc)
        if strict:
            raise SystemExit("torchpatch: %s (TORCHPATCH_STRICT=1)" % message)
        sys.stderr.write("torchpatch: %s\n" % message)
        return
    torchpatch._activate_at_startup()
