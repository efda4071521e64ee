"""gloo-destroy-hang: ``destroy_process_group()`` of a gloo group can hang forever, torch 2.0-2.7.

What breaks:   a gloo job prints its result, calls ``destroy_process_group()`` and one rank never
               exits (no error, no timeout: torchrun waits for it forever). A race: 7 of 20 runs of
               a 2-rank script (all_reduce, all_gather_object, destroy_process_group) on torch 2.1.2,
               with or without a barrier before the destroy.
Why:           the last reference to the group dies with the GIL held: 2.0 to 2.7 bind
               ``ProcessGroup`` with a plain ``intrusive_ptr`` holder (``init.cpp``: ``py::class_<
               ::c10d::ProcessGroup, c10::intrusive_ptr<::c10d::ProcessGroup>, PyProcessGroup>``),
               so ``~ProcessGroup`` drops its gloo backend and ``~ProcessGroupGloo`` joins gloo's
               worker threads (``for (auto& thread : threads_) thread.join();``) while holding the
               GIL. A worker that has just finished a collective drops its ``AsyncWork``
               (``runLoop``: ``workInProgress_[workerIndex].reset()``); if Python already dropped
               the work's tensor (``all_gather_object``'s temporaries, any collective on a
               temporary), that tensor's C++ side owns its Python object and freeing it waits for
               the GIL (``~TensorImpl`` -> ``PyObjectSlot::destroy_pyobj_if_needed`` -> ``decref``):
               the main thread waits for the worker, the worker for the GIL. A barrier does not
               help: it waits for the work to finish, not for the worker to drop it.
Torch:         2.0 (``ProcessGroup`` became a wrapper of per-device backends) to 2.7; 2.8 binds
               ``ProcessGroup`` with the holder that releases the GIL before destruction, as 1.13
               binds ``ProcessGroupGloo`` itself (1.13's default group is the gloo object: no hang).
Fix:           torch 2.8's semantics: ``destroy_process_group`` keeps the Python object of each
               destroyed group's gloo backend (``ProcessGroupGloo``, whose holder releases the GIL)
               while torch drops the group, and for as long as a group it destroyed stays alive in
               Python; the backend's last reference is then that object, whose destruction joins
               the workers with the GIL released.
Upstream:      https://github.com/pytorch/pytorch/pull/154976
"""

import weakref
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="gloo-destroy-hang",
    summary="destroy_process_group() of a gloo group no longer hangs at exit (gloo's workers joined with the GIL held)",
    torch=">=2.0,<2.8",
    upstream="https://github.com/pytorch/pytorch/pull/154976",
    behaviour="destroy_process_group frees gloo backends with the GIL released",
)


def gloo_backends(c10d: ModuleType, groups: List[Any]) -> List[Tuple[Any, Any]]:
    """``(group, its gloo backend's Python object)`` for each group with a gloo backend (one backend
    may serve several device types)."""
    import torch

    found = []
    for group in groups:
        for device_type in getattr(group, "_device_types", ()):
            try:
                backend = group._get_backend(torch.device(device_type))
            except RuntimeError:
                continue
            if isinstance(backend, c10d.ProcessGroupGloo) and all(b is not backend for _, b in found):
                found.append((group, backend))
    return found


def release_after(group: Any, backend: Any) -> None:
    """Keep ``backend`` until ``group``'s Python object is gone (both are dropped by then)."""
    finalizer = weakref.finalize(group, lambda _backend: None, backend)
    finalizer.atexit = False  # never drop it early at exit, while the group may still be alive


def keeping_backends(c10d: ModuleType) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        group: Optional[Any] = args[0] if args else kwargs.get("group")
        if group is None or group is c10d.GroupMember.WORLD:
            groups = list(c10d._world.pg_map)
        else:
            groups = [group] if group in c10d._world.pg_map else []
        held = gloo_backends(c10d, groups)
        try:
            return wrapped(*args, **kwargs)
        finally:
            for kept_group, backend in held:
                release_after(kept_group, backend)

    return wrapper


@PATCH.on_import("torch.distributed.distributed_c10d")
def free_backends_without_gil(patcher: Patcher, c10d: ModuleType) -> Optional[bool]:
    import torch.distributed as dist

    if not c10d.is_gloo_available():
        return False
    if not hasattr(c10d.ProcessGroup, "_get_backend"):
        return False  # before 2.0 the group is the backend, bound with the holder that releases the GIL
    original = c10d.destroy_process_group
    proxy = patcher.wrap(c10d, "destroy_process_group", keeping_backends(c10d))
    if getattr(dist, "destroy_process_group", None) is original:
        patcher.setattr(dist, "destroy_process_group", proxy)
    return True
