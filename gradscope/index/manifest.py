"""The index's manifest: its names, the checks that every field a reader trusts is there and
consistent, and the seal that ties it to the build that wrote it.

The seal is the sha256 of the manifest's bytes, kept in ``ids.parquet``'s metadata: a manifest
copied from another index (another ``--seed``, other block sides) or edited by hand no longer
matches the rows and is refused, where it would otherwise score without a word. It guards
against mistakes, not forgery: whoever can write the folder can write a matching seal.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import DataError

FORMAT, VERSION = "gradscope-index", 3  # 3: each shard's crc32
MANIFEST, IDS, HEADER = "manifest.json", "ids.parquet", 128
SEAL = b"gradscope_manifest_sha256"  # ids.parquet's metadata key holding the seal
DTYPES = ("float16", "float32")
IDS_COLUMNS = ("example_id", "loss", "norm", "finite")
ENDS = 4096  # bytes of a shard's first and of its last rows whose sha256 the manifest records


def seal(text: bytes) -> bytes:
    return hashlib.sha256(text).hexdigest().encode()


def ends_sha256(f: BinaryIO, size: int) -> str:
    """The sha256 of the first and the last ``ENDS`` bytes (at most) of a shard's ``size`` bytes
    of rows, read from ``f``: a shard of another build, however alike its shape, differs."""
    n = min(ENDS, size)
    f.seek(HEADER)
    head = f.read(n)
    f.seek(HEADER + size - n)
    return hashlib.sha256(head + f.read(n)).hexdigest()


def plain_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name inside the index folder: no folder, no ``..``."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or not name.isprintable()
    ):
        raise DataError(
            f"the manifest names {name!r}, not a file name inside the index folder; an index "
            "reads only its own files",
            where,
        )
    return name


def _whole(value: object, lowest: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lowest


def parse(text: bytes, where: str) -> dict[str, Any]:
    """The manifest in ``text``, checked to be one this version reads and whole: every field a
    query trusts is there, of its type, the shards contiguous and adding up to ``rows``."""
    try:
        m = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise DataError(f"not a gradscope index folder (no readable {MANIFEST})", where) from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError("not a gradscope index folder", where)
    if m.get("version") != VERSION:
        raise DataError(
            f"an index of format version {m.get('version')!r}; this gradscope reads version "
            f"{VERSION}: build the index again",
            where,
        )
    wrong = [
        key
        for key, ok in (
            ("rows", _whole(m.get("rows"), 0)),
            ("width", _whole(m.get("width"), 1)),
            ("dtype", m.get("dtype") in DTYPES),
            ("header_bytes", m.get("header_bytes") == HEADER),
            ("shards", isinstance(m.get("shards"), list)),
            ("projection", isinstance(m.get("projection"), dict)),
            ("gradscope", isinstance(m.get("gradscope"), dict)),
        )
        if not ok
    ]
    if wrong:
        raise DataError(f"the manifest's {wrong[0]} is missing or not what an index holds", where)
    plain_name(m.get("ids"), where)
    _check_shards(m, where)
    if not _projection(m["projection"], m["width"]) or not all(
        isinstance(m["gradscope"].get(k), dict) for k in ("model_files", "gradients")
    ):
        raise DataError(
            "the manifest's projection or model record is not one an index run writes", where
        )
    return m


def _check_shards(m: dict[str, Any], where: str) -> None:
    """Each shard a plain file name and its rows, each starting where the one before ended,
    together the manifest's rows."""
    first = 0
    for n, shard in enumerate(m["shards"]):
        if not isinstance(shard, dict) or not _whole(shard.get("rows"), 0):
            raise DataError(f"the manifest's shard {n} is not a file and its rows", where)
        if not isinstance(shard.get("ends_sha256"), str) or not _whole(shard.get("crc32"), 0):
            raise DataError(f"the manifest's shard {n} records no sha256 of its rows", where)
        plain_name(shard.get("file"), where)
        if shard.get("first") != first:
            raise DataError(
                f"the manifest's shard {shard['file']} starts at row {shard.get('first')!r}, the "
                f"shards before it end at {first}",
                where,
            )
        first += shard["rows"]
    if first != m["rows"]:
        raise DataError(f"the manifest's shards hold {first} rows, its rows say {m['rows']}", where)


def _projection(p: dict, width: int) -> bool:
    """Whether ``p`` is a seed and blocks side by side filling ``width`` columns."""
    keys, start = {"name", "shape", "split", "k_out", "k_in", "start"}, 0
    seed = p.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not _whole(p.get("dim"), 1):
        return False
    if not isinstance(p.get("blocks"), list):
        return False
    for b in p["blocks"]:
        if not isinstance(b, dict) or set(b) != keys or b["start"] != start:
            return False
        shape = b["shape"]
        if not isinstance(shape, list) or not all(_whole(d, 0) for d in shape):
            return False
        if not all(_whole(b[k], 1) for k in ("k_out", "k_in")) or not _whole(b["split"], 0):
            return False
        start += b["k_out"] * b["k_in"]
    return p.get("width") == width == start


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The checked manifest of the index folder ``path`` (its seal is checked by ``Shards``)."""
    where = str(Path(path) / MANIFEST)
    try:
        text = (Path(path) / MANIFEST).read_bytes()
    except OSError as e:
        raise DataError(f"not a gradscope index folder (no readable {MANIFEST})", where) from e
    return parse(text, where)
