"""The commands that score a dataset, as functions: ``norms``, ``influence``, ``index`` and
``query``. Each runs what its command runs (``score_dataset``, ``run_query``: the output locked,
checked against every input, written in parts) and returns the Parquet file's rows."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import Tensor

from ..config import Config
from ..defaults import CG_TOLERANCE
from ..index.query import Query, run_query
from ..index.scorer import IndexScorer, index_output
from ..io.held import unresumed
from ..run import score_dataset
from ..scorers import InfluenceScorer, NormsScorer, Scorer
from .configured import Data, Model, called, configured

if TYPE_CHECKING:
    from ..curvature import Factors


def norms(
    model: Model,
    data: Data = None,
    *,
    config: Config | str | Path | None = None,
    precondition: str | Path | Factors | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    trust_checkpoint: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Each example's loss and the L2 norm of its own loss gradient: ``gradscope norms``.

    ``model`` is an ``nn.Module`` (scored as it is, where it is) or a config naming one (a
    ``Config`` or a YAML file's path); ``data`` the rows, as a path, a dict of tensors, a torch
    ``Dataset``, a ``DataLoader`` (in its order, its ``batch_size``: no sampler, no drop_last), a
    pandas ``DataFrame`` or a ``datasets.Dataset``, by default the config's ``data.path``.
    ``config`` gives a module the rest of a config (loss, columns, parameters). ``options`` are
    the config's keys by name
    (all are listed on the Python API page): ``batch_size``, ``limit``, ``inputs``,
    ``targets``, ``ids``, ``loss``, ``include``, ``exclude``, ``per_layer``, ``device``,
    ``dtype``... Without a config, the input is column ``x`` (a tuple's first item), the target
    ``y``, the loss cross-entropy.

    Returns the columns the command writes (``reference/columns.md``); ``out`` also keeps the
    Parquet file (``resume`` continues an interrupted one: of a module, one of the same weights,
    which only a call with ``out`` hashes). ``precondition`` (a factors file, the factors
    ``factors`` returned, or an Adam state dict's file) adds ``self_influence``.

    Example:
        >>> import gradscope
        >>> scores = gradscope.norms("configs/digits.yaml", limit=64, out="scores.parquet")
        >>> len(scores), scores.columns[:3].tolist()
        (64, ['example_id', 'loss', 'grad_norm'])
    """
    with called(norms) as call:
        cfg = configured(call, model, data, config, **options)
        scorer = NormsScorer(trust_checkpoint, call.precondition(precondition, resume))
        return _scores(call, cfg, scorer, out, resume, trust_checkpoint)


def influence(
    model: Model,
    data: Data = None,
    *,
    ref: Data,
    per_ref: bool = False,
    matrix: bool = False,
    precondition: str | Path | Factors | None = None,
    engine: str = "auto",
    curvature: str | None = None,
    damping: float | None = None,
    solver: str = "auto",
    cg_tolerance: float = CG_TOLERANCE,
    through_training: str | Path | None = None,
    config: Config | str | Path | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    trust_checkpoint: bool = False,
    **options: Any,
) -> pd.DataFrame | Tensor:
    """Each example's loss gradient against the mean-loss gradient over ``ref`` (with
    ``per_ref``, against each of ``ref``'s rows): ``gradscope influence``.

    ``model``, ``data``, ``config`` and ``options`` as ``norms`` takes them; ``ref`` as ``data``.
    ``curvature`` (``none``, ``gn``, ``hessian``, ``kfac``, ``ekfac``; default ``auto``),
    ``damping``, ``solver``, ``cg_tolerance``, ``precondition`` (also the factors ``factors``
    returned) and ``engine`` as the command's options; ``through_training``, a run record
    (``train(record=True)``), scores by replaying that run backward instead
    (``--through-training``; ``limit`` and ``batch_size`` choose the rows scored, the replay
    trains on the run's). Returns the command's columns, or with ``matrix`` the
    (references, examples) float64 tensor of ``influence`` (one row without ``per_ref``).

    Example:
        >>> import gradscope
        >>> ref = "examples/digits/digits_ref.pt"
        >>> gradscope.influence("configs/digits.yaml", ref=ref, limit=64, curvature="none").shape
        (64, 12)
    """
    with called(influence) as call:
        cfg = configured(call, model, data, config, **options)
        if through_training is not None:
            from ..training.attribution import at_record, replayed, unread

            run = Path(through_training)
            trained = _as_trained(call, model, data, config, options, run)
            given = unread(
                curvature, precondition, damping, solver, cg_tolerance, engine, cli=False
            )
            scorer = replayed(trained, call.spec(ref, "ref"), run, per_ref, given, resume)
            resume = False  # the replay continued its own; the rows' file is written afresh
            cfg = at_record(cfg)
        else:
            scorer = InfluenceScorer(
                call.spec(ref, "ref"), per_ref=per_ref, engine=engine,
                precondition=call.precondition(precondition, resume),
                trust_checkpoint=trust_checkpoint, curvature=curvature, damping=damping,
                solver=solver, cg_tolerance=cg_tolerance,
            )  # fmt: skip
        scores = _scores(call, cfg, scorer, out, resume, trust_checkpoint)
    return references_by_examples(scores) if matrix else scores


