"""Several processes under torchrun: who scores which batch, on which device, and sharing tensors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owns(self, batch: int) -> bool:
        """Batches are dealt round-robin: rank r scores batches r, r + size, r + 2 size, ..."""
        return batch % self.size == self.rank

    def rows(self, total: int | None, batch_size: int) -> int | None:
        """How many of ``total`` rows this rank scores (None when ``total`` is unknown)."""
        if total is None:
            return None
        batches = range(self.rank, -(-total // batch_size), self.size)
        return sum(min(batch_size, total - b * batch_size) for b in batches)

    def device(self, name: str) -> str:
        """Each rank on its own GPU: cuda:LOCAL_RANK for auto/cuda when CUDA is here, else the CPU."""
        if self.size == 1 or name.startswith("cuda:"):
            return name
        if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
            return f"cuda:{self.local_rank}"
        return "cpu"


def world() -> World:
    """This process's place, from torchrun's environment variables."""
    if "WORLD_SIZE" not in os.environ:
        return World()
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def session() -> Iterator[World]:
    """The process group for the length of a run: gloo on CPU (plus NCCL for GPU tensors)."""
    here = world()
    if here.size == 1 or dist.is_initialized():
        yield here
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(here.local_rank)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        yield here
    finally:
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank; nothing to wait for in one process."""
    if dist.is_initialized():
        dist.barrier()


def broadcast_tensors(
    tensors: dict[str, Tensor] | None, device: torch.device | str = "cpu", src: int = 0
) -> dict[str, Tensor]:
    """Rank ``src``'s named tensors on every rank, e.g. a reference gradient computed once.

    Rank ``src`` passes its tensors; the others pass None and receive copies on ``device`` (the
    CPU under gloo). In one process the tensors come back as they are.
    """
    if not dist.is_initialized():
        return dict(tensors)
    here = dist.get_rank() == src
    layout = [[(k, t.shape, t.dtype) for k, t in tensors.items()] if here else None]
    dist.broadcast_object_list(layout, src)  # receivers learn the names and shapes first
    out = {}
    for name, shape, dtype in layout[0]:
        t = tensors[name].contiguous() if here else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src)
        out[name] = t
    return out
