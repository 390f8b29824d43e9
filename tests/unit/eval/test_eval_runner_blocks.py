"""How the held-out prompts are cut into generate calls and dealt to the data-parallel ranks."""

from __future__ import annotations

import pytest

from rlbatch.eval.runner import prompt_blocks


def _deal(blocks, dp):
    return [blocks[r::dp] for r in range(dp)]


@pytest.mark.parametrize("n", [2, 3, 9, 13, 16])
def test_expert_parallel_ranks_make_as_many_calls_with_every_prompt_once(n):
    """Every MoE forward is an all-to-all over the expert group: its ranks must decode the
    same number of blocks (9 prompts in blocks of 4 used to deal 2 calls to one rank, 1 to
    the other, and the evaluation hung)."""
    prompts = list(range(n))
    blocks = prompt_blocks(prompts, 4, 2, 2)
    assert [p for b in blocks for p in b] == prompts
    assert all(0 < len(b) <= 4 for b in blocks)
    assert len({len(calls) for calls in _deal(blocks, 2)}) == 1


def test_without_expert_parallelism_the_blocks_are_as_before():
    assert prompt_blocks(list(range(9)), 4, 2, 1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


def test_too_few_prompts_for_the_expert_group_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="eval.max_prompts"):
        prompt_blocks([0], 4, 2, 2)
