"""The run record a watched loop writes (``Watch(record=...)``): the folder ``gradscope train
--record`` writes, with what a loop does not say read where it shows: the optimizer's kind and
settings off its ``torch.optim`` instance, each step's learning rate off its param groups as it
steps (any scheduler serves), each batch's rows from the watch's ids (positions in the config's
``data.path``), the weights it began from in ``start.pt``; in ``watched.pt``, each row's digest
of the data each step fed (``watchdata.py``) and the random state of each step the loop drew
before (``watchdraws.py``; a segment's first step's is in its checkpoint). What the replay
could not retrace exactly is refused as the watch is made, or named in the record as it trains
(a step on another gradient than the watched loss's, a loss that is not the batch's mean,
autocast, ...), which the replay then refuses in one line."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..config import LossConfig, TrainConfig
from ..engine import computed_in
from ..errors import ConfigError, DataError, RecordWarning
from ..losses import LossFn
from ..resume import as_json
from .record import WATCHED, Recorder, _load, _save, rng
from .recordfiles import FED, START, foreign
from .steps import Tensors, Update
from .watchdraws import same_state
from .watchoptim import read_recipe, settings
from .watchresume import Progress, resumed, save_part, trim

SEGMENT = 32  # steps per checkpoint: a loop does not say how many steps it will take


class Recording:
    """The record of a watched loop as it trains: each step's rows, rate and gradient checked
    as its optimizer steps, and as a segment ends its steps saved and the next one's
    checkpoint; the rest at the end. ``why`` keeps the first reason the run cannot be
    replayed."""

    def __init__(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 clip: float | None, segment: int, key: dict):  # fmt: skip
        if segment < 1:
            raise ConfigError("segment must be a positive number of steps", "segment")
        if clip is not None and not clip > 0:
            raise ConfigError("clip must be a positive gradient norm", "clip")
        self.model, self.optimizer, self.clip = model, optimizer, clip
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.recipe = read_recipe(optimizer)
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if stepped != {id(p) for p in self.params}:
            raise ConfigError(
                f"the optimizer steps {len(stepped)} tensors, the model trains "
                f"{len(self.params)} (those that require grad): the replay steps those",
                "optimizer",
            )
        self.settings = settings(optimizer.param_groups[0])
        self.update = Update(TrainConfig(**self.recipe))
        self.recorder = Recorder(Path(folder).resolve(), segment, key)
        self.resumed = resumed(self.recorder.folder, model, self.params, optimizer, self.update,
                               segment)  # fmt: skip
        if optimizer.state and self.resumed is None:
            raise ConfigError(
                "the optimizer has stepped before the watch began: give the watch a fresh one "
                "(a loop resumed from a checkpoint of its own continues its record: name it)",
                "optimizer",
            )
        # the watched step's ids, gradient's fingerprint and digest of the data it fed
        self.pending: tuple[Tensor, Tensor, Tensor] | None = None
        self.fed: list[Tensor] = []  # per step, (B, k) the digests of the rows it fed
        # step -> the random state it began in, where not the one the step before left
        self.drawn: dict[int, dict] = {}
        self.left: dict | None = None  # the random state the last step's forward left
        self.tokens = False  # the loss is the mean over each step's counted tokens
        self.inputs: tuple[str, ...] | None = None  # the inputs' names, where all are named
        self.why: str | None = None
        self.rows = 0  # one more than the largest id
        self.buffers: list[Tensor] = []
        self.hook = None

    def start(self) -> None:
        """A fresh record folder, the weights training begins from and its first checkpoint,
        or the record the resumed loop continues; the optimizer hooked."""
        folder = self.recorder.folder
        if not folder.parent.is_dir():
            raise DataError("the folder to write the run record in does not exist", str(folder))
        # a stopped loop's segments and steps, which a resumed one continues, are the record's
        if (folder.is_dir() and foreign(folder)) or (folder.exists() and not folder.is_dir()):
            raise ConfigError("that is no run record's folder: name another", str(folder))
        if self.resumed is not None:
            self._resume(self.resumed)
        else:
            self.recorder.start()
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            torch.save(state, folder / START)
            self.buffers = [b.detach().clone() for b in self.model.buffers()]
            self._checkpoint(0)
        self.hook = self.optimizer.register_step_post_hook(self._stepped)

    def _resume(self, progress: Progress) -> None:
        """The record a stopped loop wrote up to the step it resumes at, continued."""
        trim(self.recorder.folder, progress.step, self.recorder.segment)
        self.recorder.picked, self.recorder.lrs = progress.picked, progress.lrs
        self.fed, self.drawn, self.left = progress.fed, progress.drawn, progress.rng
        self.rows, self.why = progress.rows, progress.why
        began = _load(self.recorder.folder / START)
        self.buffers = [began.get(n, b).to(b.device) for n, b in self.model.named_buffers()]

    def _checkpoint(self, step: int) -> None:
        """The checkpoint of the segment that begins at ``step``, before it: the weights, the
        optimizer's state and the random state, which its first step begins in unless the loop
        draws before it."""
        state = self.update.state_of(self.optimizer, self.params)
        self.recorder.checkpoint(step, self.params, state)
        self.left = rng()

    def step(
        self,
        ids: np.ndarray,
        grads: list[Tensor | None],
        divisor: float,
        counts: Tensor | None,
        states: tuple[dict, dict | None],
        fed: Tensor,
        hosted: bool = False,
    ) -> None:
        """A watched step: ``grads`` the gradient of its loss (its per-example losses summed over
        ``divisor``) that ``.grad`` receives, ``ids`` its rows, ``counts`` each one's counted
        tokens where the loss is a mean over tokens; ``states`` the random state it began in
        and the one its forward left, ``fed`` (B, k) the digests of its targets and inputs;
        ``hosted`` whether its forward drew from numpy's or Python's generator."""
        t = len(self.recorder.lrs)
        if hosted:
            self._refuse(f"step {t}'s forward drew from numpy's or Python's random generator, "
                         "whose draws the record does not keep")  # fmt: skip
        if self.pending is not None:
            self._refuse(
                f"two watched steps at step {t} without an optimizer step between "
                "them (gradient accumulation, or a loss scaler's skipped step)"
            )
        self._mean(t, len(ids), divisor, counts)
        device, computed = self.params[0].device.type, computed_in()
        if torch.is_autocast_enabled(device) or computed not in (None, self.params[0].dtype):
            # autocast inside the model's call (accelerate's, a Trainer's bf16=True) shows in
            # the dtype its layers computed in
            self._refuse(f"step {t} ran under autocast: the replay computes in the config's dtype")
        if len(ids) and ids.min() < 0:
            self._refuse(f"step {t}'s ids are not positions in the data (one is negative)")
        self.rows = max(self.rows, int(ids.max()) + 1 if len(ids) else 0)
        if self.inputs is not None and fed.shape[1] - 1 != len(self.inputs):
            self.inputs = None  # some passed by position: unnamed
        if self.fed and fed.shape[1] != self.fed[0].shape[1]:
            self._refuse(f"step {t} fed {fed.shape[1] - 1} inputs, step 0 "
                         f"{self.fed[0].shape[1] - 1}: the replay feeds data.inputs")  # fmt: skip
            fed = fed.new_full((len(fed), self.fed[0].shape[1]), float("nan"))
        began, left = states
        if self.left is None or not same_state(began, self.left):
            self.drawn[t] = began  # the loop drew before the step (a loader's shuffle)
        self.left = left
        ids = torch.as_tensor(ids, dtype=torch.int64)
        self.pending = (ids, _fingerprint(grads, self.params), fed)

    def _mean(self, t: int, rows: int, divisor: float, counts: Tensor | None) -> None:
        """The step's loss must be the mean over its rows of their own losses, or over its
        counted tokens (``counts``: each row's), which the replay weighs each row's by."""
        self.tokens |= counts is not None
        if counts is None and divisor != rows:
            self._refuse(f"step {t}'s loss is the sum over {divisor:g}, not the mean over its "
                         f"{rows} rows")  # fmt: skip
        elif counts is not None and divisor != counts.sum():
            self._refuse(f"step {t}'s loss is its tokens' losses over {divisor:g}, not over the "
                         f"{counts.sum():g} tokens it counts")  # fmt: skip

    def _stepped(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """After each optimizer step: its rate, settings and gradient checked, its rows kept."""
        t = len(self.recorder.lrs)
        if self.pending is None:
            self._refuse(f"an optimizer step at step {t} with no watched step before it")
            return
        ids, want, fed = self.pending
        self.pending = None
        lrs = {float(group["lr"]) for group in optimizer.param_groups}
        if len(lrs) > 1:
            self._refuse(f"the param groups' learning rates differ at step {t}")
        changed = [k for k, v in settings(optimizer.param_groups[0]).items()
                   if self.settings.get(k) != v]  # fmt: skip
        if changed:
            self._refuse(f"the optimizer's {changed[0]} changed at step {t}")
        got = _fingerprint([p.grad for p in self.params], self.params)
        if not _same(got, want, self.clip, self.params):
            how = "clipped otherwise" if self.clip else "clipped without clip="
            self._refuse(f"the optimizer stepped on another gradient than the watched loss's at "
                         f"step {t}: accumulated, scaled, added to, or {how}")  # fmt: skip
        self.recorder.picked.append(ids)
        self.fed.append(fed)
        self.recorder.lrs.append(lrs.pop())
        if (t + 1) % self.recorder.segment == 0:  # its steps saved, the next's checkpoint
            save_part(self.recorder, Progress(t + 1, {}, fed=self.fed, drawn=self.drawn,
                                              rows=self.rows, why=self.why))  # fmt: skip
            self._checkpoint(t + 1)

    def _refuse(self, why: str) -> None:
        """The first reason the run cannot be replayed: kept in the record, and told now."""
        if self.why is not None:
            return
        self.why = why
        warnings.warn(
            f"the run record in {self.recorder.folder} will not replay: {why} (the watch goes "
            "on; influence --through-training refuses this record)",
            RecordWarning,
            stacklevel=2,
        )

    def finish(self, finished: bool) -> None:
        """The hook removed; after a run that finished, the record written (a checkpoint of
        a step that never stepped dropped), else left without a manifest."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if not finished:
            return
        for part in self.recorder.folder.glob("steps-*.pt"):
            part.unlink()
        steps, segment = len(self.recorder.lrs), self.recorder.segment
        for extra in self.recorder.folder.glob("segment-*.pt"):
            if int(extra.stem.split("-")[1]) * segment >= max(steps, 1):
                extra.unlink()
        if not steps:
            self._refuse("no optimizer step was watched")
        moved = any(not torch.equal(a, b)
                    for a, b in zip(self.buffers, self.model.buffers(), strict=True))  # fmt: skip
        meta = {"source": WATCHED, "recipe": self.recipe | {"clip": self.clip}, "refused": self.why,
                "rows": self.rows, "trained": self.names, "dtype": str(self.params[0].dtype),
                "buffers_change": moved, "tokens": self.tokens,
                "inputs": None if self.inputs is None else list(self.inputs)}  # fmt: skip
        drawn = sorted(t for t in self.drawn if t < steps)
        fed = torch.cat(self.fed) if self.fed else torch.zeros(0, 1, dtype=torch.float64)
        drawn_at = torch.tensor(drawn, dtype=torch.int64)
        states = [self.drawn[t] for t in drawn]
        _save(self.recorder.folder / FED, {"fed": fed, "drawn": drawn_at, "states": states})
        self.recorder.write(self.params, self.params[0].device, meta)


def _fingerprint(grads: list[Tensor | None], params: Tensors) -> Tensor:
    """(n, 2) float64 each parameter's gradient summed, and its squares summed (0 for none)."""
    rows = [
        torch.zeros(2, dtype=torch.float64, device=p.device)
        if g is None
        else torch.stack([g.sum(), g.square().sum()]).double()
        for g, p in zip(grads, params, strict=True)
    ]
    return torch.stack(rows).cpu()


def _same(got: Tensor, want: Tensor, clip: float | None, params: Tensors) -> bool:
    """Whether ``got`` fingerprints the gradient ``want`` does times the clip's coefficient,
    to the dtype's rounding (a sum's within sqrt(size) times the norm)."""
    coef = 1.0
    if clip is not None:
        coef = min(1.0, clip / (want[:, 1].sum().sqrt().item() + 1e-6))
    sums, squares = want[:, 0] * coef, want[:, 1] * coef**2  # (n,) each
    sizes = torch.tensor([p.numel() for p in params], dtype=torch.float64)
    finfo = torch.finfo(params[0].dtype)
    tol = finfo.eps**0.5
    return bool(
        ((got[:, 0] - sums).abs() <= tol * (sizes * squares).sqrt() + finfo.tiny).all()
        and ((got[:, 1] - squares).abs() <= tol * squares + finfo.tiny).all()
    )


def recording(folder: str | Path | None, model: nn.Module,
              optimizer: torch.optim.Optimizer | None, clip: float | None, segment: int,
              loss: str | LossFn, kwargs: dict) -> Recording | None:  # fmt: skip
    """The watch's ``record=``: None without a folder, else a recording of the loop that
    steps ``optimizer`` on the mean over each batch of the loss ``loss`` names (with
    ``reduction="tokens"``, over each batch's counted tokens)."""
    if folder is None:
        return None
    if optimizer is None:
        raise ConfigError(
            "record= needs the optimizer the loop steps: pass optimizer=", "optimizer"
        )
    if not isinstance(loss, str):
        raise ConfigError(
            "record= needs the loss by name, as the config's loss.name gives it to the replay",
            "loss",
        )
    section = dataclasses.asdict(LossConfig(name=loss, kwargs=kwargs))  # the config's, as watched
    key = {"loss": section, "torch": torch.__version__}
    return Recording(folder, model, optimizer, clip, segment, as_json(key))
