"""The query/key-value head check that torch 2.15's FlexAttention and varlen attention share (their
own words), for the backports of both."""


def check_gqa_heads(heads_q: int, heads_kv: int, enable_gqa: bool) -> None:
    """Raise torch's ``ValueError`` unless the head counts match, or, with ``enable_gqa``, the query's
    is a multiple of the key/value's."""
    if not enable_gqa and heads_q != heads_kv:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={heads_q} "
                         f"and Hkv={heads_kv}. Try setting enable_gqa=True for GQA.")
    if enable_gqa and heads_q % heads_kv != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={heads_q} and Hkv={heads_kv}.")
