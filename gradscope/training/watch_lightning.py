"""The watch as a Lightning callback: from the start of training to its end, each training
step runs through ``Watch.step`` in place of the module's ``training_step``.

The step trains on the mean over the batch of ``loss(module(*inputs), targets)``, the loss
named as the watch names it; ``batch`` splits a batch into ``(inputs, targets, ids)``
(default: a batch ``(x, y, ids)``). The loss it returns to Lightning adds, in Lightning's own
backward, the gradient the step computed to ``.grad`` (times the gradient arriving: an
accumulation's, a scaler's), so clipping, accumulation and the optimizer run as they would.
What the module's own ``training_step`` does beyond its loss (logging) does not run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from ..errors import DataError
from ..losses import LossFn
from .watch import OnStep, Watch

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
    and margin at every step. ``**watch`` goes to ``Watch`` (``loss_kwargs``, ``include``,
    ``keywords``, ``output``, ...)."""

    def __init__(
        self,
        out: str | Path,
        loss: str | LossFn = "cross_entropy",
        *,
        batch: Split = _triple,
        on_step: OnStep | None = None,
        **watch: Any,
    ):
        self.out, self.loss, self.split, self.on_step = out, loss, batch, on_step
        self.options = watch
        self.watch: Watch | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch = Watch(pl_module, self.out, self.loss, on_step=self.on_step, **self.options)
        self.watch.__enter__()

        def training_step(batch: Any, *_: Any, **__: Any) -> Tensor:
            inputs, targets, ids = self.split(batch)
            return self.watch.step(inputs, targets, ids, epoch=trainer.current_epoch)

        pl_module.training_step = training_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        del pl_module.training_step  # the module's own again
        if self.watch is not None:
            self.watch.__exit__(None, None, None)
            self.watch = None
