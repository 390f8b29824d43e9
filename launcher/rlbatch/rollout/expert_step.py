"""An expert-parallel group's per-row decoders kept in step (an MoE policy at parallel.ep > 1).

Every forward of an MoE decoder (rlbatch.engine.generation.LeanDecoder: prefill, decode,
extend) exchanges tokens with the rank's expert-parallel group by all-to-all, so the group's
ranks must run as many forwards, in the same order. Where each rank decodes on its own schedule
(agent harnesses' calls, a partial-rollout round's stream), a rank announces each forward of its
own to the group first (:class:`Ticking`: one all-reduce, "this rank forwards at this tick"),
and a rank with no forward at that tick runs the decoder's idle forward (each MoE layer on one
zero token) instead, until no rank of the group has one (:func:`drain`); the group then leaves
together. The samples do not change (a row's tokens depend on its key and the weights only).
"""

from __future__ import annotations

from typing import Any


class Ticking:
    """A per-row decoder whose every forward is announced to the expert-parallel group first,
    so that peers without a forward of their own run an idle one at the same tick
    (:func:`drain`). Everything else is the decoder's."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)

    @staticmethod
    def _tick() -> None:
        from rlbatch import distributed

        distributed.any_in_expert_group(True)

    def prefill(self, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        return self.decoder.prefill(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        return self.decoder.decode(*args, **kwargs)

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        return self.decoder.extend(*args, **kwargs)


def drain(decoder: Any) -> int:
    """This rank has no forward left: an idle forward of ``decoder`` at every tick a peer of
    the expert-parallel group still forwards at, until none does (every rank then leaves
    together). Returns the idle forwards run."""
    from rlbatch import distributed

    idle = 0
    while distributed.any_in_expert_group(False):
        decoder.idle()
        idle += 1
    return idle
