"""FlexAttention for a torch that lacks ``torch.nn.attention.flex_attention`` (torch 2.4), behind the
``flex-attention-module`` patch: torch 2.15's eager semantics, written here. Not a patch (the leading
underscore): it imports torch, and is imported only when the served module is. One job per module:
``mods`` (mask_mod / score_mod helpers and their vectorised evaluation), ``block_mask`` (``BlockMask``
and ``create_block_mask``), ``attention`` (``flex_attention`` itself)."""
