"""What a run reads and where it may write: every file and folder named by the config, the command
line or a scores file's metadata, kept off limits to the run's outputs and, on request, out of the
metadata it shares."""

from __future__ import annotations

import errno
import fnmatch
import os
from collections.abc import Iterator
from pathlib import Path

from .config import Config
from .errors import ConfigError
from .io.data import code_file, data_files
from .io.files import file_sha256
from .io.owned import KINDS, written_by_gradscope
from .io.selection import is_glob

Inputs = list[tuple[str, str]]  # (what names it, path): files and folders a run reads


def run_inputs(cfg: Config, more: Inputs = ()) -> Inputs:
    """Every file and folder the run reads: config, code, checkpoints, data, the report's
    tokenizer, and the scorer's ``more``."""
    return config_inputs(cfg.to_dict()) + list(more)


def config_inputs(config: dict) -> Inputs:
    """The files and folders a config reads, from ``Config.to_dict()`` or a scores file's
    metadata (absolute paths; a key that is missing or not a path, as another tool may leave it,
    names nothing)."""
    model, data, loss, report = (
        _mapping(config.get(k)) for k in ("model", "data", "loss", "report")
    )
    named = [("config file", config.get("source"))]
    for key, spec in (("model.factory", model.get("factory")), ("loss.name", loss.get("name"))):
        if _is_path(spec) and code_file(spec):
            named.append((key, code_file(spec)))
    named += [
        ("model.pretrained", model.get("pretrained")),  # a folder: each of its files is an input
        ("model.checkpoint", model.get("checkpoint")),
        ("model.adapter", model.get("adapter")),  # a folder, like model.pretrained
        ("report.tokenizer", report.get("tokenizer")),
    ]
    named += [
        ("model.checkpoints", _mapping(c).get("path")) for c in _list(model.get("checkpoints"))
    ]
    paths = data.get("path")
    named += data_inputs("data.path", [p for p in _list(paths) if _is_path(p)])
    return [(key, path) for key, path in named if _is_path(path)]


def metadata_inputs(meta: dict) -> Inputs:
    """What the run that wrote a scores file read, as its ``gradscope`` metadata names it."""
    named = config_inputs(_mapping(meta.get("config")))
    influence = _mapping(meta.get("influence"))
    if _is_path(influence.get("ref")):
        named += data_inputs("--ref", influence["ref"])
    for scorer in (meta, influence):  # norms keeps its --precondition at the top
        path = _mapping(scorer.get("precondition")).get("path")
        named += [("--precondition", path)] if _is_path(path) else []
    return named


def check_not_recorded(path: Path, meta: dict) -> None:
    """Refuse an existing output whose sha256 a scores file's metadata records for an input
    (the checkpoint, the data, REF, --precondition): where the metadata names no paths
    (``output.metadata: minimal``), the hashes still tell the inputs."""
    if not path.is_file():
        return
    digest = file_sha256(path)
    for key, value in _hashes(meta):
        if value == digest:
            raise ConfigError(
                f"the output path holds the file the scores file records as an input ({key}: "
                "the same sha256); writing there would destroy it, choose another --out",
                str(path),
            )


