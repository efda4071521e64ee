"""Distributed checkpoint (DCP): ``torch.distributed.checkpoint``."""
