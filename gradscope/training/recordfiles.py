"""A run record's folder as files (``record.py``): what its manifest vouches for, what
``--overwrite`` may replace, and what ``record.json`` and ``steps.pt`` must hold to be read (a
file forged with its manifest is refused in one line, not a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from ..errors import ConfigError, DataError
from ..io.files import file_sha256

FORMAT = 1  # record.json's format
MANIFEST = "manifest.json"  # each other file's sha256, by name
META, STEPS, FINAL = "record.json", "steps.pt", "final.pt"
START = "start.pt"  # the state dict a watched loop began from
FED = "watched.pt"  # each step's digests of the data it fed, and the random states it drew
# what a record writes beside its segment-NNNNN.pt (a stopped watched loop's steps-NNNNN.pt)
WRITTEN = (MANIFEST, META, STEPS, FINAL, START, FED)
_STEPS = ("picked", "sizes", "lrs")  # what steps.pt holds


def foreign(folder: Path) -> list[str]:
    """The names in the folder ``folder`` of what no run record writes (its own files, its
    segments and a stopped watched loop's steps, a dot file a write in progress leaves)."""
    names = [f.name for f in folder.iterdir() if f.name not in WRITTEN]
    return [n for n in names if not n.startswith(("segment-", "steps-", "."))]


def refuse_foreign(folder: Path) -> None:
    """Refuse to replace ``folder`` unless it is a run record's: a folder (not a link) holding
    only what a record writes, so that no file of the user's (an input) goes with it."""
    if folder.is_symlink() or not folder.is_dir():
        raise ConfigError("not a run record's folder (a link or a file): give another", str(folder))
    other = foreign(folder)
    if other:
        raise ConfigError(
            f"the folder holds {other[0]}, which no run record writes: not replaced", str(folder)
        )


def check_files(folder: Path) -> None:
    """Every file the manifest lists is there with its sha256, and no other record file."""
    if not (folder / MANIFEST).is_file():
        what = "no run record" if not folder.is_dir() else "an unfinished run record (no manifest)"
        fix = "gradscope train --record (train(record=True)) or Watch(record=) writes one"
        if (folder / START).is_file():  # a watched loop's, stopped before its end
            fix = ("a watched loop's: resume the loop from a checkpoint of its own, or run it "
                   "again from its first step")  # fmt: skip
        raise DataError(f"{what}: {fix}", str(folder))
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except ValueError as e:
        raise DataError("the run record's manifest does not read back", str(folder)) from e
    if not isinstance(manifest, dict) or not all(isinstance(v, str) for v in manifest.values()):
        raise DataError("the run record's manifest is not its files' sha256 by name", str(folder))
    if any(Path(name).name != name or name in (".", "..") for name in manifest):
        raise DataError("the run record's manifest names a file outside its folder", str(folder))
    for name in sorted(f.name for f in folder.iterdir() if f.name != MANIFEST):
        if name not in manifest and not name.startswith("."):
            raise DataError(
                f"the run record holds {name}, which its manifest does not list", str(folder)
            )
    for name, sha in manifest.items():
        if not (folder / name).is_file():
            raise DataError(f"the run record lacks {name}", str(folder))
        if file_sha256(folder / name) != sha:
            raise DataError(
                f"the run record's {name} changed after it was written (its sha256 is not the "
                "manifest's)",
                str(folder),
            )


def read_meta(folder: Path) -> dict:
    """record.json, of this format, with the keys every replay reads, each of its kind."""
    try:
        meta = json.loads((folder / META).read_text())
    except ValueError as e:
        raise DataError(f"the run record's {META} does not read back", str(folder)) from e
    if not isinstance(meta, dict):
        raise DataError(f"the run record's {META} is not one gradscope wrote", str(folder))
    if meta.get("format") != FORMAT:
        raise DataError(f"a run record of format {meta.get('format')}, not {FORMAT}", str(folder))
    kinds = {"steps": int, "segment": int, "deterministic": bool, "buffers_change": bool}
    wrong = [k for k, kind in kinds.items() if type(meta.get(k)) is not kind]
    if wrong or meta["steps"] < 1 or meta["segment"] < 1:
        what = f"its {wrong[0]}" if wrong else "a run of no steps or segments of none"
        raise DataError(f"the run record's {META} is not one gradscope wrote: {what}", str(folder))
    return meta


def checked_steps(steps: object, meta: dict, rows: int, folder: Path) -> tuple[Tensor, ...]:
    """steps.pt's every step's positions end to end, each step's count, its rate: one line
    where they are not the record's steps over ``rows`` training rows."""
    picked, sizes, lrs = (steps.get(k) if isinstance(steps, dict) else None for k in _STEPS)
    if not (
        all(isinstance(t, Tensor) and t.dim() == 1 for t in (picked, sizes, lrs))
        and not picked.is_floating_point()
        and not sizes.is_floating_point()
        and len(sizes) == len(lrs) == meta["steps"]
        and bool((sizes >= 1).all())
        and int(sizes.sum()) == len(picked)
        and (not len(picked) or 0 <= int(picked.min()) <= int(picked.max()) < rows)
    ):
        raise DataError(
            f"the run record's {STEPS} is not its {meta['steps']} steps' rows of the {rows} "
            "training rows and rates",
            str(folder),
        )
    return picked, sizes, lrs
