"""The run that writes one output: it never writes over what it reads, and resumes only itself."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .config import Config
from .errors import ConfigError
from .io.model import file_sha256
from .io.parquet import PartialRun

Inputs = list[tuple[str, str]]  # (what names it, path) for every file a run reads


def code_file(spec: str) -> str | None:
    """The file of a ``file.py:Name`` spec; None for anything else."""
    return spec.rsplit(":", 1)[0] if ".py:" in spec else None


def data_files(path: str | Iterable[str]) -> list[str]:
    """The files a data path names: each file, each glob's matches, each ``file.py:fn``'s file."""
    files = []
    for spec in [path] if isinstance(path, str) else path:
        if code_file(spec):
            files.append(code_file(spec))
        elif any(c in spec for c in "*?["):
            files.extend(sorted(glob.glob(spec)))
        else:
            files.append(spec)
    return files


def run_inputs(cfg: Config, more: Inputs = ()) -> Inputs:
    """Every file the run reads: config, code, checkpoints, data, and the scorer's ``more``."""
    named = [("config file", cfg.source)] if cfg.source else []
    for key, spec in (("model.factory", cfg.model.factory), ("loss.name", cfg.loss.name)):
        if code_file(spec):
            named.append((key, code_file(spec)))
    if cfg.model.checkpoint:
        named.append(("model.checkpoint", cfg.model.checkpoint))
    named += [("model.checkpoints", c.path) for c in cfg.model.checkpoints]
    named += [("data.path", f) for f in data_files(cfg.data.path)]
    return named + list(more)


def _same(a: Path, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # a hard link to the same file
    except OSError:
        return False


def check_output(path: str | Path, inputs: Inputs) -> None:
    """Refuse, before anything runs, an output that is one of the inputs or cannot be a file."""
    path = Path(path)
    for key, file in inputs:
        if _same(path, file):
            raise ConfigError(
                f"the output path is the run's {key} ({file}); writing there would destroy it, "
                "choose another --out or output.path",
                str(path),
            )
    if path.is_dir():
        raise ConfigError("the output path is a folder; give a file name", str(path))
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
        raise ConfigError(f"the output's folder {parent} is a file", str(path))


def _file_state(path: str) -> dict:
    """Size, mtime and sha256 of a file (each file inside a folder): what a resume must find."""
    if os.path.isdir(path):
        return {
            str(f.relative_to(path)): _file_state(str(f))
            for f in sorted(Path(path).rglob("*"))
            if f.is_file()
        }
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}


def fingerprint(cfg: Config, command: str, inputs: Inputs, resume_key: dict | None) -> dict:
    """What a partial run must share with the run that resumes it, as JSON reads it back: the
    command, the config, and the state of every data and code file and checkpoint it reads."""
    config = cfg.to_dict()
    for key in ("summary", "source", "device"):  # display, file name, placement (ranks differ)
        config.pop(key)
    files = {  # a missing file is reported by the code that reads it
        file: _file_state(file)
        for key, file in inputs
        if key != "config file" and os.path.exists(file)
    }
    result = {"command": command, "config": config, "files": files, **(resume_key or {})}
    return json.loads(json.dumps(result, default=str))


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints: ``config.data.batch_size``, ``file /abs/data.pt``."""
    old_files, new_files = old.get("files", {}), new.get("files", {})
    files = [
        f for f in sorted(set(old_files) | set(new_files)) if old_files.get(f) != new_files.get(f)
    ]
    rest = (
        {k: v for k, v in old.items() if k != "files"},
        {k: v for k, v in new.items() if k != "files"},
    )
    return _keys(*rest) + [f"file {f}" for f in files]


def _keys(old: object, new: object, key: str = "") -> list[str]:
    """The dotted keys at which two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for k in sorted(set(old) | set(new))
            for d in _keys(old.get(k), new.get(k), f"{key}.{k}" if key else k)
        ]
    return [] if old == new else [key]


def resumable(run: PartialRun, key: dict) -> dict:
    """The manifest of the interrupted run to continue: there must be one, with this fingerprint."""
    saved = run.manifest()
    if saved is None:
        raise ConfigError(
            "nothing to resume: no interrupted run of this output; run without --resume",
            str(run.path),
        )
    if saved["fingerprint"] != key:
        keys = differences(saved["fingerprint"], key)
        raise ConfigError(
            f"cannot resume: the interrupted run had a different {', '.join(keys)}; "
            "run without --resume to start over",
            str(run.dir),
        )
    return saved
