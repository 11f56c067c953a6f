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
    shapes = _shapes(model)  # before: fn may change the model it is given
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
    _check_fits(shapes, _shapes(trained))
    bad = next((n for n, p in trained.named_parameters() if not torch.isfinite(p).all()), None)
    if bad is not None:  # saved, and validate's losses all NaN, without a word
        raise ModelError(f"train.fn left weight {bad} NaN or infinite: nothing to save", "train.fn")
    return trained.eval()


def _shapes(model: nn.Module) -> dict[str, tuple]:
    """Each entry of the model's state dict: its shape and dtype."""
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _check_fits(want: dict[str, tuple], got: dict[str, tuple]) -> None:
    """The trained model's state dict as model.factory's model holds it: its checkpoint must
    load where it is read (validate, norms), not fail there blaming another input."""
    if want == got:
        return
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    odd = [k for k in want if k in got and want[k] != got[k]]

    def shown(entry: tuple) -> str:
        return f"{list(entry[0])} {str(entry[1]).removeprefix('torch.')}"

    if odd:
        what = f"{odd[0]} is {shown(got[odd[0]])}, model.factory's {shown(want[odd[0]])}"
    else:
        what = f"no {missing[0]}" if missing else f"{extra[0]}, which model.factory's lacks"
    raise ModelError(
        f"train.fn returned a model whose weights do not fit model.factory's ({what}): return "
        "the model it was given, trained",
        "train.fn",
    )
