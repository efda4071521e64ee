"""Activation checkpointing: ``torch.utils.checkpoint`` (selective activation checkpointing, SAC)."""
