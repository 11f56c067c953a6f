"""What ``--resume`` keeps and what it refuses, for every command that writes parts: a run's
fingerprint (the config, the command, the files it reads by size and sha256, the device kind),
the keys in which two fingerprints differ, and a rank's side of the partial folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__, distributed
from .config import Config
from .distributed import World
from .errors import ConfigError
from .inputs import Inputs
from .io.batch import Batch, batch_sha256
from .io.code import config_code
from .io.files import file_sha256
from .io.held import unaddressed
from .io.parquet import PartialRun


def _file_state(path: str) -> dict:
    """Size and sha256 of a file (each file inside a folder): what a resume must find. Not its
    mtime: a file restored to the same bytes is the same file."""
    if os.path.isdir(path):
        return {
            str(f.relative_to(path)): _file_state(str(f))
            for f in sorted(Path(path).rglob("*"))
            if f.is_file()
        }
    return {"size": os.stat(path).st_size, "sha256": file_sha256(path)}


def fingerprint(
    cfg: Config, command: str, inputs: Inputs, resume_key: dict | None, device: str = "cpu"
) -> dict:
    """What a partial run must share with the run that resumes it, as JSON reads it back: the
    command, the config, gradscope's and torch's versions, the kind of ``device`` (cpu, cuda),
    the state of every data and code file and checkpoint it reads, and of the Python files its
    code loads from beside it (``io.code.config_code``)."""
    config = cfg.to_dict()
    for key in ("summary", "report", "source", "device"):  # display; file name; ranks differ
        config.pop(key)
    config["distributed"].pop("join_timeout")  # how long ranks wait to start, not what they do
    config["data"].pop("classes")  # the names the tables show, not what is scored
    files = {  # a missing file is reported by the code that reads it; the report's tokenizer
        # does not change the scores
        file: _file_state(file)
        for key, file in inputs
        if key not in ("config file", "report.tokenizer") and os.path.exists(file)
    }
    result = {
        "command": command,
        "config": config,
        "files": files,
        "code": config_code(cfg),  # what the factory imports from beside it, file by file
        "version": __version__,
        "torch": torch.__version__,
        "device": device,
        **(resume_key or {}),
    }
    return as_json(unaddressed(result))  # a model held in Python by its weights, not its address


def as_json(value: dict) -> dict:
    """``value`` as JSON reads it back (what ``differences`` compares with a stored key)."""
    return json.loads(json.dumps(value, default=str))


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


def resumed_parts(run: PartialRun, key: dict) -> set[int]:
    """The parts of the interrupted run to continue: there must be one, with this fingerprint."""
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
    return run.done()


def refuse_unresumed(
    run: PartialRun, key: dict, saved: str | None, afresh: str = "remove the folder"
) -> None:
    """Without ``--resume``, an interrupted run of the same fingerprint that saved work
    (``saved`` says what; None: nothing yet) is refused, not thrown away: its models took
    long to train, and the same command with ``--resume`` continues it (``afresh``: how to
    start over instead)."""
    manifest = run.manifest() if saved else None
    if manifest is not None and manifest["fingerprint"] == key:
        raise ConfigError(
            f"an interrupted run of this same command saved {saved}: run it with --resume to "
            f"continue, or {afresh} to start over",
            str(run.dir),
        )


@dataclass
class Parts:
    """This rank's side of the partial folder, begun (unless resumed) after its first batch."""

    run: PartialRun
    world: World
    key: dict
    done: set[int] | None  # the parts an interrupted run left; None when starting afresh
    begun: bool = False
    hashed: bool = False  # each part stamped with its batch's sha256: no file's hash holds them

    def wanted(self, number: int) -> bool:
        return self.world.owns(number) and number not in (self.done or ())

    def write(self, number: int, columns: dict, batch: Batch | None = None) -> None:
        """Part ``number``, stamped where ``hashed`` with the sha256 of the ``batch`` it scored."""
        self.begin()
        hashed = self.hashed and batch is not None
        self.run.write(number, columns, batch_sha256(batch) if hashed else None)

    def check(self, number: int, batch: Batch) -> None:
        """A batch a part holds: where the data is made by code (``file.py:fn``), whose inputs
        no fingerprint sees, its rows must be the ones the part was scored from."""
        if self.hashed and self.run.data(number) != batch_sha256(batch):
            raise ConfigError(
                f"cannot resume: batch {number}'s rows differ from those the interrupted run "
                "scored (data.path's code made other rows); run without --resume to start over",
                str(self.run.dir),
            )

    def begin(self) -> None:
        """Once every rank's first batch has run: begin the partial folder, or keep it."""
        if self.begun:
            return
        self.begun = True
        distributed.barrier()
        if self.world.main and self.done is None:
            self.run.start()
        distributed.barrier()
