"""``BlockMask`` (FlexAttention's block-sparse mask: for each row of query blocks, the key/value blocks
it attends to, split into partial blocks, where the mask_mod decides per element, and full ones) and
``create_block_mask``, as torch 2.15 has them."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .mods import _MODULE, _mask_mod_signature, create_mask, default_device, is_score_mod, noop_mask

_DEFAULT_SPARSE_BLOCK_SIZE = 128
_LARGE_SPARSE_BLOCK_SIZE = 1 << 30


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _round_up_to_multiple(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _broadcast_to_dim(x: Tensor, dim: int) -> Tensor:
    """``x`` with leading size-1 dimensions up to ``dim`` dimensions."""
    while x.dim() < dim:
        x = x.unsqueeze(0)
    return x


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, num_cols: int) -> Tensor:
    """The [..., rows, num_cols] int32 0/1 block grid of an ordered block list (entries past
    ``num_blocks`` ignored)."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    dense = indices.new_zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.int32)
    dense.scatter_(-1, torch.where(valid, indices, num_cols).long(), 1)  # invalid entries land in the extra column
    return dense[..., :num_cols].contiguous()


def _dense_to_ordered(dense: Tensor) -> Tuple[Tensor, Tensor]:
    """An ordered block list (count per row, column indices: present blocks first, ascending) of a block grid."""
    dense = dense.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def _transpose_ordered(num_blocks: Tensor, indices: Tensor, num_cols: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The ordered block list of the transposed grid (``num_cols`` defaults to the indices' width, as torch's)."""
    width = indices.shape[-1] if num_cols is None else num_cols
    return _dense_to_ordered(_ordered_to_dense(num_blocks, indices, width).transpose(-2, -1))


def _crop_ordered(num_blocks: Tensor, indices: Tensor, rows: int, cols: int) -> Tuple[Tensor, Tensor]:
    indices, num_blocks = indices[:, :, :rows, :cols], num_blocks[:, :, :rows]
    valid = torch.arange(indices.shape[-1], dtype=num_blocks.dtype, device=indices.device) < num_blocks[..., None]
    return torch.sum(valid & (indices < cols), dim=-1).to(torch.int32), indices


def _sliced_mask_mod_error(batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """The mask_mod of a sliced BlockMask: raises torch's error (a slice has no valid mask_mod)."""
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask. When you slice a BlockMask using [], the mask_mod attribute "
        "is reset. You must set it from the original BlockMask's mask_mod.\n\nIncorrect usage:"
        "\n  base_mask = create_block_mask(my_mask_fn, ...)\n  sliced_mask = base_mask[:, :, block_idx]"
        "\n  sliced_mask.mask_mod = apply_offset(sliced_mask.mask_mod, offset)  # WRONG!\n\nCorrect usage:"
        "\n  base_mask = create_block_mask(my_mask_fn, ...)\n  sliced_mask = base_mask[:, :, block_idx]"
        "\n  sliced_mask.mask_mod = apply_offset(base_mask.mask_mod, offset)  # Use base_mask!")


