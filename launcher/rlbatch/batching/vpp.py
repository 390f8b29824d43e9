"""Megatron-core's micro-batch count rule for the interleaved (VPP) pipeline schedule.

With vpp > 1 and N = microbatch_group_size_per_vp_stage (default pp), megatron-core 0.16
(``forward_backward_pipelining_with_interleaving``) requires pp <= N <= M and
(M mod N == 0 or M mod N >= pp). Without interleaving any M >= 1 runs.
"""

from __future__ import annotations


def resolve_group_size(pp: int, vpp: int, microbatch_group_size: int | None) -> int:
    """N to hand to Megatron: the configured value with vpp > 1 (default pp), else pp."""
    if pp < 1 or vpp < 1:
        raise ValueError(f"parallel.pp={pp} and parallel.vpp={vpp} must be >= 1")
    if vpp == 1:
        return pp
    if pp < 2:
        raise ValueError(f"parallel.vpp={vpp} needs parallel.pp > 1 (got pp={pp}): set vpp=1")
    n = pp if microbatch_group_size is None else microbatch_group_size
    if n < pp:
        raise ValueError(
            f"parallel.microbatch_group_size_per_vp_stage={n} is smaller than parallel.pp={pp}: "
            "megatron-core needs pp <= N; raise it or leave it null (= pp)"
        )
    return n


def is_valid_count(m: int, pp: int, vpp: int, group_size: int) -> bool:
    """Whether megatron-core accepts m micro-batches (m = 0: an empty pass, nothing to run)."""
    if m == 0 or vpp == 1:
        return True
    rem = m % group_size
    return m >= group_size and (rem == 0 or rem >= pp)


def valid_count(natural: int, pp: int, vpp: int, group_size: int) -> int:
    """The smallest count >= natural that megatron-core accepts."""
    m = natural
    while not is_valid_count(m, pp, vpp, group_size):
        m = max(m + 1, group_size)
    return m
