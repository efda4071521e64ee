"""oom-error-alias: ``torch.OutOfMemoryError``, the top-level name of the CUDA out-of-memory error,
torch 1.13-2.3.

What breaks:   training loops written for torch >= 2.4 catch an out-of-memory error with
               ``except torch.OutOfMemoryError:`` (to skip a batch, or to retry with a smaller one).
               Python evaluates that expression only when an exception reaches the clause, so on
               torch 1.13 and 2.1 the first exception of *any* kind inside the ``try`` turns into
               ``AttributeError: module 'torch' has no attribute 'OutOfMemoryError'``, raised in
               place of the error being handled.
Torch:         1.13 and 2.1 have the class only as ``torch.cuda.OutOfMemoryError`` (a subclass of
               ``RuntimeError``); torch 2.4 has ``torch.OutOfMemoryError``, the very same class.
               Nothing is served where torch has the name.
Fix:           once torch is imported, set ``torch.OutOfMemoryError`` to ``torch.cuda.OutOfMemoryError``
               itself, so that ``except`` clauses with either name catch the error torch raises. The
               name is set as a plain attribute, not through a module ``__getattr__`` (torch 1.13 has
               none, and adding one slows every ``torch.X`` lookup on Python 3.11).
Upstream:      https://github.com/pytorch/pytorch/pull/121702 (the error made device-generic and
               exported as ``torch.OutOfMemoryError``, torch 2.4)
"""

from types import ModuleType

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="oom-error-alias",
    summary="torch.OutOfMemoryError (= torch.cuda.OutOfMemoryError)",
    torch="<2.4",
    upstream="https://github.com/pytorch/pytorch/pull/121702",
    behaviour="torch.OutOfMemoryError = torch.cuda.OutOfMemoryError, where missing",
)
PATCH.sets("torch", ("OutOfMemoryError",))


@PATCH.on_import("torch")
def set_out_of_memory_error(patcher: Patcher, torch: ModuleType) -> bool:
    if "OutOfMemoryError" in vars(torch):
        return False
    patcher.setattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return True
