"""sitecustomize for clusters: activates torchpatch for every Python process that sees it.

Install once, as ``sitecustomize.py`` in a directory that every job has on ``PYTHONPATH`` (a shared
filesystem, a container's site directory)::

    cp sitecustomize_example.py /shared/pyboot/sitecustomize.py   # from a checkout or the sdist, or:
    cp "$(python -c 'import torchpatch._run as r; print(r.BOOTSTRAP)')/sitecustomize.py" /shared/pyboot/
    export PYTHONPATH=/shared/pyboot${PYTHONPATH:+:$PYTHONPATH}
    TORCHPATCH=1 torchrun --nproc_per_node 8 train.py

It does what torchpatch's own ``.pth`` start-up hook does, for environments where that hook is not
processed (``pip install --target``, a shared PYTHONPATH): with ``TORCHPATCH`` unset or off it imports
nothing of torchpatch, and where torchpatch is not installed it does nothing. Then it imports the
``sitecustomize`` it shadows, if there is one, so an existing site customisation keeps working.
``torchpatch run -- CMD`` uses this very file, torchpatch/_bootstrap/sitecustomize.py in the package;
sitecustomize_example.py at the top of the repository is a byte-identical copy (a test keeps them equal).
"""

import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _torchpatch_startup():
    """torchpatch's start-up module, or None where torchpatch is not installed."""
    try:
        import _torchpatch_startup
    except ImportError:
        # Run from torchpatch/_bootstrap/ inside an install that is not on sys.path (--target).
        site_dir = os.path.dirname(os.path.dirname(_HERE))
        if not os.path.exists(os.path.join(site_dir, "_torchpatch_startup.py")):
            return None
        sys.path.append(site_dir)
        import _torchpatch_startup
    return _torchpatch_startup


def _chain_sitecustomize():
    """Import the next ``sitecustomize`` on sys.path: the one this file shadows."""
    mine = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    try:
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if "sitecustomize" not in sys.modules and mine is not None:
            sys.modules["sitecustomize"] = mine


_startup = _torchpatch_startup()
if _startup is not None:
    _startup.start()
_chain_sitecustomize()
