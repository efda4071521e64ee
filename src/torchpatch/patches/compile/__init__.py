"""``torch.compile``."""
