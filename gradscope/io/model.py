"""Model factories and checkpoints: build the user's module and load its weights."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError, ModelError, one_line, raised
from .files import LFS_POINTER, lfs_pointer, load_state_dict


def import_object(spec: str, key: str) -> Any:
    """Import ``Name`` from ``/abs/file.py:Name`` or ``package.module:Name``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise ConfigError(f"expected 'file.py:Name' or 'package.module:Name', got {spec!r}", key)
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            raise ConfigError(f"file not found: {file}", key)
        module_name = f"_gradscope_user_{file.stem}_{abs(hash(str(file)))}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            sys.path.insert(0, str(file.parent))  # let the file import its neighbours
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:  # a syntax error, an unreadable file, its own imports failing
                del sys.modules[module_name]
                raise ConfigError(f"cannot import {file}: {type(e).__name__}: {e}", key) from e
            except BaseException:
                del sys.modules[module_name]
                raise
            finally:
                sys.path.remove(str(file.parent))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"cannot import {target!r}: {e}", key) from e
    if not hasattr(module, name):
        raise ConfigError(f"{target} has no attribute {name!r}", key)
    return getattr(module, name)


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft saves, loads


def _extract(state: Any, cfg: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    if cfg.state_dict_key is not None:
        if not isinstance(state, dict) or cfg.state_dict_key not in state:
            keys = ", ".join(list(state)[:8]) if isinstance(state, dict) else type(state).__name__
            raise ModelError(f"checkpoint has no key {cfg.state_dict_key!r} (it has: {keys})", path)
        state = state[cfg.state_dict_key]
    if isinstance(state, nn.Module):  # a trusted pickle of a whole model
        state = state.state_dict()
    if not isinstance(state, dict):
        raise ModelError(f"checkpoint is a {type(state).__name__}, not a state dict", path)
    if cfg.strip_prefix:
        state = {k.removeprefix(cfg.strip_prefix): v for k, v in state.items()}
    return state


def _from_hf(factory: Any, cfg: ModelConfig) -> nn.Module:
    """A Hugging Face class from model.pretrained (a local folder) or model.config (random init)."""
    key = "model.pretrained" if cfg.pretrained is not None else "model.config"
    if not hasattr(factory, "from_pretrained"):
        raise ConfigError(
            f"{key} needs a Hugging Face class as model.factory (one with from_pretrained), "
            f"got {getattr(factory, '__name__', factory)!r}",
            key,
        )
    if cfg.pretrained is not None:
        _folder(cfg.pretrained, "model.pretrained")
        if not (Path(cfg.pretrained) / "config.json").is_file():
            raise ModelError("not a save_pretrained folder: it has no config.json", cfg.pretrained)
        try:
            return factory.from_pretrained(cfg.pretrained, local_files_only=True, **cfg.kwargs)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) of a .bin
            raise ModelError(
                "a weights file in the folder holds objects other than tensors and is not "
                "loaded (that would run its pickle); save the model as safetensors",
                cfg.pretrained,
            ) from e
        except Exception as e:  # OSError, ValueError, safetensors' own error for a cut file, ...
            pointers = [f for f in Path(cfg.pretrained).iterdir() if f.is_file() and lfs_pointer(f)]
            if pointers:
                raise ModelError(LFS_POINTER, str(pointers[0])) from e
            raise ModelError(
                f"cannot load {factory.__name__} from the folder: {one_line(e)}", cfg.pretrained
            ) from e
    try:
        if getattr(factory, "config_class", None) is not None:  # a model class: its own config
            return factory(factory.config_class(**cfg.config), **cfg.kwargs)
        from transformers import AutoConfig  # an Auto* class: the config names the model type

        mapping = dict(cfg.config)
        if "model_type" not in mapping:
            raise ConfigError(
                f"model.config for {factory.__name__} needs model_type (e.g. gpt2, bert)", key
            )
        return factory.from_config(AutoConfig.for_model(mapping.pop("model_type"), **mapping))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"cannot build {factory.__name__} from model.config: {one_line(e)}", key
        ) from e


def _construct(cfg: ModelConfig) -> nn.Module:
    factory = import_object(cfg.factory, "model.factory")
    if cfg.pretrained is not None or cfg.config is not None:
        model = _from_hf(factory, cfg)
    else:
        try:
            model = factory(**cfg.kwargs)
        except (TypeError, OSError) as e:
            hint = "; a Hugging Face class needs model.config or model.pretrained"
            hint = hint if hasattr(factory, "from_pretrained") else ""
            raise ConfigError(
                f"cannot call the model factory with model.kwargs: {one_line(e)}{hint}",
                "model.kwargs",
            ) from e
        except Exception as e:  # the factory's own code: its error, on one line
            raise ModelError(
                f"the model factory raised {raised(e)} (GRADSCOPE_DEBUG=1 shows where)",
                "model.factory",
            ) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"the factory returned a {type(model).__name__}, not an nn.Module", "model.factory"
        )
    return _uncompiled(model)


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile``d one wraps (its ``_orig_mod``): gradscope runs models
    eagerly (``engine/eager.py``), and a checkpoint, the parameters' names and
    ``params.include`` then read as the model's own, without the wrapper's ``_orig_mod.``."""
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # none compiled where not imported
    kind = getattr(compiled, "OptimizedModule", None)
    while kind is not None and isinstance(model, kind):
        model = model._orig_mod
    return model


def _tied_filled(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` with each key missing for a tied weight taken from a key that shares its tensor
    (``save_pretrained`` writes ``wte.weight`` once, not also ``lm_head.weight``)."""
    groups: dict[tuple[int, tuple], list[str]] = {}
    for name, t in model.state_dict().items():
        if t.numel():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
    state = dict(state)
    for names in groups.values():
        present = [n for n in names if n in state]
        if present and len(names) > 1:
            for n in names:
                state.setdefault(n, state[present[0]])
    return state


