"""Topology of one rank of a multi-container job (trainer/multinode.py): the global rank
slots come from --job-layout, the GPU from this container's own lists."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.topology import Topology


@dataclass
class JobTopology(Topology):
    local_gpu: int = 0

    @property
    def gpu(self) -> int:
        return self.local_gpu
