"""torch's top-level namespace and modules that moved or went (``torch._six``, ``torch.OutOfMemoryError``, relocated ``torch.distributed`` modules)."""