def _hashes(meta: object, key: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every ``*sha256`` string in the metadata."""
    for k, v in meta.items() if isinstance(meta, dict) else ():
        name = f"{key}.{k}" if key else str(k)
        if str(k).endswith("sha256") and isinstance(v, str):
            yield name, v
        yield from _hashes(v, name)


def minimal(metadata: object) -> object:
    """``output.metadata: minimal``: the metadata without the config and without any value that
    is an absolute path (a reference, a checkpoint); versions, hashes and the plan stay."""
    if isinstance(metadata, dict):
        return {k: minimal(v) for k, v in metadata.items() if k != "config" and not _path(v)}
    if isinstance(metadata, list):
        return [minimal(v) for v in metadata if not _path(v)]
    return metadata


def _path(value: object) -> bool:
    return isinstance(value, str) and os.path.isabs(value)


def data_inputs(key: str, path: str | list[str]) -> Inputs:
    """The files and folders a data path reads now, and each glob itself: an output that a glob
    would match is read as data by the next run."""
    specs = [path] if isinstance(path, str) else path
    patterns = [s for s in specs if is_glob(s) and ".py:" not in s and not Path(s).exists()]
    return [(key, f) for f in data_files(path)] + [(key, p) for p in patterns]


def _matches(path: Path, pattern: str) -> bool:
    """Whether the glob ``pattern`` matches ``path`` (a name that may not exist yet)."""
    if not is_glob(pattern) or Path(pattern).exists():
        return False
    parts, wanted = Path(os.path.realpath(path)).parts, Path(pattern).parts
    return len(parts) == len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    """A list as it is, one path as a list of it, anything else as nothing."""
    return value if isinstance(value, list) else [value] if isinstance(value, str) else []


def _is_path(value: object) -> bool:
    return isinstance(value, str) and bool(value) and "\0" not in value


def _same(a: Path, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # a hard link to the same file
    except OSError:
        return False


def _inside(path: Path, folder: str) -> bool:
    top = os.path.realpath(folder)
    return os.path.isdir(top) and os.path.commonpath([os.path.realpath(path), top]) == top


def check_output(
    path: str | Path,
    inputs: Inputs,
    kind: str | None = None,
    recorded: dict | None = None,
    option: str = "--out or output.path",
) -> None:
    """Refuse, before anything runs, an output that is one of the inputs or lies inside an input
    folder (or holds one a scores file's metadata, ``recorded``, names by its sha256), or that
    is not a regular file (or a new name) in an existing folder; a file there that is
    read-only, or (``kind``: ``io.owned.KINDS``) not an output of that kind gradscope wrote,
    which the run would replace. ``option``: what sets the path, as the errors name it."""
    path = Path(path)
    check_not_input(path, inputs, option)
    check_suffix(path, kind)
    if recorded is not None:
        check_not_recorded(path, recorded)
    if path.is_dir():
        raise ConfigError("the output path is a folder; give a file name", str(path))
    if path.exists() and not path.is_file():
        raise ConfigError(
            "the output path is not a regular file (a device, pipe or socket); give a file name",
            str(path),
        )
    if path.is_file() and kind is not None and not written_by_gradscope(path, kind):
        raise ConfigError(
            f"the output path holds a file that is not a {KINDS[kind]}; writing there would "
            f"replace it: choose another {option}, or remove the file first",
            str(path),
        )
    if path.is_file() and not path.stat().st_mode & 0o222:  # root too: os.access says yes
        raise ConfigError(
            "the output file is read-only; writing there would replace it: choose another "
            f"{option}, or make it writable",
            str(path),
        )
    check_folder(path)


PARQUET = ("scores", "query", "validate", "watch")  # the kinds written as Parquet
# suffixes of other formats: a Parquet file under one would be read as that by the next tool
OTHER_FORMATS = (".csv", ".tsv", ".txt", ".json", ".jsonl", ".html", ".pt", ".pth", ".npz",
                 ".npy", ".arrow", ".feather", ".xlsx", ".pkl", ".safetensors")  # fmt: skip


def check_suffix(path: Path, kind: str | None) -> None:
    """Refuse a Parquet output (``kind`` in PARQUET) named as another format's file."""
    if kind in PARQUET and path.suffix.lower() in OTHER_FORMATS:
        raise ConfigError(
            f"the output is written as Parquet, not {path.suffix}: name it .parquet "
            "(pandas.read_parquet reads it; df.to_csv makes a CSV of it)",
            str(path),
        )


def check_not_input(path: Path, inputs: Inputs, option: str = "--out or output.path") -> None:
    """Refuse an output that is one of the inputs, that a glob among them would match, or that
    lies inside an input folder (``option``: what sets the path)."""
    for key, file in inputs:
        if _same(path, file):
            raise ConfigError(
                f"the output path is the run's {key} ({file}); writing there would destroy it, "
                f"choose another {option}",
                str(path),
            )
        if _matches(path, file):
            raise ConfigError(
                f"the output path matches the run's {key} pattern ({file}); the next run would "
                f"read it as data, choose another {option}",
                str(path),
            )
        if _inside(path, file):
            raise ConfigError(
                f"the output path is inside the run's {key} folder ({file}); writing there would "
                f"change what the run reads, choose another {option}",
                str(path),
            )


def check_folder(path: Path) -> None:
    """Refuse an output whose folder is a file or does not exist."""
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"the output's folder {path.parent} is a file", str(path))
    if not path.parent.is_dir():
        raise ConfigError(f"the output's folder {path.parent} does not exist", str(path))
    if not os.access(path.parent, os.W_OK | os.X_OK):  # before the work, not after it
        read_only = os.statvfs(path.parent).f_flag & os.ST_RDONLY
        reason = os.strerror(errno.EROFS if read_only else errno.EACCES)
        raise ConfigError(f"cannot write in the output's folder: {reason}", str(path.parent))