class BlockMask:
    r"""BlockMask is our format for representing a block-sparse attention mask: a KV_BLOCK_SIZE x
    Q_BLOCK_SIZE block is sparse (skipped) only if every element in it is masked. ``kv_num_blocks[...,
    row]`` / ``kv_indices[..., row, :]`` list the partial key/value blocks of each query-block row (where
    ``mask_mod`` applies), ``full_kv_num_blocks`` / ``full_kv_indices`` the full ones (attended without
    ``mask_mod``); the ``q_*`` pairs are their transposes (for the backward pass).
    """

    _TENSOR_ATTRS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full",
                     "dq_kv_order"]
    _CONTEXT_ATTRS = ["seq_lengths", "BLOCK_SIZE", "mask_mod", "dq_kv_order_spt"]

    def __init__(self, seq_lengths: Tuple[int, int], kv_num_blocks: Tensor, kv_indices: Tensor,
                 full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
                 q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor], full_q_num_blocks: Optional[Tensor],
                 full_q_indices: Optional[Tensor],
                 BLOCK_SIZE: Tuple[int, int] = (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE),
                 mask_mod: _mask_mod_signature = noop_mask, *, dq_write_order: Optional[Tensor] = None,
                 dq_write_order_full: Optional[Tensor] = None, dq_kv_order: Optional[Tensor] = None,
                 dq_kv_order_spt: Optional[bool] = None) -> None:
        if kv_indices.dim() < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if kv_num_blocks is None:
            raise AssertionError("kv_num_blocks must be provided")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise AssertionError("full_kv_num_blocks and full_kv_indices must be both provided or omitted")
        if (full_q_num_blocks is None) != (full_q_indices is None):
            raise AssertionError("full_q_num_blocks and full_q_indices must be both provided or omitted")
        if dq_write_order_full is not None and dq_write_order is None:
            raise ValueError("dq_write_order_full requires dq_write_order")
        self.seq_lengths = seq_lengths
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.dq_write_order, self.dq_write_order_full = dq_write_order, dq_write_order_full
        self.dq_kv_order, self.dq_kv_order_spt = dq_kv_order, dq_kv_order_spt
        self.BLOCK_SIZE = BLOCK_SIZE
        self.mask_mod = mask_mod

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor] = None,
                       full_kv_indices: Optional[Tensor] = None,
                       BLOCK_SIZE: Union[int, Tuple[int, int]] = _DEFAULT_SPARSE_BLOCK_SIZE,
                       mask_mod: Optional[_mask_mod_signature] = None,
                       seq_lengths: Optional[Tuple[int, int]] = None, compute_q_blocks: bool = True, *,
                       dq_write_order: Optional[Tensor] = None, dq_write_order_full: Optional[Tensor] = None,
                       dq_kv_order: Union[Tensor, bool, None] = None) -> "BlockMask":
        """Creates a BlockMask from the key/value block lists; the query-side lists (``q_num_blocks``,
        ``q_indices`` and their full-block pair) are their transposes unless ``compute_q_blocks=False``."""
        if kv_indices.dim() < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise AssertionError("full_kv_num_blocks and full_kv_indices must be both provided or omitted")
        if dq_kv_order is not None and not isinstance(dq_kv_order, (bool, Tensor)):
            raise ValueError("dq_kv_order must be a bool, Tensor, or None")
        block_size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block_size[0], kv_indices.shape[-1] * block_size[1])
        kv_num_cols = _cdiv(seq_lengths[1], block_size[1])
        q_blocks: Tuple[Optional[Tensor], ...] = (None, None, None, None)
        if compute_q_blocks:
            full_q = ((None, None) if full_kv_num_blocks is None
                      else _transpose_ordered(full_kv_num_blocks, full_kv_indices, kv_num_cols))
            q_blocks = _transpose_ordered(kv_num_blocks, kv_indices, kv_num_cols) + full_q
        return cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *q_blocks,
                   BLOCK_SIZE=block_size, mask_mod=noop_mask if mask_mod is None else mask_mod,
                   dq_write_order=dq_write_order, dq_write_order_full=dq_write_order_full,
                   dq_kv_order=dq_kv_order if isinstance(dq_kv_order, Tensor) else None,
                   dq_kv_order_spt=dq_kv_order if isinstance(dq_kv_order, bool) else None)

    def as_tuple(self, flatten: bool = True) -> Tuple[Any, ...]:
        """The BlockMask's attributes as a tuple; ``flatten`` spreads ``seq_lengths`` and ``BLOCK_SIZE``."""
        seq_lengths = tuple(self.seq_lengths) if flatten else (self.seq_lengths,)
        block_size = tuple(self.BLOCK_SIZE) if flatten else (self.BLOCK_SIZE,)
        return (*seq_lengths, *(getattr(self, name) for name in self._TENSOR_ATTRS), self.dq_kv_order_spt,
                *block_size, self.mask_mod)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self) -> str:
        def shape_of(name: str) -> Any:
            tensor = getattr(self, name)
            return None if tensor is None else tensor.shape

        fields = "".join(f"    {name}={shape_of(name)},\n" for name in self._TENSOR_ATTRS[:8])
        return (f"BlockMask(\n{fields}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
                f"    sparsity={self.sparsity():.2f}%,\n"
                f"    mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)}\n)")

    def _query_length_of(self, q_index: Union[int, slice, Tensor], selected_rows: int) -> int:
        """The logical query length of the selected query-block rows (a partial last block counted as it is)."""
        q_block, q_len = self.BLOCK_SIZE[0], self.seq_lengths[0]
        if not isinstance(q_index, slice):
            return selected_rows * q_block
        rows = range(self.kv_num_blocks.shape[-1])[q_index]
        if len(rows) == 0:
            return 0
        if rows.step == 1:
            return min(rows.stop * q_block, q_len) - min(rows.start * q_block, q_len)
        length = len(rows) * q_block
        if q_len % q_block and self.kv_num_blocks.shape[-1] - 1 in rows:
            length -= q_block - q_len % q_block
        return length

    def __getitem__(self, index: Union[int, slice, Tensor, Tuple[Union[int, slice, Tensor], ...]]) -> "BlockMask":
        """A new BlockMask of the selected batch, head and query-block rows (up to three indices; an int keeps
        its dimension). Its mask_mod raises: install one that fits the selected query rows."""
        self._no_write_order("Slicing")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError("BlockMask indexing supports batch, head, and Q-block dimensions")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        index = tuple((slice(i + n, i + n + 1) if -n <= i < 0 else slice(i, i + 1)) if isinstance(i, int) else i
                      for i, n in zip(padded, self.kv_num_blocks.shape[:3]))
        full = (None, None) if self.full_kv_num_blocks is None else (self.full_kv_num_blocks[index],
                                                                     self.full_kv_indices[index])
        kv_indices = self.kv_indices[index]
        sliced = BlockMask.from_kv_blocks(
            self.kv_num_blocks[index], kv_indices, *full, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=_sliced_mask_mod_error,
            seq_lengths=(self._query_length_of(index[2], kv_indices.shape[-2]), self.seq_lengths[1]),
            compute_q_blocks=self.q_indices is not None)
        sliced.dq_kv_order_spt = self.dq_kv_order_spt
        return sliced

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """This mask cropped to its upper left ``new_q_len`` x ``new_kv_len`` corner."""
        self._no_write_order("Adjusting")
        rows, cols = _cdiv(new_q_len, self.BLOCK_SIZE[0]), _cdiv(new_kv_len, self.BLOCK_SIZE[1])
        full = (None, None) if self.full_kv_num_blocks is None else _crop_ordered(
            self.full_kv_num_blocks, self.full_kv_indices, rows, cols)
        adjusted = self.from_kv_blocks(*_crop_ordered(self.kv_num_blocks, self.kv_indices, rows, cols), *full,
                                       BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                                       seq_lengths=(new_q_len, new_kv_len), compute_q_blocks=self.q_indices is not None)
        adjusted.dq_kv_order_spt = self.dq_kv_order_spt
        return adjusted

    def _no_write_order(self, what: str) -> None:
        if self.dq_write_order is not None or self.dq_kv_order is not None:
            raise NotImplementedError(
                f"{what} a BlockMask that carries dQ write-order metadata needs torch >= 2.13: the metadata serves "
                f"the FLASH backend's deterministic backward, which torch {torch.__version__} lacks")

    def numel(self) -> int:
        """Returns the number of elements (not accounting for sparsity) in the mask."""
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """Computes the percentage of blocks that are sparse (i.e. not computed)"""
        total = math.prod(self.kv_num_blocks.shape[:-1])
        for seq_len, block_size in zip(self.seq_lengths, self.BLOCK_SIZE):
            total *= _cdiv(seq_len, block_size)
        computed = self.kv_num_blocks.sum()
        if self.full_kv_num_blocks is not None:
            computed = computed + self.full_kv_num_blocks.sum()
        return 100 * (1 - computed.item() / total)

    def to_dense(self) -> Tensor:
        """Returns a dense block that is equivalent to the block mask."""
        dense = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, self.kv_indices.shape[-1])
        if self.full_kv_num_blocks is not None:
            dense = dense | _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices,
                                              self.full_kv_indices.shape[-1])
        return dense

    def to_string(self, grid_size: Union[int, Tuple[int, int]] = (20, 20), limit: int = 4) -> str:
        """Returns a string representation of the block mask (one grid per batch and head, at most
        ``limit``): █ a computed region, ░ a partly computed one. If grid_size is -1, prints out an
        uncompressed version."""
        dense = self.to_dense()
        *batch_dims, num_rows, num_cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = num_rows, num_cols
        else:
            max_rows, max_cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        row_step, col_step = max(1, _cdiv(num_rows, max_rows)), max(1, _cdiv(num_cols, max_cols))

        def cell(section: Tensor) -> str:
            share = section.float().mean().item()
            return "█" if share == 1 else " " if share == 0 else "░"

        grids = []
        for count, batch_index in enumerate(itertools.product(*(range(n) for n in batch_dims))):
            if count == limit:
                grids += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                          "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            grid = dense[batch_index]
            lines = ("".join(cell(grid[r:r + row_step, c:c + col_step]) * 2 for c in range(0, num_cols, col_step))
                     for r in range(0, num_rows, row_step))
            grids.append(f"{batch_index}\n" + "".join(line + "\n" for line in lines))
        return "\n".join(grids)

    def to(self, device: Union[torch.device, str]) -> "BlockMask":
        """A new BlockMask with its tensors on ``device``."""
        tensors = {name: None if getattr(self, name) is None else getattr(self, name).to(device)
                   for name in self._TENSOR_ATTRS}
        return BlockMask(seq_lengths=self.seq_lengths, **tensors, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                         dq_kv_order_spt=self.dq_kv_order_spt)


