"""Attention: ``torch.nn.attention`` and ``torch.nn.functional.scaled_dot_product_attention``."""
