"""py311-dataclass-defaults: torch 1.13's sharded-tensor metadata dataclass on Python 3.11.

What breaks:   on Python 3.11, ``import torch.distributed.fsdp`` (and anything that imports
               ``torch.distributed._shard``: sharded tensors, sharding specs, sharded optimizers)
               dies with ``ValueError: mutable default <class
               'torch.distributed._shard.sharded_tensor.metadata.TensorProperties'> for field
               tensor_properties is not allowed: use default_factory``. Python 3.11's dataclasses
               reject any unhashable default, and ``ShardedTensorMetadata.tensor_properties``
               defaults to a shared ``TensorProperties()`` instance (a plain, hence unhashable,
               dataclass). It is the only such field in torch 1.13.
Torch:         1.13 on Python 3.11 and later; torch 2.0 has the upstream fix.
Fix:           while ``torch/distributed/_shard/sharded_tensor/metadata.py`` runs (also under its
               deprecated alias ``torch.distributed._sharded_tensor.metadata``), the dataclass
               processing turns a field whose default is an unhashable dataclass instance equal to
               a fresh one into ``field(default_factory=<its class>)`` -- exactly upstream's change,
               so each metadata object gets its own ``TensorProperties``. Any other mutable default
               is left alone and fails as before. The hook wraps ``dataclasses._process_class``,
               which every ``@dataclass`` goes through at call time (wrapping the public
               ``dataclass``/``field`` would leave the wrapper bound in the importing modules'
               globals); the wrapper is removed as soon as the module body has run.
Upstream:      https://github.com/pytorch/pytorch/pull/91795 (``field(default_factory=TensorProperties)``)
"""

import dataclasses
from types import ModuleType
from typing import Any

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="py311-dataclass-defaults",
    summary="torch.distributed._shard / fsdp import on Python 3.11: TensorProperties default becomes a default_factory",
    torch="<2.0",
    python=">=3.11",
    upstream="https://github.com/pytorch/pytorch/pull/91795",
    behaviour="ShardedTensorMetadata.tensor_properties uses default_factory (Python 3.11 dataclasses)",
    errors=(
        Error(r"mutable default <class 'torch\.distributed\._shard\.sharded_tensor\.metadata\.TensorProperties'> for field tensor_properties is not allowed",
              "ValueError: mutable default <class 'torch.distributed._shard.sharded_tensor.metadata.TensorProperties'> for field tensor_properties is not allowed: use default_factory"),
    ),
)

METADATA_MODULES = (
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._sharded_tensor.metadata",  # 1.13's deprecated alias re-runs the same file
)


def _should_be_factory(value: Any) -> bool:
    """Whether a field default is an unhashable dataclass instance equal to a fresh one of its
    class: a default that ``default_factory=<its class>`` reproduces (upstream's change)."""
    cls = type(value)
    if not dataclasses.is_dataclass(cls) or cls.__hash__ is not None:
        return False
    try:
        return bool(cls() == value)
    except TypeError:  # the class has required fields: no zero-argument factory
        return False


def _factories_for_instance_defaults(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``dataclasses._process_class(cls, ...)``: rewrite the class's qualifying
    ``field(default=...)`` declarations before the dataclass is built."""
    cls = args[0]
    for name in vars(cls).get("__annotations__", {}):
        declared = vars(cls).get(name)
        if isinstance(declared, dataclasses.Field) and _should_be_factory(declared.default):
            declared.default_factory = type(declared.default)
            declared.default = dataclasses.MISSING
    return wrapped(*args, **kwargs)


def _while_defining(patcher: Patcher, module: ModuleType) -> None:
    if not callable(getattr(dataclasses, "_process_class", None)):
        raise RuntimeError("this Python's dataclasses has no _process_class to hook; cannot fix the default")
    patcher.wrap(dataclasses, "_process_class", _factories_for_instance_defaults)


for _name in METADATA_MODULES:
    PATCH.during_import(_name)(_while_defining)