def _mask_to_block_grids(mask: Tensor, q_block: int, kv_block: int,
                         separate_full_blocks: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The int8 grids of partial blocks (some element attended) and full ones (every element) of a
    [B, H, Q, KV] bool mask, padded with masked elements to whole blocks; without
    ``separate_full_blocks`` every non-empty block counts as partial."""
    mask = torch.nn.functional.pad(mask, (0, -mask.shape[-1] % kv_block, 0, -mask.shape[-2] % q_block))
    B, H, Q, KV = mask.shape
    counts = mask.view(B, H, Q // q_block, q_block, KV // kv_block, kv_block).sum(dim=(3, 5))
    if not separate_full_blocks:
        return (counts > 0).to(torch.int8), None
    full = counts == q_block * kv_block
    return ((counts > 0) & ~full).to(torch.int8), full.to(torch.int8)


def create_block_mask(mask_mod: _mask_mod_signature, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Any = None, BLOCK_SIZE: Union[int, Tuple[int, int]] = _DEFAULT_SPARSE_BLOCK_SIZE,
                      _compile: bool = False, separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True) -> BlockMask:
    r"""This function creates a block mask from a mask_mod function (``mask_mod(b, h, q_idx, kv_idx)``:
    True where attention is allowed), evaluated for every element of a B x H x Q_LEN x KV_LEN grid
    (B, H: None means 1) on ``device`` (default: the accelerator, else the CPU), in blocks of
    BLOCK_SIZE (one int, or (Q, KV)). ``_compile`` (deprecated upstream) changes nothing here: the
    mask is made in eager mode either way."""
    device = default_device() if device is None else device
    if is_score_mod(mask_mod):
        raise AssertionError(f"create-block_mask requires a mask_mod function! Got {mask_mod}")
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    if _compile:
        warnings.warn("_compile flag on create_block_mask was originally added to work around a torch.compile "
                      "limitation. That limitation has since been addressed. So, to compile create_block_mask, we "
                      "suggest doing torch.compile(create_block_mask). This still works for now, but will be "
                      "removed in the future.", DeprecationWarning, stacklevel=2)
    if not isinstance(dq_kv_order, bool):
        raise ValueError("dq_kv_order must be a bool when using create_block_mask")
    if compute_dq_write_order:
        raise NotImplementedError(
            f"create_block_mask(compute_dq_write_order=True) needs torch >= 2.13: the dQ write-order metadata serves "
            f"the FLASH backend's deterministic backward, which torch {torch.__version__} lacks")
    mask = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device)
    partial, full = _mask_to_block_grids(mask, q_block, kv_block, separate_full_blocks)
    full_blocks = (None, None) if full is None else _dense_to_ordered(full)
    return BlockMask.from_kv_blocks(*_dense_to_ordered(partial), *full_blocks, BLOCK_SIZE=(q_block, kv_block),
                                    mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


for _public in (BlockMask, create_block_mask):
    _public.__module__ = _MODULE
