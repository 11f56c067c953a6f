"""The watch as a Hugging Face ``Trainer`` callback, for causal, masked and seq2seq language
models, sequence and token classifiers, multiple-choice models and question answerers
(``watchkinds.py`` tells them).

From the start of training to its end, the model's training calls (in train mode, with
``labels``) run through ``Watch.step``: the engine's forward and its one backward, which
gives the gradient of the loss the ``Trainer`` would have taken (a causal language model's:
the mean over every counted next token of the step, micro-batches of an accumulated step
included; a sequence classifier's: the mean over the call's counted rows, as its own loss is;
a label a token: over the call's counted tokens), and returns that loss, whose backward, the
``Trainer``'s, adds that gradient to ``.grad`` without running the model. The dataset carries
each row's id in a column (``ids``, default ``example_id``) that the collator passes along: set
``remove_unused_columns=False``. With ``record``, the run record
``influence --through-training`` replays is written there: the optimizer the ``Trainer`` made and
its ``max_grad_norm`` clip read off it (``watchrecord.py``); the ids are then the rows' positions.
Resumed (``resume_from_checkpoint``) from a checkpoint after a multiple of ``segment`` steps, the
run goes on writing that record: the ``Trainer`` restores the weights, the optimizer's state and
the random state, and skips the batches fed, so the run is the one that never stopped.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback

from ..errors import ConfigError, ModelError
from .watch import OnStep, Watch
from .watchcheck import Due, checked, differs, rerun
from .watchdraws import State, state
from .watchfile import fed
from .watchkinds import OUTPUTS, POSITIONS, TITLES, NotKept, decoder_inputs, spans, task
from .watchrecord import SEGMENT

_CLASS = object()  # the model had no forward of its own: its class's serves
UNSUPPORTED = {
    "fp16": "fp16 training (its loss scaler is untested with the watch)",
    "label_smoothing_factor": "label smoothing, whose loss is not the model's own",
    "torch_compile": "a compiled model (the watch runs the model's forward op by op)",
    "neftune_noise_alpha": "NEFTune's noise on the embeddings, drawn for the whole batch",
}


class WatchCallback(TrainerCallback):
    """Writes the watch file ``out`` of a ``Trainer`` run: every example's loss, gradient norm
    and margin at every step, keyed by the dataset column ``ids``; with ``record``, the run
    record (a checkpoint every ``segment`` steps)."""

    def __init__(
        self,
        out: str | Path,
        ids: str = "example_id",
        on_step: OnStep | None = None,
        record: str | Path | None = None,
        segment: int = SEGMENT,
    ):
        self.out, self.ids, self.on_step = out, ids, on_step
        self.record, self.segment = record, segment
        self.recorded: dict = {}  # Watch's record arguments, once the Trainer has an optimizer
        self.watch: Watch | None = None
        self.kind = "lm"  # the model's kind, and its loss and reduction: the first step's
        self.task = ("causal_lm", "tokens")
        self.names: tuple[str, ...] = ()  # the model's inputs by name, the first step's order
        self.epoch = 0
        self.first = 0  # the first step's number: a resumed run's goes on
        self.accumulated = False  # whether the Trainer accumulates micro-batches
        self.due = Due()  # the steps checked against the model's own loss
        self._wrapper: Any = None  # the forward set on the model while it trains
        self._before: Any = _CLASS  # the model's own forward attribute, if it had one

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module, optimizer: Any = None,
        train_dataloader: Any = None, **_: Any,
    ):  # fmt: skip
        batches = len(train_dataloader) if hasattr(train_dataloader, "__len__") else None
        self.first = fed(state.global_step, batches, args.gradient_accumulation_steps)
        self.accumulated = args.gradient_accumulation_steps > 1
        if self.record is not None:
            self.recorded = _recorded(args, state, optimizer, self.record, self.segment)
        for name, why in UNSUPPORTED.items():
            if getattr(args, name, None):
                raise ConfigError(f"the watch cannot serve {why}", f"TrainingArguments.{name}")
        if args.remove_unused_columns:
            raise ConfigError(
                f"the Trainer drops the {self.ids!r} column: set remove_unused_columns=False",
                "TrainingArguments.remove_unused_columns",
            )
        self._release(model, None)  # what a train() that raised left
        stale = getattr(vars(model).get("forward"), "func", None)  # another callback's, left so
        if isinstance(getattr(stale, "__self__", None), WatchCallback):
            stale.__self__._release(model, None)
        self.due = Due()
        self._before = vars(model).get("forward", _CLASS)
        self._wrapper = functools.partial(self._forward, model, model.forward)
        model.forward = self._wrapper

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **_: Any):
        self.epoch = int(state.epoch or 0)

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module, **_: Any):
        self._release(model, None)

    def _release(self, model: nn.Module, exception: BaseException | None) -> None:
        """The model's own forward again and the watch file closed. The Trainer calls no
        callback when ``train()`` raises: a step that raises in the model's call releases it
        here, one that raises elsewhere at the next ``train()``."""
        if self._wrapper is not None and vars(model).get("forward") is self._wrapper:
            if self._before is _CLASS:
                del model.forward  # the class's own again
            else:
                model.forward = self._before
        self._wrapper = None
        if self.watch is not None:
            watch, self.watch = self.watch, None
            kind = None if exception is None else type(exception)
            watch.__exit__(kind, exception, None)

    def _forward(self, model: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not model.training or not torch.is_grad_enabled() or args:
            kwargs.pop(self.ids, None)  # an evaluation's batch: the ids are no input
            return original(*args, **kwargs)
        try:
            loss = self._step(model, original, kwargs)
        except BaseException as e:  # Ctrl-C or an error in the step: the model as it was
            self._release(model, e)
            raise
        kept = ("start_logits", "end_logits") if self.kind == "qa" else ("logits",)
        release = functools.partial(self._release, model)
        return OUTPUTS[self.kind](loss=loss, **{name: NotKept(name, release) for name in kept})

    def _step(self, model: nn.Module, original: Any, kwargs: dict) -> Tensor:
        """A training call through the watch: its loss (the first one's kind read off the
        model, and the watch made)."""
        if "labels" not in kwargs and not all(k in kwargs for k in POSITIONS):
            raise ModelError(
                f"a training call without labels (its batch: {', '.join(sorted(kwargs))}): the "
                "watch needs the Trainer to pass them to the model (labels, or a question "
                "answerer's start and end positions; no compute_loss_func)",
                "Trainer",
            )
        if self.ids not in kwargs:
            raise ModelError(f"the batch has no {self.ids!r} column", "WatchCallback(ids=)")
        ids = kwargs.pop(self.ids)
        labels = kwargs.pop("labels") if "labels" in kwargs else spans(kwargs, ids)
        items = kwargs.pop("num_items_in_batch", None)
        first = self.watch is None  # the first step: the batch's keys are the model's inputs
        if first:
            self.kind, self.task = task(model, labels)
            if self.kind == "qa" and self.record is not None:
                raise ConfigError(
                    "record= of a question answerer: its replay's config names one output, "
                    "the answerer gives two (start and end logits); watch it without record=",
                    "WatchCallback(record=)",
                )
        if self.kind == "seq2seq" and "decoder_input_ids" not in kwargs:
            # the model makes them of its labels, which the watch takes from it
            kwargs["decoder_input_ids"] = decoder_inputs(model, labels)
        if first:
            self.names = tuple(kwargs)
            self.watch = self._watch(model, _Call(original, self.names, self.kind == "qa"))
        check = None
        if self.due(self.epoch):
            same = functools.partial(self._same_loss, model, original, kwargs, labels, items,
                                     state())  # fmt: skip
            check = functools.partial(checked, self.watch, self.due, same)
        loss = self.watch.step(self._inputs(kwargs), labels, ids, epoch=self.epoch,
                               divisor=self._divisor(labels, items), check=check)  # fmt: skip
        self.due.took(self.epoch, check is not None)
        return loss

    def _same_loss(
        self, model: nn.Module, original: Any, kwargs: dict, labels: Tensor, items: Any,
        began: State, loss: Tensor,
    ) -> None:  # fmt: skip
        """A checked step's ``loss`` must be the one the model's own forward takes of its
        labels, under the step's masks (``rerun`` from ``began``, the random state the step
        began in), in value and gradient (``differs``): a class whose loss is another (next
        tokens unshifted, summed, weighted) is refused, not trained on another loss."""
        given = dict(zip(POSITIONS, labels.T, strict=True)) if self.kind == "qa" else {}
        given = given or {"labels": labels}
        if items is not None:
            given["num_items_in_batch"] = items
        out = rerun(model, began, lambda: original(**kwargs, **given))
        own = differs(loss, getattr(out, "loss", None), self.watch.params, model, self.due)
        if own is None:
            return
        name, reduction = self.task
        raise ConfigError(
            f"{TITLES[self.kind]}'s loss as the watch takes it ({name}, the mean over its "
            f"{'tokens' if reduction == 'tokens' else 'rows'}) is {loss.item():.6g} on step "
            f"{self.watch.steps}'s batch, {type(model).__name__}'s own {own}: its class takes "
            "another loss of its labels, which the watch would not train on; watch a loop of "
            "your own (Watch) with the loss the model trains on",
            "Trainer",
        )

    def _inputs(self, kwargs: dict) -> tuple[Tensor, ...]:
        """The call's inputs in the order of the first step's, by name: the same names."""
        if set(kwargs) != set(self.names):
            raise ModelError(
                f"a training call's inputs are {sorted(kwargs)}, the first step's "
                f"{sorted(self.names)}: the watch calls the model with the first step's",
                "Trainer",
            )
        return tuple(kwargs[k] for k in self.names)

    def _divisor(self, labels: Tensor, items: Any) -> float | None:
        """What the step's loss is over: a language model's step's tokens where the Trainer
        counts them (it divides the loss by the number of micro-batches it accumulates
        otherwise), else the batch's; a classifier's counted rows, or tokens (a label of -100
        is not counted); a regression's or a multi-label one's, every row."""
        if self.kind == "lm":
            return float(items) if items is not None else None
        return self._counted(labels, items) if self.task[0] == "cross_entropy" else None

    def _counted(self, labels: Tensor, items: Any) -> float | None:
        """The divisor of a cross entropy but a causal language model's: its counted rows or
        tokens, where the model's own loss is their mean, as every one is without accumulation
        (``CrossEntropyLoss`` or the step's count, ``num_items_in_batch``, one and the same);
        accumulated, the two differ and which the model takes is its class's: refused."""
        if self.accumulated and items is not None:
            raise ConfigError(
                f"{TITLES[self.kind]}'s cross entropy under gradient accumulation: whether its "
                "loss is each micro-batch's mean or the step's sum over its counted labels "
                "depends on the model's class; watch it without accumulation",
                "TrainingArguments.gradient_accumulation_steps",
            )
        counted = int((labels != -100).sum())
        if not counted:
            raise ModelError("a batch whose every label is -100 has no loss to train on", "labels")
        return float(counted) if counted < labels.numel() else None

    def _watch(self, model: nn.Module, forward: _Call) -> Watch:
        loss, reduction = self.task
        return Watch(
            model, self.out, loss, reduction=reduction, on_step=self.on_step, forward=forward,
            step=self.first, **self.recorded,
        ).__enter__()  # fmt: skip


def _recorded(args: Any, state: Any, optimizer: Any, folder: str | Path, segment: int) -> dict:
    """``Watch``'s record arguments read off the ``Trainer``: its optimizer (inside
    accelerate's wrapper), its clip. A run resumed mid-epoch must skip the batches the stopped
    run fed (the ``Trainer`` does, and restores the random state, unless told not to)."""
    if args.gradient_accumulation_steps != 1:
        raise ConfigError(
            "record= replays a step a batch, not accumulated ones",
            "TrainingArguments.gradient_accumulation_steps",
        )
    if args.ignore_data_skip and state.global_step and (state.epoch or 0) % 1:
        raise ConfigError(
            f"resumed at step {state.global_step}, mid-epoch, with ignore_data_skip the Trainer "
            "feeds the epoch's first batches again: not the run the record began; resume "
            "without it",
            "TrainingArguments.ignore_data_skip",
        )
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return {"record": folder, "optimizer": optimizer, "clip": clip, "segment": segment}


class _Call:
    """The engine's forward of a Hugging Face model: its own forward, the batch's tensors by
    keyword, its logits (a question answerer's, ``spans``: its start's and end's, (B, 2, T))."""

    def __init__(self, forward: Any, names: tuple[str, ...], spans: bool = False):
        self.forward, self.names, self.spans = forward, names, spans

    def __call__(self, model: nn.Module, inputs: tuple[Tensor, ...]) -> Tensor:
        out = self.forward(**dict(zip(self.names, inputs, strict=True)))
        return torch.stack([out.start_logits, out.end_logits], 1) if self.spans else out.logits
