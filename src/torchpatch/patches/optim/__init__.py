"""``torch.optim``."""
