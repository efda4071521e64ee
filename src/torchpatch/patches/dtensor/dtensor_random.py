"""dtensor-random: ``torch.distributed.tensor._random.manual_seed`` (DTensor's seeding, with the
semantics of torch 2.13), torch 2.1-2.4.

What breaks:   torchtitan (early 2025) seeds DTensor's random ops in ``set_determinism`` with
               ``torch.distributed.tensor._random.manual_seed(seed, spmd_mesh)``, inside a function;
               on torch 2.1–2.4 the call dies with ``AttributeError: module
               'torch.distributed.tensor' has no attribute '_random'`` (and
               ``import torch.distributed.tensor._random`` with ``ModuleNotFoundError``).
Torch:         2.1–2.4 keep the module as ``torch.distributed._tensor.random``. It is not a mere
               relocation (``patches/_data/relocations.json`` lists it with ``"alias": false``): the RNG
               tracker's constructor changed, and ``manual_seed`` changed meaning. The old one
               all-gathers the seed over the default group and raises unless every rank passes the
               same seed, and fails on a CPU mesh (2.1: ``NotImplementedError``; 2.4:
               ``AttributeError`` on ``torch.cpu.get_rng_state``); torch 2.13's seeds the ranks of
               ``device_mesh`` without any collective (torchtitan passes a different seed
               per pipeline stage), warns and does nothing on a mesh whose device has no RNG state
               to share (CPU), and raises if the calling rank is not in the mesh. 1.13 has no
               DTensor: nothing is served there.
Fix:           serve the module ``torch.distributed.tensor._random`` (also as the attribute of its
               package, as torchtitan reaches it) with ``is_rng_supported_mesh`` (torch's own) and
               ``manual_seed(seed, device_mesh)`` with torch 2.13's semantics on the installed
               torch's tracker: on a supported mesh it creates the ``OffsetBasedRNGTracker`` if
               there is none (without the constructor's state broadcast, which 2.13 skips too and
               which the seed overwrites anyway), seeds it (a ``TensorParallelRNGTracker`` set up
               by torch's tensor parallelism gets its own seeding), and seeds torch's generator
               with ``torch.manual_seed`` as 2.13 does. ``OffsetBasedRNGTracker`` itself, whose
               constructor changed, is not served.
Upstream:      https://github.com/pytorch/pytorch/pull/133881 (DTensor modules under
               ``torch.distributed.tensor``, torch 2.5); torchtitan's caller:
               https://github.com/pytorch/torchtitan/blob/main/torchtitan/distributed/utils.py
"""

import importlib
import warnings
from types import ModuleType
from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-random",
    summary="torch.distributed.tensor._random.manual_seed (torch 2.13's DTensor seeding)",
    torch=">=2.1,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/133881",
)

MODULE = "torch.distributed.tensor._random"


def manual_seed(seed: int, device_mesh: Any) -> None:
    """Sets the seed for generating random numbers for the calling rank.

    Args:
        seed (int): The desired seed.
        device_mesh (:class:`DeviceMesh`): The device mesh to set the seed. It is
            required that the ``device_mesh`` include the calling rank. This is
            to ensure that the SPMD region maintains a synchronous RNG state, which
            means no ranks should be initialized with values other than ``seed``.

    .. warning::
        :func:`manual_seed` does not check the ``seed`` value correctness. Users must
        ensure on their own that the value passed in is the desired ``seed`` for ranks
        within ``device_mesh``. Current implementation only supports a GPU device mesh.
    """
    import torch
    from torch.distributed._tensor import random

    if not random.is_rng_supported_mesh(device_mesh):
        warnings.warn(f"DTensor manual_seed() may not have complete support on {device_mesh.device_type} device mesh",
                      stacklevel=2)
        return
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(
            "manual_seed requires the current rank to be a part of the device mesh otherwise DTensor RNG state on "
            "the rank will not be initialized and the behavior of DTensor random ops is undefined."
        )
    if not random._rng_tracker:
        tracker = random.OffsetBasedRNGTracker.__new__(random.OffsetBasedRNGTracker)
        super(random.OffsetBasedRNGTracker, tracker).__init__(device_mesh.device_type)  # no state broadcast
        random._rng_tracker = tracker
    if isinstance(random._rng_tracker, random.TensorParallelRNGTracker):
        random._rng_tracker._manual_seed(device_mesh, seed)
    else:
        random._rng_tracker._manual_seed(seed)
    torch.manual_seed(seed)


PATCH.sets(MODULE, ("is_rng_supported_mesh", "manual_seed"))


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    from torch.distributed._tensor import random

    module.is_rng_supported_mesh = random.is_rng_supported_mesh
    module.manual_seed = manual_seed
    module.__all__ = ["is_rng_supported_mesh", "manual_seed"]


@PATCH.symbol("torch.distributed.tensor", "_random")
def serve_random_attribute() -> ModuleType:
    return importlib.import_module(MODULE)
