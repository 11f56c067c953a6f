"""The columns of a scores file: name, type, which runs write it and what it means.

The one description of the output: the documentation's column reference is rendered from
``COLUMNS``, and tests/docs checks that every column a run writes matches an entry. Names with
``<module>`` or ``<k>`` stand for a family of columns (``grad_norm/net.0``, ``loss@2``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    written: str  # which commands and options write it
    meaning: str

    def matches(self, name: str) -> bool:
        parts = re.split(r"(<module>|<k>)", self.name)
        wild = {"<module>": ".+", "<k>": r"\d+"}
        return re.fullmatch("".join(wild.get(p, re.escape(p)) for p in parts), name) is not None


COLUMNS = (
    Column("example_id", "int64", "always", "0-based position of the example in the dataset."),
    Column("id", "as given", "`data.ids` set", "The example's `data.ids` column, copied."),
    Column(
        "ref_id",
        "int64",
        "`influence --per-ref`",
        "The 0-based row of REF this row is scored against: one row per (example, reference).",
    ),
    Column(
        "loss",
        "float64",
        "always",
        "The example's own loss (with `model.checkpoints`: at the last checkpoint). NaN where "
        "it counts no target (every target `ignore_index`, or a `causal_lm` row of one token): "
        "a mean over nothing is not a loss of 0. Such a row's gradient is zero (`grad_norm` "
        "0), its `finite` false, it ranks under no column (`--by loss:low` included), and "
        "`summary` says how many there are.",
    ),
    Column(
        "grad_norm",
        "float64",
        "always",
        "L2 norm of the example's loss gradient over the selected parameters: those "
        "`params.include` names, else the ones that require grad (all of them if none does); "
        "the metadata's `params` says which. With `model.checkpoints`: at the last checkpoint.",
    ),
    Column(
        "grad_norm/<module>",
        "float64",
        "`norms --per-layer`",
        "The norm over one module's selected parameters; the squares add up to `grad_norm`².",
    ),
    Column(
        "loss@<k>",
        "float64",
        "`model.checkpoints`",
        "The loss at checkpoint k (0-based, in the listed order).",
    ),
    Column(
        "grad_norm@<k>",
        "float64",
        "`model.checkpoints`",
        "The gradient norm at checkpoint k (0-based, in the listed order).",
    ),
    Column(
        "self_influence",
        "float64",
        "`norms` with `model.checkpoints` or `--precondition`",
        "TracIn's self-influence `sum_k w_k grad_norm@k²`; with `--precondition`, "
        "`sum_k w_k g_kᵀ P g_k`, P the inverse K-FAC/EK-FAC curvature or Adam's "
        "`1 / (sqrt(v_hat) + eps)`. `norms` ranks by it.",
    ),
    Column(
        "influence",
        "float64",
        "`influence`",
        "`<grad l_i, g_ref>`, g_ref the gradient of the mean loss over REF (summed over "
        "checkpoints with their weights). Positive: a gradient step on the example lowers the "
        "reference loss.",
    ),
    Column(
        "cosine",
        "float64",
        "`influence`",
        "`influence / (grad_norm · ‖g_ref‖)`, over all checkpoints' weighted gradients; against "
        "the preconditioned reference with `--precondition` or `--curvature` (`P g_ref`).",
    ),
    Column(
        "target",
        "as given",
        "targets of one value per example",
        "The example's target.",
    ),
    Column(
        "pred",
        "int64",
        "classification losses, one label per example",
        "The model's argmax class (`cross_entropy`, `nll`; `bce_with_logits`: logit > 0).",
    ),
    Column(
        "prob",
        "float64",
        "classification losses, one label per example",
        "The model's probability of the target; NaN where the target is `ignore_index`.",
    ),
    Column(
        "margin",
        "float64",
        "classification losses, one label per example",
        "The target's logit minus the largest other logit (`bce_with_logits`: z for a target "
        "of 1, −z for 0, (2y − 1) z for a soft one); negative: the model predicts another "
        "class. NaN where the target is `ignore_index`.",
    ),
    Column(
        "robust_z",
        "float64",
        "always",
        "Robust z, `(x − median) / (1.4826 · MAD)`, of the file's ranked score (`influence`, "
        "else `self_influence`, else `loss`) over the file's finite rows; NaN where the "
        "row is not finite; where over half the values are equal (MAD 0), `1.2533 · the mean "
        "absolute deviation` divides instead (the modified z-score's). The tables show the "
        "same for the column they rank by.",
    ),
    Column(
        "class_z",
        "float64",
        "targets that are class labels (at most 100 distinct integers)",
        "Robust z, `(x − median) / (1.4826 · MAD)`, of the file's ranked score (`influence`, "
        "else `self_influence`, else `loss`) within the example's target class.",
    ),
    Column(
        "finite",
        "bool",
        "always",
        "False when the example's loss or gradient had a NaN or inf, or the row counts no "
        "target; the other rows are unaffected.",
    ),
)


def describe(name: str) -> Column | None:
    """The entry documenting the column ``name``, or None when it has none."""
    return next((c for c in COLUMNS if c.matches(name)), None)
