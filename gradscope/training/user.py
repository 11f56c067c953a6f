"""``train.fn``: a user's own training loop, called in place of the recipe."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import GradscopeError, ModelError, raised
from ..io.model import import_object


def run_user_fn(spec: str, model: nn.Module, rows: np.ndarray, seed: int) -> nn.Module:
    """``fn(model, rows, seed)``: it trains ``model`` in place and returns None, or returns the
    trained model; anything else, or an exception, is one line naming ``train.fn``."""
    fn = import_object(spec, "train.fn")
    if not callable(fn):
        raise ModelError(f"train.fn names a {type(fn).__name__}, not a function", "train.fn")
    try:
        trained = fn(model, rows.copy(), seed)
    except GradscopeError:
        raise
    except (Exception, SystemExit) as e:  # sys.exit() in a loop written as a script's
        raise ModelError(f"train.fn raised {raised(e)}", "train.fn") from e
    if trained is None:
        trained = model
    if not isinstance(trained, nn.Module):
        raise ModelError(
            f"train.fn returned a {type(trained).__name__}; return the trained model or None",
            "train.fn",
        )
    bad = next((n for n, p in trained.named_parameters() if not torch.isfinite(p).all()), None)
    if bad is not None:  # saved, and validate's losses all NaN, without a word
        raise ModelError(f"train.fn left weight {bad} NaN or infinite: nothing to save", "train.fn")
    return trained.eval()
