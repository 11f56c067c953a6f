"""The commands that fit, check, show, train and measure, as functions: ``factors``, ``check``,
``report``, ``train`` and ``validate``, each the call its command makes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from torch import nn

from ..config import Config, SummaryConfig, load_config
from ..errors import ConfigError
from .configured import Data, Model, called, configured

if TYPE_CHECKING:
    from ..curvature import Factors
    from ..engine import CheckReport
    from ..training.run import Trained


def factors(
    model: Model,
    data: Data = None,
    *,
    out: str | Path,
    ekfac: bool = False,
    fisher: str = "true",
    config: Config | str | Path | None = None,
    trust_checkpoint: bool = False,
    **options: Any,
) -> Factors:
    """K-FAC (with ``ekfac``, EK-FAC) curvature factors of the model over its data, written to
    ``out``: ``gradscope factors``. ``precondition=`` takes the file or the factors returned.
    ``model``, ``data``, ``config`` and ``options`` as ``norms`` takes them; ``fisher``
    ``true`` or ``empirical``.

    Example:
        >>> import gradscope
        >>> made = gradscope.factors("configs/digits.yaml", limit=64, ekfac=True,
        ...                          out="factors.safetensors")
        >>> made.meta["examples"]
        64
        >>> gradscope.influence("configs/digits.yaml", ref="examples/digits/digits_ref.pt",
        ...                     limit=64, precondition=made).shape
        (64, 12)
    """
    from ..curvature import fit_factors

    with called(factors) as call:
        cfg = configured(call, model, data, config, **options)
        target = call.out(out, "factors.safetensors")
        return fit_factors(
            cfg, target, ekfac=ekfac, fisher=fisher, trust_checkpoint=trust_checkpoint
        )


def check(
    model: Model,
    data: Data = None,
    *,
    examples: int = 8,
    ref: Data = None,
    config: Config | str | Path | None = None,
    trust_checkpoint: bool = False,
    **options: Any,
) -> CheckReport:
    """Both engines against a per-example backward loop on the first ``examples`` rows (the
    influence check against ``ref``'s first rows, default the same rows): ``gradscope check``.
    The report's ``ok`` says whether every error is within tolerance; the command prints it
    with ``gradscope.engine.render_report``.

    Example:
        >>> import gradscope
        >>> gradscope.check("configs/digits.yaml", examples=4).ok
        True
    """
    from ..job import check_config

    with called(check) as call:
        cfg = configured(call, model, data, config, **options)
        spec = None if ref is None else call.spec(ref, "ref")
        return check_config(cfg, examples, ref=spec, trust_checkpoint=trust_checkpoint)


def write_report(
    scores: str | Path,
    *,
    config: Config | str | Path | None = None,
    out: str | Path | None = None,
    by: str | None = None,
    top_k: int | None = None,
) -> Path:
    """Write the HTML report of a scores file (default: beside it, ``.html``): ``gradscope
    report``. With ``config`` (the one that scored it) the top-k examples are shown; ``top_k``
    defaults to its ``summary.top_k``. Returns the page's path.

    Example:
        >>> import gradscope
        >>> _ = gradscope.norms("configs/digits.yaml", limit=64, out="report.parquet")
        >>> gradscope.write_report("report.parquet", config="configs/digits.yaml", top_k=5).name
        'report.html'
    """
    from ..report import write_report as written

    if not isinstance(scores, str | Path):  # a DataFrame the API returned: its file is needed
        raise ConfigError("write_report takes a scores file's path (out= of the call)", "scores")
    cfg = load_config(config) if isinstance(config, str | Path) else config
    top_k = (cfg.summary if cfg else SummaryConfig).top_k if top_k is None else top_k
    if top_k < 1:
        raise ConfigError(f"top_k must be at least 1, got {top_k}", "top_k")
    with called(write_report) as call:
        target = None if out is None else call.out(out, "report.html")
        return written(scores, target, cfg, by, top_k)


def train(
    config: Config | str | Path,
    data: Data = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    record: bool = False,
    segment: int | None = None,
    **options: Any,
) -> Trained:
    """Train the config's model by its ``train:`` recipe on ``data`` (default: ``data.path``)
    and write the checkpoint (``out``, default ``model.checkpoint``): ``gradscope train``.
    ``record`` also writes the run record beside it (``influence(through_training=...)``), a
    checkpoint every ``segment`` steps. Returns what it wrote (``path``, ``epochs``,
    ``record``) and the run's ``rows``, ``steps``, ``loss``.

    Example:
        >>> import gradscope
        >>> trained = gradscope.train("configs/digits.yaml", limit=64, out="retrained.pt")
        >>> trained.rows, trained.steps
        (64, 30)
    """
    from ..training.run import train_model

    with called(train) as call:
        cfg = configured(call, _config_only(config, "train"), data, **options)
        target = None if out is None else call.out(out, "model.pt")
        return train_model(
            cfg, target, resume=resume, overwrite=overwrite, record=record, segment=segment
        )


def validate(
    config: Config | str | Path,
    data: Data = None,
    *,
    ref: Data,
    scores: str | Path | list[str | Path],
    out: str | Path | None = None,
    truth: str | Path | None = None,
    **options: Any,
) -> pd.DataFrame:
    """Measure the score files ``scores`` (a path, or a list) against retraining by the
    config's ``train:`` recipe: LDS, the removal test, detection AUROC: ``gradscope validate``.
    Its options are keywords by name (``subsets``, ``fraction``, ``seeds``, ``target``,
    ``removal``, ``removal_refs``, ``bad``, ``columns``: ``--column`` repeated, a name or a
    list, ``jobs``, ``resume``, ``same_order``), beside the
    config's keys. Returns the table the command writes to ``out``; the retrained models are
    kept in ``truth`` (default beside ``out``), which later calls reuse.

    Example:
        >>> import gradscope
        >>> digits, ref = "configs/digits.yaml", "examples/digits/digits_ref.pt"
        >>> _ = gradscope.influence(digits, ref=ref, limit=64, curvature="none",
        ...                         out="influence.parquet")
        >>> table = gradscope.validate(digits, ref=ref, scores=["influence.parquet"], limit=64,
        ...                            subsets=2)
        >>> table.columns[:3].tolist()
        ['file', 'column', 'target']
    """
    from ..validation import Options
    from ..validation import validate as measured

    names = {f.name for f in dataclasses.fields(Options)}
    measures = {k: options.pop(k) for k in list(options) if k in names}
    measures["columns"] = tuple(_listed(measures.get("columns", ())))
    with called(validate, Options) as call:
        cfg = configured(call, _config_only(config, "validate"), data, **options)
        table = Path(call.out(out, "validation.parquet", bool(measures.get("resume"))))
        kept = None if truth is None else Path(call.out(truth, "truth.parquet"))
        listed = _listed(scores)
        if not all(isinstance(s, str | Path) for s in listed):  # a DataFrame the API returned
            raise ConfigError("validate takes score files' paths (out= of the calls)", "scores")
        files = [Path(call.spec(s)) for s in listed]
        measured(
            cfg, call.spec(ref, "ref"), files, options=Options(**measures), out=table, truth=kept
        )
        return pd.read_parquet(table)


def _listed(value: object) -> list:
    """A list of names given as one (``scores="influence.parquet"``, ``columns="influence"``)
    as a list of it, not of its characters."""
    return [value] if isinstance(value, str | Path) else list(value)


def _config_only(config: Config | str | Path, command: str) -> Config | str | Path:
    """A config: ``command`` builds the model afresh from ``model.factory``, not a module."""
    if isinstance(config, nn.Module):
        raise ConfigError(
            f"{command} builds and trains the model afresh from model.factory: pass a config",
            "config",
        )
    return config
