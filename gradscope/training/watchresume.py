"""A watched loop's record continued after the loop stopped: as each segment ends, its steps (rows,
rates, data digests, random states) are saved beside its checkpoint in ``steps-NNNNN.pt``, so
that a loop resumed from a checkpoint of its own taken where a segment begins goes on writing
the same record. The weights and optimizer state the loop resumes with must be, exactly, those
the record's checkpoint holds for that step: then the steps before it are the record's, and
the replay retraces the whole run as if it had never stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .record import Recorder, _load, _save
from .recordfiles import MANIFEST, START
from .steps import Tensors, Update

PART = "steps-{:05d}.pt"  # segment k's steps, saved as it ends; gone once the record is written


@dataclass
class Progress:
    """What a stopped watched loop recorded before the step it resumes at."""

    step: int  # the first step of the resumed loop, where a segment begins
    rng: dict  # the random state the segment's checkpoint holds
    picked: list[Tensor] = field(default_factory=list)  # per step, (B,) its rows
    lrs: list[float] = field(default_factory=list)
    fed: list[Tensor] = field(default_factory=list)  # per step, (B, k) its data's digests
    drawn: dict[int, dict] = field(default_factory=dict)
    rows: int = 0
    why: str | None = None


def save_part(recorder: Recorder, progress: Progress) -> None:
    """The steps of the segment that ends before ``progress.step`` (``recorder``'s rows and
    rates, ``progress``'s digests and random states of every step so far), and the record's
    rows and reason so far."""
    size = recorder.segment
    first = progress.step - size
    drawn = sorted(t for t in progress.drawn if t >= first)
    part = {"segment": size, "picked": recorder.picked[first:],
            "lrs": torch.tensor(recorder.lrs[first:], dtype=torch.float64),
            "fed": progress.fed[first:], "drawn": torch.tensor(drawn, dtype=torch.int64),
            "states": [progress.drawn[t] for t in drawn], "rows": progress.rows,
            "why": progress.why}  # fmt: skip
    _save(recorder.folder / PART.format(first // size), part)


def resumed(
    folder: Path, model: nn.Module, params: Tensors, optimizer: torch.optim.Optimizer,
    update: Update, segment: int,
) -> Progress | None:  # fmt: skip
    """What the half record in ``folder`` holds before the step the loop resumes at, found by
    the checkpoint whose weights the model holds; None where there is none to continue (no
    half record, or the model holds the weights it began from: the loop runs again)."""
    if not (folder / START).is_file() or (folder / MANIFEST).is_file():
        return None
    began = _load(folder / START)
    now = model.state_dict()
    if began.keys() == now.keys() and all(now[k].cpu().equal(v) for k, v in began.items()):
        return None
    for path in sorted(folder.glob("segment-*.pt"), reverse=True):
        checkpoint = _load(path)
        step, held = checkpoint["step"], checkpoint["params"]
        if step == 0 or len(held) != len(params):
            continue
        if all(p.detach().cpu().equal(q) for p, q in zip(params, held, strict=True)):
            _same_state(optimizer, params, update, checkpoint)
            return _progress(folder, step, segment, checkpoint["rng"])
    raise ConfigError(
        "that folder holds the record of a watched loop stopped before its end, and the model "
        "holds the weights of none of its checkpoints: resume the loop from a checkpoint of "
        f"its own taken after a multiple of segment={segment} steps the record reached, or run "
        "it from its first step",
        str(folder),
    )


def _same_state(
    optimizer: torch.optim.Optimizer, params: Tensors, update: Update, checkpoint: dict
) -> None:
    """The optimizer resumes with the state the checkpoint holds, and has taken its steps."""
    step = checkpoint["step"]
    state = update.state_of(optimizer, params)
    taken = [float(optimizer.state.get(p, {}).get("step", step)) for p in params]
    same = all(s.cpu().equal(c) for s, c in zip(state, checkpoint["state"], strict=True))
    if not same or any(t != step for t in taken):
        raise ConfigError(
            f"the model holds the record's weights at step {step}, and the optimizer not its "
            "state there: restore the optimizer's state_dict with the model's",
            "optimizer",
        )


def _progress(folder: Path, step: int, segment: int, rng: dict) -> Progress:
    """The steps before ``step`` from their parts; the later checkpoints and parts dropped."""
    written = _load(folder / PART.format(0))["segment"]  # saved before any later checkpoint
    if written != segment:
        raise ConfigError(
            f"the record was written with segment={written}, not {segment}: give the watch "
            "the segment= it was written with",
            str(folder),
        )
    progress = Progress(step, rng)
    for k in range(step // segment):
        part = _load(folder / PART.format(k))
        progress.picked += part["picked"]
        progress.lrs += part["lrs"].tolist()
        progress.fed += part["fed"]
        progress.drawn |= dict(zip(part["drawn"].tolist(), part["states"], strict=True))
        progress.rows, progress.why = part["rows"], part["why"]
    return progress


def trim(folder: Path, step: int, segment: int) -> None:
    """What a stopped loop recorded past ``step``, where it resumes, dropped."""
    for path in folder.glob("segment-*.pt"):
        if int(path.stem.split("-")[1]) * segment > step:
            path.unlink()
    for path in folder.glob("steps-*.pt"):
        if int(path.stem.split("-")[1]) * segment >= step:
            path.unlink()
