"""``torch.profiler`` and ``torch.autograd.profiler``."""
