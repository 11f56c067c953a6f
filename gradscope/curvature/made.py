"""Where a factors file came from, checked before it preconditions a run: the checkpoint and
adapter (by sha256), the settings that make the model and its loss, and, where both computed
in one dtype, the selected weights themselves (which also tell a held model's, and a
``state_dict_key`` or ``strip_prefix`` that picked other weights from the same file)."""

from __future__ import annotations

import hashlib
import json
import re

import torch

from ..errors import ModelError
from ..io.files import hash_tensor
from .store import Factors

# the config keys that make the model and its loss, each compared where the factors record it;
# the index's GRADIENT_KEYS start from these (a key added here refuses every older index)
SETTINGS = (
    "model.factory",
    "model.kwargs",
    "model.state_dict_key",
    "model.strip_prefix",
    "model.output",
    "model.config",
    "loss.name",
    "loss.kwargs",
    "loss.class_dim",
    "loss.token_reduction",
)
_HELD = re.compile(r"<(\w+) at 0x[0-9a-f]+>")  # a model held in Python (io.held's spec)


def plain(key: str, value: object) -> object:
    """A config value as a factors file or an index compares it: a ``file.py:Name`` by its name
    (the file may lie elsewhere: its sha256 is compared where it must be), a model held in
    Python by its class (its weights are compared by their sha256)."""
    if isinstance(value, str) and ".py:" in value:
        return value.rpartition(":")[2]
    if key == "model.factory" and isinstance(value, str) and (held := _HELD.fullmatch(value)):
        return held.group(1)
    return value


def settings(raw: dict) -> dict[str, object]:
    """``SETTINGS`` of a config (as ``Config.to_dict`` gives it, or JSON read it back)."""
    out = {}
    for key in SETTINGS:
        section, name = key.split(".")
        value = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
        out[key] = json.loads(json.dumps(plain(key, value), default=str))
    return out


def weights_sha256(plan) -> str | None:
    """The sha256 of the selected parameters (names, dtypes, shapes, values) of ``plan``; None
    where a rank holds a shard of them (FSDP's DTensors: no rank sees the whole)."""
    tensors = [(p.name, p.param.detach()) for p in sorted(plan.included, key=lambda p: p.name)]
    if any(type(t) is not torch.Tensor for _, t in tensors):
        return None
    h = hashlib.sha256()
    for name, t in tensors:
        hash_tensor(h, name, t)
    return h.hexdigest()


def check_made(factors: Factors, model: dict, engine, where: str) -> None:
    """The factors must come from this checkpoint, where ``model`` says which (none: the
    factory's initial weights, which factors of a checkpoint do not fit, nor the reverse),
    this adapter (where the factors record theirs: none is an adapter too), these settings
    (where both record them), and these weights (where both computed in one dtype)."""
    made = factors.meta.get("model")
    made = made if isinstance(made, dict) else {}
    ours, theirs = model.get("checkpoint_sha256"), made.get("checkpoint_sha256")
    if "checkpoint_sha256" in model and ours != theirs:
        at = (
            "another checkpoint (its sha256 differs)"
            if ours and theirs
            else ("a checkpoint; this config names none" if theirs else "no checkpoint they record")
        )
        _refuse(f"the factors were computed at {at}", where)
    if "adapter_sha256" in model and "adapter_sha256" in made:
        ours, theirs = model["adapter_sha256"], made["adapter_sha256"]
        if ours != theirs:
            _refuse(
                f"the factors were computed with another model.adapter (sha256 "
                f"{_short(theirs)}, this config's {_short(ours)})",
                where,
            )
    if isinstance(model.get("config"), dict) and isinstance(made.get("config"), dict):
        mine, theirs = settings(model["config"]), settings(made["config"])
        differ = [k for k in SETTINGS if mine[k] != theirs[k]]
        if differ:
            _refuse(f"the factors were computed with another {', '.join(differ)}", where)
    params = engine.plan.included
    dtype = str(params[0].param.dtype).removeprefix("torch.") if params else None
    theirs = made.get("weights_sha256")
    if made.get("dtype") == dtype and theirs is not None:
        ours = weights_sha256(engine.plan)
        if ours is not None and ours != theirs:
            _refuse("the factors were computed at other weights (their sha256 differs)", where)


def _refuse(what: str, where: str) -> None:
    raise ModelError(f"{what}; run gradscope factors on this model again", where)


def _short(sha: object) -> str:
    return f"{sha[:12]}..." if isinstance(sha, str) else "none"
