"""Watch every example while it trains: each step's forward and backward run through the
engine, whose one backward gives each example's loss gradient norm and the batch gradient the
optimizer steps on, and each example's loss, norm and margin go to Parquet by its id.

``Watch.step`` replaces ``loss = loss_fn(model(x), y); loss.backward()`` in a loop: the
parameters' ``.grad`` receive the gradient of the training loss (the mean of the per-example
losses, or with ``reduction="tokens"`` the mean over every counted token of the batch, as
Hugging Face's causal LM, token classification and masked LM losses), from the same backward
that serves the rules, so the optimizer steps as it would without the watch. ``gradscope
report`` on the file draws the data map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import __version__
from ..api.configured import in_api_words_of
from ..engine import BatchScores, Engine, Forward, total
from ..errors import ConfigError, DataError
from ..losses import LossFn, counted, nothing_counted, resolve_loss
from .watchdata import digests
from .watchdraws import SameBuffers, SameDraws
from .watchfile import WatchFile
from .watchrecord import SEGMENT, recording
from .watchview import TOKENWISE, observer

REDUCTIONS = ("mean", "tokens")  # the training loss: the mean over examples, or over tokens
OnStep = Callable[[int, np.ndarray], None]  # (0-based step, the batch's ids in order)


def _unhooked(model: nn.Module) -> None:
    """Refuses a trained parameter with a hook on its gradient (``register_hook``): autograd
    runs it in the step's backward, which gives ``.grad`` its gradient, and again as ``.grad``
    receives it (``_Deposit``): a mask's is the same twice, a scale's is not."""
    for name, p in model.named_parameters():
        if p.requires_grad and p._backward_hooks:
            raise ConfigError(
                f"parameter {name} has a hook on its gradient (register_hook), which a watched "
                "step would run twice: in its own backward, and again as .grad receives that "
                "gradient; remove it while watching (a mask can multiply the weight in the "
                "forward instead)",
                "model",
            )


class _Deposit(torch.autograd.Function):
    """The training loss's value, whose backward hands each parameter the gradient the step's
    one backward computed, over ``divisor`` and times the gradient arriving (one product):
    autograd adds it to ``.grad``."""

    @staticmethod
    def forward(
        ctx: Any, value: Tensor, grads: list[Tensor | None], divisor: float, *params: Tensor
    ) -> Tensor:
        ctx.grads, ctx.divisor = grads, divisor
        return value.clone()

    @staticmethod
    def backward(ctx: Any, out: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None  # once: a second backward has nothing to give
        if grads is None:
            raise RuntimeError("the watched step's loss was backpropagated twice")
        scale = out / ctx.divisor
        return (None, None, None, *(None if g is None else g * scale for g in grads))


def deposited(loss: Tensor) -> list[Tensor | None]:
    """The gradient a watched step's ``loss`` (``Watch.step``'s) hands each parameter its
    backward reaches, at a gradient of 1 arriving: read off its node before that backward."""
    node = loss.grad_fn  # a custom Function's node is its ctx
    if node is None or node.grads is None:
        raise RuntimeError("not a watched step's loss, or one backpropagated already")
    return [None if g is None else g / node.divisor for g in node.grads]


class Watch:
    """A context manager around a training loop that watches every example at every step.

    ``model`` trains on ``loss`` (a name, as ``per_example_norms`` takes, or a callable
    ``(outputs, targets) -> Tensor[B]``; ``loss_kwargs`` as the config's ``loss.kwargs``);
    ``keywords`` names the inputs passed by keyword (the last ones), ``output`` picks the
    tensor the loss reads (or ``forward(model, inputs)`` returns it). The norms are over the
    parameters that require grad (or ``include``/``exclude``'s); the gradient ``.grad``
    receives is of every parameter that requires grad.
    ``out`` is the Parquet file written when the context exits (the rows of every finished
    step, also after an error). ``on_step(step, ids)`` is called after each step.
    Every forward the engine runs over a step's batch draws from the random state the step
    began in (``watchdraws.py``): dropout's masks are the same in each, and the loop's.

    ``record`` is a folder where the run record that ``influence --through-training`` replays
    is written (``watchrecord.py``): ``optimizer`` the ``torch.optim`` SGD, Adam or AdamW the
    loop steps, ``clip`` the global norm the loop clips the gradient to (``clip_grad_norm_``),
    a checkpoint every ``segment`` steps; the ids are then the rows' positions in the data.

    ``step`` numbers the loop's first step: a resumed loop's (with ``record``, the record's
    checkpoint it resumes from numbers it). A resumed loop's ``out`` goes on the stopped
    loop's file there: its rows before that step are kept, those from it on dropped, as the
    watch is entered (a watch never entered writes nothing).
    """

    _entered = False  # inside its ``with``: a step outside it would write nothing

    def __init__(
        self,
        model: nn.Module,
        out: str | Path,
        loss: str | LossFn = "cross_entropy",
        *,
        loss_kwargs: dict | None = None,
        reduction: str = "mean",
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        keywords: Sequence[str] = (),
        output: str | int | None = None,
        forward: Callable[[nn.Module, tuple[Tensor, ...]], Tensor] | None = None,
        on_step: OnStep | None = None,
        record: str | Path | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        clip: float | None = None,
        segment: int = SEGMENT,
        step: int = 0,
    ):
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}", "reduction")
        if reduction == "tokens" and loss not in TOKENWISE:
            raise ConfigError(
                "reduction='tokens' is the mean over a class id per token: causal_lm's, "
                "cross_entropy's or nll's",
                "loss",
            )
        kwargs = dict(loss_kwargs or {})
        tokens = (loss, int(kwargs.get("ignore_index", -100)))  # what tells the counted ones
        self.tokens = tokens if reduction == "tokens" else None  # the loss a mean over them
        self.loss_spec = (loss, kwargs)  # which rows count no target: their loss is none
        per_example = resolve_loss(loss, kwargs, token_reduction="sum" if self.tokens else "mean")
        self.model, self.on_step = model, on_step
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameter that requires grad to train", "model")
        _unhooked(model)
        call = forward or Forward(tuple(keywords), output, "output=")
        self.draws = SameDraws(call, SameBuffers(model))
        self.engine = Engine(
            model, per_example, include, exclude, self.draws, observer(loss, kwargs)
        )
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
        included = [p.name for p in self.engine.plan.included]
        meta = {"command": "watch", "version": __version__, "loss": name, "reduction": reduction}
        self.file = WatchFile(Path(out), meta | {"params": included}, fresh=step == 0)
        self._modes: list[tuple[nn.Module, bool]] = []
        self.recording = recording(record, model, optimizer, clip, segment, loss, kwargs)
        if self.recording is not None:  # the inputs' names, where every one is passed by name
            self.recording.inputs = getattr(forward, "names", None) or tuple(keywords) or None
        resumed = self.recording.resumed if self.recording is not None else None
        self.steps = step if resumed is None else resumed.step  # a resumed loop's numbering goes on

    def __enter__(self) -> Watch:
        self.file.carry(self.steps)  # a resumed loop's file: the stopped one's rows first
        try:
            if self.recording is not None:
                self.recording.start()
            self._modes = [(m, m.training) for m in self.model.modules()]
            self.engine.__enter__()
        except BaseException:  # never entered: no file left behind, no hook
            self.file.discard()
            if self.recording is not None:
                self.recording.finish(False)
            raise
        for m, mode in self._modes:  # the engine scores in eval mode; training keeps its own
            m.training = mode
        self._entered = True
        return self

    def discard(self) -> None:
        """No watch file: the rows of the steps taken so far dropped (a run refused on its
        first step, which trained nothing)."""
        self.file.discard()

    def __exit__(self, *exc: Any) -> None:
        self._entered = False
        try:
            self.engine.__exit__(*exc)
        finally:
            self.file.close()
            if self.recording is not None:
                self.recording.finish(exc[0] is None)

    @in_api_words_of  # its errors name inputs=, targets=, not the config's data.inputs
    def step(
        self,
        inputs: Tensor | Sequence[Tensor],
        targets: Tensor,
        ids: Tensor | Sequence[int] | np.ndarray,
        *,
        epoch: int = 0,
        divisor: float | None = None,
        check: Callable[[Tensor], None] | None = None,
    ) -> Tensor:
        """One training step's forward and backward of the batch whose rows are the dataset's
        ``ids``, its rows written; returns the training loss, the sum of the per-example
        losses over ``divisor`` (by default the batch size: the mean; with
        ``reduction="tokens"`` the batch's counted tokens; more where the loss a step averages
        spans more, the micro-batches of an accumulated step). Its ``backward()`` runs no
        model: it adds the gradient the step's backward computed to each parameter's
        ``.grad``, times the gradient arriving (a loss scaler's, an accumulation's).
        ``check(loss)`` runs before the step's rows are written: where it raises, none are."""
        if not self._entered:  # it trained, and wrote nothing
            raise ConfigError(
                "the watch is not entered, so it writes no file: step inside `with Watch(...) "
                "as watch:`",
                "Watch",
            )
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        ids = np.asarray(torch.as_tensor(ids).cpu()).reshape(-1)
        if len(ids) != len(targets) or ids.dtype.kind not in "iu":
            raise DataError(
                f"ids must be one integer per example, {len(targets)} here; got {len(ids)} "
                f"of dtype {ids.dtype}",
                "ids",
            )
        counts = self._counts(targets)
        if divisor is None:
            divisor = float(counts.sum()) if counts is not None else float(len(targets))
        began = self.draws.begin()
        try:
            scores = self.engine.step(inputs, targets, self.params)
        finally:
            after = self.draws.end(keep=self.recording is not None)
        loss = _Deposit.apply(scores.loss.sum() / divisor, scores.trained, divisor, *self.params)
        if check is not None:
            check(loss)
        self._write(scores, counts, epoch, ids, targets)
        if self.recording is not None:  # the watched loss's gradient, for the record's check
            fed = digests(inputs, targets)
            self.recording.step(ids, deposited(loss), divisor, counts, (began, after), fed,
                                hosted=self.draws.hosted)  # fmt: skip
        return loss

    def _write(
        self,
        scores: BatchScores,
        counts: Tensor | None,
        epoch: int,
        ids: np.ndarray,
        targets: Tensor,
    ) -> None:
        """The step's rows: each example's own loss and the norm of its gradient."""
        norm = total(scores.norm_sq).sqrt().cpu()  # (B,)
        loss = scores.loss.double().cpu()
        if counts is not None:  # a token sum: each example's own loss is its tokens' mean
            loss = torch.where(counts > 0, loss / counts.clamp_min(1), float("nan"))
            norm = torch.where(counts > 0, norm / counts.clamp_min(1), 0.0)
        elif (empty := nothing_counted(*self.loss_spec, targets)) is not None:
            loss = loss.masked_fill(empty.cpu(), float("nan"))  # a mean over nothing, not 0
        observed = scores.observed
        if "margin" in observed and "prob" not in observed:  # a token view's: the geometric
            observed = {**observed, "prob": (-loss).exp()}  # mean of its tokens' probabilities
        self.file.write(self.steps, epoch, ids, loss, norm, observed, targets)
        if self.on_step is not None:
            self.on_step(self.steps, ids)
        self.steps += 1

    def _counts(self, targets: Tensor) -> Tensor | None:
        """(B,) float64 counted tokens of each example (causal_lm's next tokens), for a mean
        over tokens."""
        if self.tokens is None:
            return None
        return counted(self.tokens[0], targets, self.tokens[1]).flatten(1).sum(1).double().cpu()
