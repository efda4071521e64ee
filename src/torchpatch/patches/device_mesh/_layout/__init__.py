"""Torch 2.15's rank-layout algebra (``torch.distributed._pycute``, ``torch.distributed._mesh_layout``),
written for the mesh-layout patch."""
