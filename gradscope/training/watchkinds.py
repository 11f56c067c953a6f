"""What a Hugging Face ``Trainer``'s model is, by its class, and the loss the watch takes of its
labels as the model's own forward would: a causal language model's next tokens; a sequence
classifier's as its own loss picks it; a token classifier's, a masked or a seq2seq language
model's class id per token, unshifted (a seq2seq model's decoder inputs made of its labels, as
its forward makes them); a multiple-choice model's choice; a question answerer's start and end
positions, the mean of the two (``spans``). A PEFT model is its base model's kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from transformers.modeling_outputs import (
    CausalLMOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES,
)

from ..errors import ConfigError, ModelError

CAUSAL_LM = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
# a label (or a row of them) an input: a sequence's, an image's, a video's, a sound's, whose
# loss transformers takes alike (``ForSequenceClassificationLoss``)
CLASSIFIERS = frozenset(
    name
    for mapping in (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES,
        MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
    )
    for names in mapping.values()
    for name in ((names,) if isinstance(names, str) else names)
)
CLASSIFYING = tuple(f"For{kind}Classification" for kind in ("Sequence", "Image", "Video", "Audio"))
TAGGERS = frozenset(MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.values())
SEQ2SEQ = frozenset(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values())
CHOOSERS = frozenset(MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES.values())
ANSWERERS = frozenset(MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES.values())
POSITIONS = ("start_positions", "end_positions")  # a question answerer's labels
TITLES = {
    "lm": "a causal language model",
    "sequence": "a classifier",
    "token": "a token classifier",
    "masked": "a masked language model",
    "seq2seq": "a seq2seq language model",
    "choice": "a multiple-choice model",
    "qa": "a question answerer",
}
OUTPUTS = {  # the output the Trainer reads the loss off, by the model's kind
    "lm": CausalLMOutput,
    "sequence": SequenceClassifierOutput,
    "token": TokenClassifierOutput,
    "masked": MaskedLMOutput,  # by its name only: transformers' masked-LM mapping names
    "seq2seq": Seq2SeqLMOutput,  # seq2seq models too, whose labels feed their decoder
    "choice": MultipleChoiceModelOutput,
    "qa": QuestionAnsweringModelOutput,
}


def task(model: nn.Module, labels: Tensor) -> tuple[str, tuple[str, str]]:
    """The model's kind as the ``Trainer`` tells it (its class among transformers' causal,
    masked and seq2seq language models, sequence, image, video, audio and token classifiers,
    multiple-choice models and question answerers), and the loss and reduction it takes of
    ``labels``: a causal language model's, of a row of tokens each, shifted; a classifier's of
    an input as its own loss picks it (``_problem``); a multiple-choice model's, its choice's
    cross entropy; a question answerer's, the mean of its start's and its end's (``spans``);
    the others', a class id per token, unshifted; else refused."""
    model = _base(model)
    name, config = type(model).__name__, getattr(model, "config", None)
    problem, classes = getattr(config, "problem_type", None), getattr(config, "num_labels", 0)
    ids = labels.dim() == 2 and not labels.is_floating_point()
    if _kind(name, CAUSAL_LM, "ForCausalLM", "LMHeadModel") and ids:
        return "lm", ("causal_lm", "tokens")
    if _kind(name, TAGGERS, "ForTokenClassification") and ids:
        return "token", ("cross_entropy", "tokens")
    if name.endswith("ForMaskedLM") and ids:
        return "masked", ("cross_entropy", "tokens")
    if name in SEQ2SEQ and getattr(config, "is_encoder_decoder", False) and ids:
        return "seq2seq", ("cross_entropy", "tokens")
    integers = not labels.is_floating_point()
    if _kind(name, CHOOSERS, "ForMultipleChoice") and labels.dim() == 1 and integers:
        return "choice", ("cross_entropy", "mean")
    if _kind(name, ANSWERERS, "ForQuestionAnswering") and labels.shape[1:] == (2,) and integers:
        return "qa", ("cross_entropy", "mean")  # the start's and the end's mean (``spans``)
    loss = _problem(problem, classes, labels)
    if _kind(name, CLASSIFIERS, *CLASSIFYING) and loss is not None:
        return "sequence", (loss, "mean")
    raise ConfigError(
        "the watch serves causal, masked and seq2seq language models and token classifiers (a "
        "row of class ids each), sequence, image, video and audio classifiers (a label or a "
        f"row of {classes} a row), multiple-choice models and question answerers: not a "
        f"{name} with labels {tuple(labels.shape)} {labels.dtype}, problem_type {problem!r}, "
        f"{classes} labels",
        "Trainer",
    )


