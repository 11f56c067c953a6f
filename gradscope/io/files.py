"""The files a run reads, as it reads them: each hashed once per version (the run's fingerprint),
a Git LFS pointer named for what it is, a state dict loaded without running its pickle."""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, one_line


def file_sha256(path: str | Path) -> str:
    """The file's sha256, hashed once per version of the file (a run asks more than once); of a
    folder (a save_pretrained model), one sha256 over its files' names and hashes, in order."""
    if os.path.isdir(path):
        files = sorted(f for f in Path(path).rglob("*") if f.is_file())
        listing = "\n".join(f"{f.relative_to(path)} {file_sha256(f)}" for f in files)
        return hashlib.sha256(listing.encode()).hexdigest()
    stat = os.stat(path)
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


def hash_tensor(h: Any, name: str, t: torch.Tensor, end: str = "") -> None:
    """Feed the sha256 ``h`` one named tensor: its name, dtype and shape (then ``end``), then its
    bytes (a factors file's digest, the selected weights', a held model's identity)."""
    t = t.detach().cpu().contiguous()
    h.update(f"{name} {t.dtype} {tuple(t.shape)}{end}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())


@functools.lru_cache(maxsize=1 << 16)  # every shard of a large dataset, hashed once
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


LFS_POINTER = "a Git LFS pointer, not the file itself: run `git lfs pull` to fetch it"


def lfs_pointer(path: str | Path) -> bool:
    """Whether the file is a Git LFS pointer (a few lines of text standing in for the file)."""
    with open(path, "rb") as f:
        return f.read(24) == b"version https://git-lfs."


def load_state_dict(
    path: str | Path,
    trust: bool = False,
    hint: str = "; pass --trust-checkpoint only if you trust its author",
    what: str = "checkpoint",
) -> dict[str, Any]:
    """Load a state dict from .safetensors, or .pt/.pth with ``weights_only=True``.

    An arbitrary pickle is refused without running it unless ``trust`` is set; ``hint`` ends
    that error (what the user can do about it). ``what`` names the file in every error.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{what} not found", str(path))
    if lfs_pointer(path):
        raise ModelError(LFS_POINTER, str(path))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ModelError(f"cannot read safetensors {what}: {e}", str(path)) from e
    with open(path, "rb") as f:
        head = f.read(4)
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or a legacy pickle
        looks = "a Parquet file (a scores file?), not one" if head == b"PAR1" else "not a file"
        raise ModelError(f"{what} is {looks} that torch.save or safetensors writes", str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as e:
        if trust:  # not a pickle torch can read at all
            raise ModelError(f"cannot read {what}: {one_line(e)}", str(path)) from e
        raise ModelError(
            f"{what} holds objects other than tensors and cannot be loaded with "
            f"weights_only=True{hint}",
            str(path),
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ModelError(f"cannot read {what}: {one_line(e)}", str(path)) from e