def build_model(cfg: ModelConfig, trust_checkpoint: bool = False) -> nn.Module:
    """Build the model (factory with kwargs, or a Hugging Face class from model.config or
    model.pretrained), load the checkpoint strictly (every key, every shape), then the adapter."""
    model = _construct(cfg)
    if cfg.checkpoint is not None:
        model = _load_checkpoint(model, cfg, trust_checkpoint)
    return model if cfg.adapter is None else load_adapter(model, cfg.adapter)


def _folder(path: str, what: str) -> None:
    """``path`` a folder: one not there, or a file, said as such (not as a folder lacking a
    file of its kind)."""
    if not Path(path).exists():
        raise ModelError(f"{what} folder not found", path)
    if not Path(path).is_dir():
        raise ModelError(f"{what} is a file, not a folder (a save_pretrained or peft one)", path)


def load_adapter(model: nn.Module, folder: str) -> nn.Module:
    """``model`` with the peft adapter saved in ``folder`` (``adapter_config.json`` and its
    weights) loaded onto it: a ``PeftModel`` whose adapter weights require grad and whose base
    does not, so that by default only the adapters are scored. Nothing is downloaded."""
    _folder(folder, "the adapter")
    if not (Path(folder) / "adapter_config.json").is_file():
        raise ModelError("not a peft adapter folder: it has no adapter_config.json", folder)
    weights = [f for f in ADAPTER_WEIGHTS if (Path(folder) / f).is_file()]
    if not weights:  # peft would look for them on the Hub, and talk about repo ids
        raise ModelError(
            f"the adapter folder has no weights file ({' or '.join(ADAPTER_WEIGHTS)})", folder
        )
    if lfs_pointer(Path(folder) / weights[0]):
        raise ModelError(LFS_POINTER, str(Path(folder) / weights[0]))
    try:
        from peft import PeftModel
    except ImportError as e:
        raise ConfigError(
            "model.adapter needs the peft package: pip install peft", "model.adapter"
        ) from e
    try:
        return PeftModel.from_pretrained(model, folder, is_trainable=True, local_files_only=True)
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True) of adapter_model.bin
        raise ModelError(
            f"the adapter's {weights[0]} holds objects other than tensors and is not loaded (that "
            "would run its pickle); save the adapter as safetensors",
            folder,
        ) from e
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, AttributeError) as e:
        raise ModelError(f"cannot load the adapter onto the model: {one_line(e)}", folder) from e


def _load_checkpoint(model: nn.Module, cfg: ModelConfig, trust_checkpoint: bool) -> nn.Module:
    state = _extract(load_state_dict(cfg.checkpoint, trust_checkpoint), cfg, cfg.checkpoint)
    state = _tied_filled(state, model)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    prefix = _fitting_prefix(state, expected) if unexpected else None
    if prefix is not None:
        raise ModelError(
            f"checkpoint does not fit the model: every key starts with {prefix!r}, which the "
            f"model's do not; set model.strip_prefix: {prefix!r}",
            cfg.checkpoint,
        )
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"
            )
        hint = "; try model.strip_prefix or model.state_dict_key" if unexpected else ""
        raise ModelError(
            f"checkpoint does not fit the model: {'; '.join(parts)}{hint}", cfg.checkpoint
        )
    unfit = [_unfit(k, state[k], v) for k, v in expected.items()]
    unfit = [u for u in unfit if u]
    if unfit:
        more = f"; and {len(unfit) - 5} more" if len(unfit) > 5 else ""
        raise ModelError(
            f"checkpoint does not fit the model: {'; '.join(unfit[:5])}{more}", cfg.checkpoint
        )
    # dtype: null keeps the weights' (of several, one that holds them all: float64 for float32
    # beside float64; buffers follow); cast first, so no weight is rounded through the factory's
    weights = {n for n, _ in model.named_parameters()}
    floats = {v.dtype for k, v in state.items() if k in weights and v.is_floating_point()}
    if floats:
        model = model.to(functools.reduce(torch.promote_types, floats))
    model.load_state_dict(state)
    return model


def _fitting_prefix(state: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The prefix, ending at a dot, whose removal from every key of the checkpoint leaves keys
    of the model (``module.`` from DDP, ``_orig_mod.`` from ``torch.compile``), or None."""
    first = next(iter(state), "")
    for at in (i + 1 for i, c in enumerate(first) if c == "."):
        prefix = first[:at]
        every = all(k.startswith(prefix) for k in state)
        if every and {k.removeprefix(prefix) for k in state} <= expected.keys():
            return prefix
    return None


def _unfit(key: str, saved: torch.Tensor, expected: torch.Tensor) -> str | None:
    """How one tensor of the checkpoint does not fit the model's, or None."""
    if tuple(saved.shape) != tuple(expected.shape):
        return f"{key} has shape {tuple(saved.shape)}, the model expects {tuple(expected.shape)}"
    if saved.is_floating_point() != expected.is_floating_point():
        return f"{key} is {_dtype(saved)}, the model expects {_dtype(expected)}"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