def spans(kwargs: dict, ids: Tensor) -> Tensor:
    """A question answerer's labels, taken out of its call's ``kwargs`` (its rows' ``ids``, to
    name one in an error): (B, 2), its start and end positions, each a class id among its
    tokens, whose two cross entropies' mean is its loss (transformers'
    ``ForQuestionAnsweringLoss``, which takes a position below 0 as 0, and leaves one past the
    tokens out of the mean of its kind: refused, the mean then not each row's; where no input
    says the tokens, the loss's own check of its class ids refuses it)."""
    start, end = (kwargs.pop(k).reshape(-1) for k in POSITIONS)
    labels = torch.stack([start, end], 1).clamp_min(0)
    shaped = [t.shape[1] for t in kwargs.values() if isinstance(t, Tensor) and t.dim() > 1]
    if not shaped:
        return labels
    tokens = shaped[0]
    past = (labels >= tokens).any(1).nonzero().flatten().tolist()
    if past:
        k = past[0]
        raise ModelError(
            f"the answer of the row of id {int(ids[k])} lies past its {tokens} tokens (start "
            f"and end {labels[k].tolist()}), which the model's loss leaves out: the watch takes "
            "each row's mean of its start's and end's cross entropy; give positions inside "
            "the tokens (0, the first token, for no answer)",
            "start_positions",
        )
    return labels


def _problem(problem: str | None, classes: int, labels: Tensor) -> str | None:
    """A classifier's loss as transformers' own picks it (``problem_type``, else by
    its labels: one label a regression, integer classes one each, else several): the mean over
    the rows of ``cross_entropy``, ``mse`` or ``bce_with_logits``; None where the labels do not
    fit it."""
    if problem is None:
        if classes == 1:
            problem = "regression"
        elif classes > 1 and labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    rows = len(labels)
    if problem == "single_label_classification" and labels.dim() == 1:
        return None if labels.is_floating_point() else "cross_entropy"
    if problem == "regression" and labels.numel() == rows * classes:
        return "mse"
    if problem == "multi_label_classification" and labels.shape == (rows, classes):
        return "bce_with_logits"
    return None


def decoder_inputs(model: nn.Module, labels: Tensor) -> Tensor:
    """A seq2seq model's decoder inputs, its labels shifted right as its own forward shifts
    them where none are given."""
    shift = getattr(_base(model), "prepare_decoder_input_ids_from_labels", None)
    if shift is None:
        raise ConfigError(
            f"{type(model).__name__} makes no decoder inputs of its labels: give the batch "
            "decoder_input_ids (DataCollatorForSeq2Seq(model=...) does)",
            "Trainer",
        )
    return shift(labels=labels)


def _kind(name: str, names: frozenset[str], *endings: str) -> bool:
    return name in names or name.endswith(endings)


def _base(model: nn.Module) -> nn.Module:
    """A PEFT model's base model, whose kind it is; any other model itself."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


class NotKept:
    """What the watched step's output holds in place of the model's logits, which the step does
    not keep: a ``compute_loss`` of the user's that reads them (a loss of its own, which the
    watch does not measure) is refused in one line, where None raised in the user's code; the
    model released first (``release``), as a step that raises in the model's call is."""

    def __init__(self, name: str, release: Callable[[BaseException], None]):
        self.name, self.release = name, release

    def refused(self, *_: Any) -> Any:
        error = ModelError(
            f"the watched step's output holds the loss alone, not the model's {self.name}: a "
            "Trainer whose compute_loss reads them trains on a loss of its own, which the watch "
            "does not measure; train on the model's own loss (the labels in the batch)",
            "Trainer.compute_loss",
        )
        self.release(error)
        raise error

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy's and pickle's probes: not a use
            raise AttributeError(name)
        return self.refused()

    __getitem__ = __iter__ = __len__ = __bool__ = __array__ = refused

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        leaves = tree_leaves((args, kwargs or {}))  # torch.cat([it, t]), input=it: nested
        return next(a for a in leaves if isinstance(a, NotKept)).refused()
