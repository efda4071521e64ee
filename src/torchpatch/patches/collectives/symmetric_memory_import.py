"""symmetric-memory-import: ``import torch.distributed._symmetric_memory`` on torch 2.4, every use
refused, every availability probe answering False.

What breaks:   torchtitan 0.3.0 imports the module at module level for its MoE expert-parallel
               all-to-all (``torchtitan.distributed.minimal_async_ep.api``, reached from
               ``torchtitan.models.common``, so from every model, llama3 included): on torch 2.4 each run
               stops at ``ModuleNotFoundError: No module named 'torch.distributed._symmetric_memory'``,
               though only MoE's MinimalAsyncEP and async TP would call it.
Torch:         2.5 added symmetric memory: a C++ allocator, rendezvous and kernels (CUDA, later
               NVSHMEM) compiled into torch. 2.4's build has none of it, and it cannot be served
               (not_backportable.json).
Fix:           serve the module so that importing it works, with torch 2.15's public functions
               (``__all__``) and the two torchtitan calls outside it (``enable_symm_mem_for_group``,
               ``is_symm_mem_enabled_for_group``); each raises ``NotImplementedError`` naming the missing
               C++ piece. Nothing pretends to work: there is no allocation, no backend (``get_backend``
               raises rather than answer None, which would read as "no backend for this device").
               The three predicates answer False, what torch 2.15 answers where the piece is missing, so
               that code probing them takes its path without symmetric memory (tests/test_probes.py):
               ``is_nvshmem_available()`` (2.15: False where the build or system lacks NVSHMEM),
               ``is_symm_mem_enabled_for_group(group)`` (False where no allocator is registered for the
               accelerator) and ``is_symm_mem_tensor(tensor)`` (no tensor here came from symmetric memory).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_symmetric_memory/__init__.py
"""

from types import ModuleType
from typing import Any, Callable, Dict

from torchpatch import Patch

PATCH = Patch(
    id="symmetric-memory-import",
    summary="torch.distributed._symmetric_memory importable on torch 2.4 (torchtitan 0.3 imports it); its is_* probes "
            "answer False, every other function raises NotImplementedError: symmetric memory is C++ of torch 2.5",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_symmetric_memory/__init__.py",
)
MODULE = "torch.distributed._symmetric_memory"
NAMES = ("empty", "is_symm_mem_tensor", "rendezvous", "is_nvshmem_available", "set_backend", "get_backend", "get",
         "set_signal_pad_size", "get_signal_pad_size", "get_mem_pool", "reduce_scatter_offset", "all_to_all_nd",
         "enable_symm_mem_for_group", "is_symm_mem_enabled_for_group")
PATCH.sets(MODULE, NAMES)


def is_nvshmem_available() -> bool:
    """False: this torch's build has no NVSHMEM (torch 2.15 answers False where the build lacks it)."""
    return False


def is_symm_mem_enabled_for_group(group_name: str) -> bool:
    """False: no symmetric-memory allocator exists for any group (2.15: False where none is registered)."""
    return False


def is_symm_mem_tensor(tensor: Any) -> bool:
    """False: no tensor of this torch was allocated by symmetric memory."""
    return False


# Availability probes, answering False as torch 2.15 does where the piece is missing.
PROBES: Dict[str, Callable[..., bool]] = {
    fn.__name__: fn for fn in (is_nvshmem_available, is_symm_mem_enabled_for_group, is_symm_mem_tensor)}
for _probe in PROBES.values():
    _probe.__module__ = MODULE


def _refusing(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        import torch

        raise NotImplementedError(
            f"torch.distributed._symmetric_memory.{name}: symmetric memory needs torch >= 2.5, whose C++ "
            f"SymmetricMemory allocator, rendezvous and kernels (CUDA/NVSHMEM) torch {torch.__version__}'s build "
            "lacks; torchpatch serves the module only so that code importing it loads")

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = MODULE
    return refused


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    for name in NAMES:
        setattr(module, name, PROBES.get(name) or _refusing(name))
    module.__all__ = [name for name in NAMES if not name.endswith("_for_group")]
