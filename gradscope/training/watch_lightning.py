"""The watch as a Lightning callback: from the start of training to its end, each training
step runs through ``Watch.step`` in place of the module's ``training_step``.

The step trains on the mean over the batch of ``loss(module(*inputs), targets)``, the loss
named as the watch names it; ``batch`` splits a batch into ``(inputs, targets, ids)``
(default: a batch ``(x, y, ids)``). The loss it returns to Lightning adds, in Lightning's own
backward, the gradient the step computed to ``.grad`` (times the gradient arriving: an
accumulation's, a scaler's), so clipping, accumulation and the optimizer run as they would.
What the module's own ``training_step`` does beyond its loss (logging) does not run; it runs
once more on the steps ``watchcheck.Due`` picks (the first, each epoch's first, the 2nd, 4th,
8th...), to check that it returns the loss the watch trained (``_same_loss``).
With ``record``, the run record ``influence --through-training`` replays is written there: the
optimizer and the clip read off the Trainer (``watchrecord.py``). Lightning's checkpoints then
carry the random state the run was in, which the callback restores on a resumed ``fit`` before
Lightning draws the epoch's order (Lightning restores none): resumed from a checkpoint at an
epoch's end, the run is the one that never stopped, and its record goes on (``watchresume.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor

from ..errors import ConfigError, DataError
from ..losses import LossFn
from .record import rng, set_rng
from .watch import OnStep, Watch
from .watchcheck import Due, checked, differs, rerun
from .watchdraws import State, state
from .watchfile import fed
from .watchrecord import SEGMENT

Split = Callable[[Any], tuple[Any, Tensor, Any]]  # batch -> (inputs, targets, ids)


def _triple(batch: Any) -> tuple[Any, Tensor, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 3:
        raise DataError(
            "a batch the watch splits by default is (inputs, targets, ids); pass batch= to "
            "split another",
            "WatchCallback(batch=)",
        )
    return batch[0], batch[1], batch[2]


class WatchCallback(Callback):
    """Writes the watch file ``out`` of a Lightning run: every example's loss, gradient norm
    and margin at every step, and with ``record`` the run record (a checkpoint every
    ``segment`` steps). ``**watch`` goes to ``Watch`` (``loss_kwargs``, ``include``,
    ``keywords``, ``output``, ...)."""

    def __init__(
        self,
        out: str | Path,
        loss: str | LossFn = "cross_entropy",
        *,
        batch: Split = _triple,
        on_step: OnStep | None = None,
        record: str | Path | None = None,
        segment: int = SEGMENT,
        **watch: Any,
    ):
        self.out, self.loss, self.split, self.on_step = out, loss, batch, on_step
        self.options = watch
        self.record, self.segment = record, segment
        self.watch: Watch | None = None
        self.restored: dict | None = None  # the random state a resumed fit begins in

    def state_dict(self) -> dict:
        """What a Lightning checkpoint keeps of the watch: with ``record``, the random state
        now, after the step that ends where the checkpoint is taken."""
        return {} if self.record is None else {"rng": rng()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.restored = state_dict.get("rng")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.restored is not None:  # before the loader's first draw
            set_rng(self.restored)
            self.restored = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "a module with automatic_optimization=False steps its optimizer in its own "
                "training_step, which the watch's replaces: the watch serves Lightning's "
                "automatic optimization",
                "LightningModule.automatic_optimization",
            )
        recorded = {} if self.record is None else _recorded(trainer, self.record, self.segment)
        first = fed(trainer.global_step, trainer.num_training_batches,
                    trainer.accumulate_grad_batches)  # fmt: skip
        watch = Watch(pl_module, self.out, self.loss, on_step=self.on_step, step=first,
                      **recorded, **self.options)  # fmt: skip
        self.watch = watch.__enter__()  # once entered: one refused as entered has no exit
        own, due = pl_module.training_step, Due()

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Tensor:
            inputs, targets, ids = self.split(batch)
            epoch = trainer.current_epoch
            check = None
            if due(epoch):
                same = functools.partial(_same_loss, pl_module, self.loss, began=state(),
                                         own=lambda: own(batch, *args, **kwargs),
                                         watch=self.watch, due=due)  # fmt: skip
                check = functools.partial(checked, self.watch, due, same)
            loss = self.watch.step(inputs, targets, ids, epoch=epoch, check=check)
            due.took(epoch, check is not None)
            return loss

        pl_module.training_step = training_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release(pl_module, None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException):
        """A run that raised leaves the module as it found it, the watch file closed."""
        self._release(pl_module, exception)

    def _release(self, pl_module: LightningModule, exception: BaseException | None) -> None:
        vars(pl_module).pop("training_step", None)  # the module's own again
        if self.watch is not None:
            watch, self.watch = self.watch, None
            kind = None if exception is None else type(exception)
            watch.__exit__(kind, exception, None)


def _same_loss(
    module: LightningModule, loss_fn: str | LossFn, loss: Tensor, *, began: State, own: Callable,
    watch: Watch, due: Due,
) -> None:  # fmt: skip
    """A checked step's ``loss`` must be the one the module's own ``training_step`` returns
    for the batch (``own()``, run once more as the step began, its logging muted), in value
    and gradient (``differs``): a step of another loss, or of inputs it changes (augmented,
    scaled), is refused, not trained on."""
    module.log = module.log_dict = lambda *_, **__: None
    try:
        out = rerun(module, began, own)
    finally:
        del module.log, module.log_dict  # the class's own again
    out = out.get("loss") if isinstance(out, Mapping) else out
    theirs = differs(loss, out, watch.params, module, due)
    if theirs is None:
        return
    name = loss_fn if isinstance(loss_fn, str) else getattr(loss_fn, "__name__", "loss")
    raise ConfigError(
        f"step {watch.steps}'s loss is {loss.item():.6g} as the watch takes it (the mean over "
        f"the rows of {name} of the module's output and the targets), {theirs} as "
        f"{type(module).__name__}'s training_step takes it: the step trains on another loss, "
        "or on inputs it changes (augments, scales), which the watch would not train on; give "
        "the watch that loss (loss=, loss_kwargs=), the inputs the module takes (batch=) and "
        "the output its loss reads (output=, or forward= where its forward returns another), "
        "or watch a loop of your own (Watch)",
        "training_step",
    )


def _recorded(trainer: Trainer, folder: str | Path, segment: int) -> dict:
    """``Watch``'s record arguments read off the Trainer: its one optimizer, its clip."""
    if len(trainer.optimizers) != 1:
        raise ConfigError(
            f"record= replays one optimizer; the module configures {len(trainer.optimizers)}",
            "configure_optimizers",
        )
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "record= replays a step a batch, not accumulated ones",
            "Trainer(accumulate_grad_batches=)",
        )
    clip = trainer.gradient_clip_val or None
    if clip is not None and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise ConfigError(
            "record= replays clipping by the gradient's norm, not by value",
            "Trainer(gradient_clip_algorithm=)",
        )
    _resumable(trainer)
    return {"record": folder, "optimizer": trainer.optimizers[0], "clip": clip, "segment": segment}


def _resumable(trainer: Trainer) -> None:
    """A fit resumed mid-epoch is the run the record began only where Lightning can resume
    its loader there (``state_dict``/``load_state_dict``): else it feeds the epoch from its
    first batch again."""
    epoch = trainer.num_training_batches
    loaders = CombinedLoader(trainer.train_dataloader).flattened
    stateful = all(hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict") for dl in loaders)
    if trainer.global_step % epoch and not stateful:
        raise ConfigError(
            f"resumed at step {trainer.global_step}, mid-epoch, Lightning feeds the epoch from "
            "its first batch again (the DataLoader keeps no state): not the run the record "
            "began; resume from a checkpoint taken at an epoch's end",
            "ckpt_path",
        )