def _as_trained(
    call, model: Model, data: Data, config: Config | str | Path | None, options: dict, run: Path
) -> Config:
    """The config a through-training replay trains by: as the run trained, the rows that
    ``limit`` and ``batch_size`` choose to score aside (``as_recorded``)."""
    from ..training.attribution import as_recorded

    scored = {"limit", "batch_size"} & set(options)
    trained = {k: v for k, v in options.items() if k not in scored}
    return as_recorded(configured(call, model, data, config, **trained), run, scored)


def references_by_examples(scores: pd.DataFrame) -> Tensor:
    """(R, N) float64: an influence file's ``influence`` with one row per ``ref_id`` (one row
    for the mean reference), one column per example in ``example_id`` order; what
    ``influence(matrix=True)`` returns.

    Example:
        >>> import gradscope
        >>> scores = gradscope.influence("configs/digits.yaml", limit=64, curvature="none",
        ...                              ref="examples/digits/digits_ref.pt", per_ref=True)
        >>> gradscope.references_by_examples(scores).shape
        torch.Size([297, 64])
    """
    if "ref_id" not in scores:
        scores = scores.assign(ref_id=0)
    table = scores.pivot(index="ref_id", columns="example_id", values="influence")
    return torch.tensor(table.sort_index().sort_index(axis=1).to_numpy(dtype="float64"))


def build_index(
    model: Model,
    data: Data = None,
    *,
    out: str | Path,
    dim: int | None = None,
    seed: int = 0,
    storage: str = "float16",
    config: Config | str | Path | None = None,
    resume: bool = False,
    trust_checkpoint: bool = False,
    **options: Any,
) -> Path:
    """Write each example's projected gradient to the index folder ``out``, to ``query`` many
    times: ``gradscope index``. ``model``, ``data``, ``config`` and ``options`` as ``norms``
    takes them; ``dim``, ``seed`` and ``storage`` as the command's options. Returns ``out``.

    Example:
        >>> import gradscope
        >>> gradscope.build_index("configs/digits.yaml", limit=64, out="digits.index").name
        'digits.index'
    """
    with called(build_index) as call:
        cfg = index_output(configured(call, model, data, config, **options), str(out))
        scorer = IndexScorer(dim, seed, storage)
        return score_dataset(cfg, scorer, trust_checkpoint=trust_checkpoint, resume=resume)


def query(
    index: str | Path,
    model: Model,
    data: Data = None,
    *,
    ref: Data,
    per_ref: bool = False,
    top_k: int | None = None,
    exact: bool = False,
    candidates: int | None = None,
    normalize: bool = False,
    precondition: str | Path | Factors | None = None,
    config: Config | str | Path | None = None,
    out: str | Path | None = None,
    trust_checkpoint: bool = False,
    **options: Any,
) -> pd.DataFrame:
    """Score every indexed example against ``ref``'s gradients (their mean, or each row's with
    ``per_ref``): ``gradscope query``. ``model`` (and ``config``, ``options``) must be what the
    index was built with; ``data`` its rows (with a module, which has no config to name them),
    read again only by ``exact``. Returns the command's columns: ``example_id``, ``id``,
    ``score``, or with ``per_ref``, ``top_k`` or ``exact`` each reference's top k (``ref_id``,
    ``rank``, ...).

    Example:
        >>> import gradscope
        >>> index = gradscope.build_index("configs/digits.yaml", limit=64, out="query.index")
        >>> gradscope.query(index, "configs/digits.yaml", ref="examples/digits/digits_ref.pt",
        ...                 per_ref=True, top_k=3).shape
        (891, 4)
    """
    with called(query) as call:
        cfg = configured(call, model, data, config, **options)
        spec = call.spec(ref, "ref")
        file = call.precondition(precondition, resume=False)
        asked = Query(
            spec, per_ref, top_k, exact, candidates, normalize,
            str(Path(file).resolve()) if file else None,
        )  # fmt: skip
        target = call.out(out, "query.parquet")
        path = run_query(index, asked, target, config=cfg, trust_checkpoint=trust_checkpoint)
        return pd.read_parquet(path)


def _scores(
    call, cfg: Config, scorer: Scorer, out: str | Path | None, resume: bool, trust: bool
) -> pd.DataFrame:
    """``scorer``'s run of ``cfg`` written to ``out`` (or a file of the call's), read back."""
    import dataclasses

    path = call.out(out, "scores.parquet", resume)
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=path))
    with unresumed() if out is None else contextlib.nullcontext():  # no model hashed for it
        return pd.read_parquet(score_dataset(cfg, scorer, trust_checkpoint=trust, resume=resume))
