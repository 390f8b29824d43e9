"""ParallelLayout: the one description of where a process sits in the parallel grid.

Pure (ints and a device string; no torch, no megatron), validated once on construction. The
engine builds it from megatron's parallel state (``rlbatch.engine.parallel.initialize`` /
``current_layout``); everything else (the GRPO step, checkpoints' metadata, the training loop)
reads it. ``ParallelConfig`` is what the user asks for; this is what the process got.
"""

from __future__ import annotations

from dataclasses import dataclass

SIZES = ("tp", "pp", "vpp", "cp", "dp")


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of the tp x pp (x vpp) x cp x dp grid and this process's coordinates in it.

    The default is a single process (every degree 1, every rank 0)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (1 = no interleaving)."""
    cp: int = 1
    dp: int = 1
    rank: int = 0
    """Global rank."""
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    local_rank: int = 0
    """Rank on this node (the GPU index on a CUDA machine)."""
    device: str = "cpu"
    """"cpu" or "cuda:<local_rank>"."""

    def __post_init__(self) -> None:
        for name in SIZES:
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name}={getattr(self, name)}: must be >= 1")
        for name, size in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("dp", self.dp)):
            coord = getattr(self, f"{name}_rank")
            if not 0 <= coord < size:
                raise ValueError(f"ParallelLayout.{name}_rank={coord}: not in [0, {size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelLayout.rank={self.rank}: not in [0, {self.world_size})")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def sizes(self) -> dict[str, int]:
        """{"tp", "pp", "vpp", "cp", "dp"}: the layout without this process's position (what a
        checkpoint records and a resume compares)."""
        return {name: getattr(self, name) for name in SIZES}
