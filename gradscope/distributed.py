"""Several processes under torchrun: who scores which batch, on which device, and sharing tensors."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from .config import DistributedConfig
from .errors import ConfigError, DataError, one_line


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


def one_process(what: str, where: str) -> None:
    """Refuse ``what`` under torchrun: it runs in one process (every rank would do all of it,
    and write the same output at once)."""
    if world().size > 1:
        raise ConfigError(f"{what} runs in one process; run it without torchrun", where)


def world() -> World:
    """This process's place, from the variables torchrun sets for it. Variables it inherited
    from an outer job (gradscope started inside a torchrun worker) do not make it a rank: it
    runs alone. A rank whose variables are incomplete or not numbers is an error."""
    env = os.environ
    if "WORLD_SIZE" not in env or _inherited(env):
        return World()
    try:
        here = World(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ConfigError(f"a torchrun variable is not a number: {e}", "environment") from e
    if here.size < 1 or not 0 <= here.rank < here.size:
        raise ConfigError(
            f"RANK {here.rank} is not a rank of WORLD_SIZE {here.size}; launch with torchrun",
            "environment",
        )
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if here.size > 1 and not env.get(k)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE is {here.size} but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; launch the processes with torchrun",
            "environment",
        )
    return here


def _inherited(env: os._Environ) -> bool:
    """Whether this process's WORLD_SIZE and RANK are its parent's own (the parent is a torchrun
    worker), rather than set for it by a launcher, whose own environment lacks them."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:  # no /proc (macOS), or not ours to read: the variables decide
        return False
    parent = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return all(
        parent.get(key.encode()) == (env[key].encode() if key in env else None)
        for key in ("WORLD_SIZE", "RANK")
    )


@contextlib.contextmanager
def session(join_timeout: float = DistributedConfig.join_timeout) -> Iterator[World]:
    """The process group for the length of a run: gloo on CPU (plus NCCL for GPU tensors).

    Joining waits at most ``join_timeout`` seconds for the other processes (a process that
    inherited a launcher's variables would wait for peers that never come), and says so on
    stderr as it starts waiting; once joined, torch's own timeouts apply."""
    here = world()
    if here.size == 1 or dist.is_initialized():
        yield here
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(here.local_rank)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    _join(here, backend, join_timeout)
    try:
        yield here
    except RuntimeError as e:  # gloo's plain RuntimeError, NCCL's DistBackendError
        if not (isinstance(e, dist.DistError) or "/gloo/" in str(e)):
            raise
        raise DataError(
            f"rank {here.rank} of {here.size}: another process of the run stopped (its own "
            f"error is on its stderr), so this one stops too: {one_line(e)[:200]}",
            "distributed",
        ) from e
    finally:
        dist.destroy_process_group()


def _join(here: World, backend: str, join_timeout: float) -> None:
    """Meet the other processes at MASTER_ADDR:MASTER_PORT within ``join_timeout`` seconds."""
    at = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    print(
        f"rank {here.rank} of {here.size}: waiting up to {join_timeout:g} s for the other "
        f"processes of WORLD_SIZE={here.size} at {at} (distributed.join_timeout); not launched "
        "by torchrun? stop with Ctrl-C and unset WORLD_SIZE to run alone",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    try:
        store, _, _ = next(
            dist.rendezvous("env://", here.rank, here.size, timeout=timedelta(seconds=join_timeout))
        )
        store.set_timeout(default_pg_timeout)  # joined: later waits are torch's to bound
        dist.init_process_group(backend, store=store, rank=here.rank, world_size=here.size)
    except (RuntimeError, ValueError) as e:  # DistStoreError, a port in use, a bad address
        if time.monotonic() - start >= join_timeout:
            raise ConfigError(
                f"the {here.size} processes of WORLD_SIZE={here.size} did not all meet at {at} "
                f"within {join_timeout:g} s; launch them with torchrun, unset WORLD_SIZE to run "
                "alone, or raise distributed.join_timeout",
                "environment",
            ) from e
        raise ConfigError(
            f"cannot join the torchrun process group: {one_line(e)}", "environment"
        ) from e


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
