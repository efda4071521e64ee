"""torch's source text, for the patches that can tell only from it whether torch has a fix (not a
patch itself).

A patch decides by a behaviour probe where one can be made (calling torch on a small input, reading a
signature or an attribute); it reads source only through :func:`torch_source`, under one policy:
where the source cannot be read (a torch installed without its ``.py`` files, a frozen or zipped
install, a compiled function), the hook raises :class:`SourceUnavailable` and never guesses. The
engine then treats the patch as one that broke while applying: it is logged and reported as failed
with this reason, taken back whole, and the job runs on torch as it is; ``TORCHPATCH_STRICT=1`` makes
it an error.
"""

import inspect
from typing import Any


class SourceUnavailable(RuntimeError):
    """torch's source of an object a patch must read is not readable."""


def _name(obj: Any) -> str:
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if qualname and module:
        return f"{module}.{qualname}"
    return str(getattr(obj, "__name__", None) or repr(obj))


def torch_source(obj: Any) -> str:
    """The source text of ``obj`` (a torch module, class or function); :class:`SourceUnavailable`
    where it cannot be read."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise SourceUnavailable(
            f"torch's source of {_name(obj)} is not readable ({type(exc).__name__}: {exc}); without it this patch "
            "cannot tell whether torch needs it, so torch is left as it is") from exc
