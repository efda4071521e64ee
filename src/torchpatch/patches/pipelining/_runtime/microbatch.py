"""Microbatching: split a step's batch into microbatches (``TensorChunkSpec``, ``_Replicate``) and
merge the last stage's outputs back (``merge_chunks``, ``_CustomReducer``, ``sum_reducer``)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__package__)  # the package's name, the one the runtime is known by

DEFAULT_CHUNK_DIM = 0


class TensorChunkSpec:
    """How to split a tensor argument into microbatches: along ``split_dim``."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.split_dim})"

    def __str__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(chunk_dims: Tuple[int, ...]) -> Any:
        """``TensorChunkSpec`` for each (nested) dimension of ``chunk_dims``, positional arguments."""
        leaves, spec = tree_flatten(chunk_dims)
        return tree_unflatten([TensorChunkSpec(d) for d in leaves], spec)

    @staticmethod
    def from_dict(chunk_dims: Dict[str, int]) -> Any:
        """``TensorChunkSpec`` for each (nested) dimension of ``chunk_dims``, keyword arguments."""
        leaves, spec = tree_flatten(chunk_dims)
        return tree_unflatten([TensorChunkSpec(d) for d in leaves], spec)


class _Replicate:
    """Chunk-spec marker (the class itself): the value goes whole into every microbatch."""


class _CustomReducer:
    """Merge spec: reduce the microbatches' values with ``reduce_fn`` from ``init_value``."""

    def __init__(self, init_value: Any, reduce_fn: Callable[[Any, Any], Any]) -> None:
        self.init_value = init_value
        self.reduce_fn = reduce_fn


class _LossReducer(_CustomReducer):
    pass


sum_reducer = _LossReducer(torch.tensor(0.0), lambda a, b: a + b)


def _shard(values: Dict[Any, Any], specs: Dict[Any, Any], chunks: int) -> List[Dict[Any, Any]]:
    """Split each value (a pytree) by its spec into ``chunks`` dicts. As in torch, the first tensor
    with fewer than ``chunks`` rows along its dimension lowers the count (with a warning), a later
    one raises; non-tensors and ``_Replicate`` leaves are replicated."""
    if set(values) != set(specs):
        raise ValueError(f"arguments {list(values)} and chunk specs {list(specs)} do not match")
    count, first_tensor = chunks, True
    split: Dict[Any, Tuple[Any, List[Any]]] = {}  # key -> (treespec, per leaf: chunks or a value)
    for key, value in values.items():
        leaves, treespec = tree_flatten(value)
        spec_leaves, _ = tree_flatten(specs[key])
        if len(leaves) != len(spec_leaves):
            raise ValueError(f"Argument value {value} did not have the same number of values as chunk spec "
                             f"{specs[key]}")
        parts: List[Any] = []
        for leaf, spec in zip(leaves, spec_leaves):
            if spec is _Replicate or not isinstance(leaf, torch.Tensor):
                parts.append(_Replicate)
                continue
            if not isinstance(spec, TensorChunkSpec):
                raise TypeError(f"Unrecognized chunk spec: {spec}")
            size = leaf.size(spec.split_dim)
            if size < count:
                if not first_tensor:
                    raise RuntimeError(
                        f"Arg {key} on chunking dimension has a size of {size}, smaller than the number of "
                        f"chunks {count}; other arguments have more rows. Adjust the number of microbatches.")
                logger.warning("Tensor size on chunking dimension is %s, downsizing the number of chunks "
                               "from %s to %s.", size, count, size)
                count = size
            parts.append(torch.tensor_split(leaf, count, spec.split_dim))
            first_tensor = False
        split[key] = (treespec, [(leaf, part) for leaf, part in zip(leaves, parts)])
    return [
        {key: tree_unflatten([leaf if part is _Replicate else part[i] for leaf, part in pairs], treespec)
         for key, (treespec, pairs) in split.items()}
        for i in range(count)
    ]


def split_args_kwargs_into_chunks(
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    chunks: int,
    args_chunk_spec: Optional[Tuple[Any, ...]] = None,
    kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
) -> Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]:
    """Split positional and keyword arguments into ``chunks`` microbatches (dimension 0 unless
    the specs say otherwise); returns the list of args tuples and the list of kwargs dicts."""
    kwargs = kwargs or {}
    if args_chunk_spec is None:
        args_chunk_spec = (TensorChunkSpec(DEFAULT_CHUNK_DIM),) * len(args)
    if kwargs_chunk_spec is None:
        kwargs_chunk_spec = dict.fromkeys(kwargs, TensorChunkSpec(DEFAULT_CHUNK_DIM))
    args_split = _shard(dict(enumerate(args)), dict(enumerate(args_chunk_spec)), chunks)
    kwargs_split = _shard(kwargs, kwargs_chunk_spec, len(args_split))
    if len(kwargs_split) < len(args_split):
        args_split = _shard(dict(enumerate(args)), dict(enumerate(args_chunk_spec)), len(kwargs_split))
    if len(args_split) != len(kwargs_split):
        raise RuntimeError("args and kwargs are split into different number of chunks: "
                           f"{len(args_split)}, {len(kwargs_split)}")
    return [tuple(chunk[i] for i in range(len(args))) for chunk in args_split], kwargs_split


def merge_chunks(chunks: List[Any], chunk_spec: Any) -> Any:
    """Merge microbatch values into one: ``TensorChunkSpec`` leaves are concatenated, reducers
    reduce, other leaves must be equal in every chunk (``chunk_spec`` None: concatenate along 0)."""
    if chunk_spec is not None:
        spec_leaves, treespec = tree_flatten(chunk_spec)
    else:
        first, treespec = tree_flatten(chunks[0])
        spec_leaves = [TensorChunkSpec(DEFAULT_CHUNK_DIM)] * len(first)
    flat = []
    for chunk in chunks:
        leaves, _ = tree_flatten(chunk)
        if len(leaves) != len(spec_leaves):
            raise ValueError(f"Chunk {chunk} did not match chunk spec {chunk_spec}")
        flat.append(leaves)
    merged = []
    for i, spec in enumerate(spec_leaves):
        column = [leaves[i] for leaves in flat]
        if isinstance(spec, TensorChunkSpec):
            merged.append(torch.cat(column, dim=spec.split_dim))
        elif isinstance(spec, _CustomReducer):
            value = spec.init_value
            for item in column:
                value = spec.reduce_fn(value, item)
            merged.append(value)
        else:
            if any(item != column[0] for item in column[1:]):
                raise ValueError(f"values {column} differ between microbatches but are not merged by a chunk spec")
            merged.append(column[0])
    return tree_unflatten(merged, treespec)
