"""The factors file: safetensors tensors (``<parameter>/<tensor>``) and a JSON header under the
``gradscope`` key, written atomically and read back whole and checked, or refused with one line.
The header holds the sha256 of the rest (``digest``): a file edited by hand or cut short is
refused, never scored; only a forger who recomputes it gets through (no secret is kept).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import __version__
from ..errors import ModelError, one_line
from ..io.files import hash_tensor
from .factors import DIAGONAL, EKFAC, FULL, KFAC, Block

KEY = "gradscope"  # the safetensors metadata key, as the Parquet files'
DAMPED = {KFAC: ("A", "S"), EKFAC: ("A", "S", "lambda"), DIAGONAL: ("diagonal",), FULL: ("F",)}


@dataclass
class Factors:
    """Every selected parameter's block, with what they were computed from."""

    blocks: dict[str, Block]
    meta: dict

    @property
    def method(self) -> str:
        return self.meta["method"]

    def __repr__(self) -> str:  # a notebook's cell: not pages of tensors
        return (
            f"Factors({self.method}, {len(self.blocks)} parameters, "
            f"{self.meta.get('examples', '?')} examples)"
        )

    def describe(self) -> dict:
        return {n: b.describe() for n, b in self.blocks.items()}

    def save(self, path: str | Path) -> None:
        """One safetensors file; the metadata (JSON under ``gradscope``) holds the fingerprint."""
        from safetensors.torch import save

        from ..io.atomic import replace_atomically

        tensors = {
            f"{name}/{key}": t.contiguous()
            for name, b in self.blocks.items()
            for key, t in b.tensors.items()
        }
        meta = self.meta | {"blocks": self.describe()}
        meta["sha256"] = digest(tensors, meta)
        data = save(tensors, metadata={KEY: json.dumps(meta)})
        # a new temporary name of its own, never a link planted in a shared folder
        replace_atomically(Path(path), lambda f: f.write(data), "the factors")

    @classmethod
    def load(cls, path: str | Path) -> Factors:
        """The factors in ``path``; a file cut short, edited or of other shapes is one error
        naming what is wrong, never a block that would score wrongly."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = (f.metadata() or {}).get(KEY, "")
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        except Exception as e:  # safetensors' own error for a file cut short, OSError
            raise _damaged(f"it does not read as safetensors ({one_line(e)})", path) from e
        try:
            meta = json.loads(header)
        except ValueError as e:
            raise _damaged("its metadata is not JSON", path) from e
        if not isinstance(meta, dict) or meta.get("method") not in (KFAC, EKFAC):
            raise _damaged("its metadata names no method (kfac or ekfac)", path)
        if not isinstance(meta.get("blocks"), dict):
            raise _damaged("its metadata lists no blocks", path)
        written = meta.pop("sha256", None)
        blocks = {name: _block(name, info, tensors, path) for name, info in meta["blocks"].items()}
        if written is None:
            raise _damaged("it holds no sha256 (written by an older gradscope)", path)
        if written != digest(tensors, meta):
            raise _damaged("its tensors or metadata are not what gradscope wrote (sha256)", path)
        del meta["blocks"]
        return cls(blocks, meta)


def digest(tensors: dict[str, Tensor], meta: dict) -> str:
    """The sha256 of a factors file's tensors (names, dtypes, shapes, bytes) and its metadata
    (without its own sha256)."""
    canonical = json.loads(json.dumps(meta))  # as the file holds it: int keys are strings
    h = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode())
    for key in sorted(tensors):
        hash_tensor(h, key, tensors[key])
    return h.hexdigest()


def _damaged(what: str, path: str | Path) -> ModelError:
    return ModelError(
        f"the factors file is damaged: {what}; run gradscope factors again", str(path)
    )


def _block(name: str, info: Any, tensors: dict[str, Tensor], path: str | Path) -> Block:
    """Parameter ``name``'s block as its metadata ``info`` describes it, each tensor checked."""
    kind = info.get("kind") if isinstance(info, dict) else None
    shape, damping = (info.get(k) if isinstance(info, dict) else None for k in ("shape", "damping"))
    if kind not in DAMPED or not _sizes(shape) or not isinstance(damping, dict):
        raise _damaged(f"the metadata of block {name} is not a kind, shape and damping", path)
    for key in DAMPED[kind]:
        value = damping.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise _damaged(f"block {name} has no positive damping {key}", path)
        if not math.isfinite(value):
            raise _damaged(f"block {name}'s damping {key} is not finite", path)
    if kind == DIAGONAL:
        wanted = {"diagonal": tuple(shape)}
    elif kind == FULL:
        d = math.prod(shape)
        wanted = {"F": (d, d), "F_eigenvalues": (d,), "F_eigenvectors": (d, d)}
    else:
        g, o, i = _layout(name, info, shape, tensors, path)
        wanted = {"A": (g, i, i), "A_eigenvalues": (g, i), "A_eigenvectors": (g, i, i),
                  "S": (g, o, o), "S_eigenvalues": (g, o), "S_eigenvectors": (g, o, o)}  # fmt: skip
        if kind == EKFAC:
            wanted["lambda"] = (g, o, i)
    mine = {}
    for key, size in wanted.items():
        t = tensors.get(f"{name}/{key}")
        if t is None:
            raise _damaged(f"tensor {name}/{key} is missing", path)
        if tuple(t.shape) != size or not t.is_floating_point():
            raise _damaged(
                f"tensor {name}/{key} is {tuple(t.shape)} {t.dtype}, its block needs {size} floats",
                path,
            )
        if not torch.isfinite(t).all():
            raise _damaged(f"tensor {name}/{key} holds NaN or infinite values", path)
        mine[key] = t.double()
    kept = {k: float(damping[k]) for k in DAMPED[kind]}
    return Block(kind if kind in (DIAGONAL, FULL) else KFAC, torch.Size(shape), mine, kept)


def _sizes(shape: Any) -> bool:
    return isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)


def _layout(
    name: str, info: dict, shape: list[int], tensors: dict[str, Tensor], path: str | Path
) -> tuple[int, int, int]:
    """(groups, outputs, inputs) of a K-FAC block, read from its factors and checked against
    the parameter's shape: G * O * I elements, G * O of them its leading dimensions (a
    gradient is laid out (G, O, I) row by row)."""
    a, s = tensors.get(f"{name}/A"), tensors.get(f"{name}/S")
    if a is None or s is None:
        raise _damaged(f"tensor {name}/{'S' if a is not None else 'A'} is missing", path)
    if a.dim() != 3 or s.dim() != 3 or a.shape[0] != s.shape[0] or a.shape[0] != info.get("groups"):
        raise _damaged(
            f"tensors {name}/A {tuple(a.shape)} and {name}/S {tuple(s.shape)} are not "
            f"{info.get('groups')} groups of square factors",
            path,
        )
    g, o, i = a.shape[0], s.shape[-1], a.shape[-1]
    leading = {math.prod(shape[:k]) for k in range(len(shape) + 1)}
    if g * o * i != math.prod(shape) or g * o not in leading:
        raise _damaged(
            f"factors of {g} x {o} x {i} do not cover block {name}'s shape {tuple(shape)}", path
        )
    return g, o, i


def is_factors_file(path: str | Path) -> bool:
    """Whether ``path`` is a safetensors file holding gradscope factors (told by its content)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                return False
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return False
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return isinstance(meta, dict) and KEY in meta and '"factors"' in str(meta[KEY])


def metadata(method: str, fisher: str, examples: int, fingerprint: dict) -> dict:
    return {
        "kind": "factors",
        "version": __version__,
        "method": method,
        "fisher": fisher,
        "examples": examples,
        "model": fingerprint,
    }
