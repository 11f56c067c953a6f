"""``validate``: retrain on random subsets (and with rows removed), then measure each score
file against what retraining shows; the work behind the command, callable from Python."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__, distributed
from ..config import Config
from ..errors import INDEX_FOLDER, ConfigError, DataError, Interrupted, check_file
from ..inputs import check_output, run_inputs
from ..io.atomic import replace_atomically
from ..io.data import data_identity, open_dataset
from ..io.lock import OutputLock
from ..io.parquet import METADATA_KEY
from ..predictions import predictions
from ..training import recipe
from .plan import FRACTION, SEEDS, SUBSETS, Design, removal_tasks, subset_tasks
from .results import Datamodel, detection, removal
from .retrain import check_ref, task_rows, train_missing
from .scores import RANKED, ScoreFile, read_scores
from .truth import Task, Truth, identity, read_truth


@dataclass(frozen=True)
class Options:
    """What to measure. ``subsets``, ``fraction`` and ``seeds`` left None take a reused truth
    file's, else the defaults (100 subsets of half the rows, one seed)."""

    subsets: int | None = None
    fraction: float | None = None
    seeds: int | None = None
    target: str = "loss"  # loss | margin
    removal: int | None = None  # K rows removed per reference; None: no removal test
    removal_refs: int = 10
    bad: str | None = None  # a data column marking known-bad rows: detection AUROC
    columns: tuple[str, ...] = ()  # the score columns whose LDS is measured; () influence
    jobs: int = 1
    resume: bool = False
    same_order: bool = False  # retrain in the full run's batches, left-out rows weighted 0


def check_options(cfg: Config, options: Options) -> None:
    """Refuse, before anything runs, options and configs validation cannot use."""
    o = options
    for name, value, least in (("--subsets", o.subsets, 2), ("--seeds", o.seeds, 1),
                               ("--removal", o.removal, 1), ("--removal-refs", o.removal_refs, 1),
                               ("--jobs", o.jobs, 1)):  # fmt: skip
        if value is not None and value < least:
            raise ConfigError(f"{name} must be at least {least}, got {value}", name)
    if o.fraction is not None and not 0 < o.fraction < 1:
        raise ConfigError(f"--fraction must lie in (0, 1), got {o.fraction:g}", "--fraction")
    if o.target not in ("loss", "margin"):
        raise ConfigError(f"--target must be loss or margin, got {o.target!r}", "--target")
    if recipe(cfg).fn is not None and o.same_order:  # no recipe: no validation
        raise ConfigError(
            "--same-order weighs the rows of the recipe's own loop; train.fn is given rows, "
            "not weights",
            "--same-order",
        )
    if o.target == "margin" and predictions(cfg.loss.name, cfg.loss.kwargs) is None:
        raise ConfigError(
            f"--target margin needs a classification loss (cross_entropy, nll, "
            f"bce_with_logits); loss.name is {cfg.loss.name}",
            "--target",
        )


def _design(options: Options, truth: Truth | None, path: Path, rows: int) -> Design:
    """The options' design, or the reused truth's where an option is left unset; an option that
    contradicts the truth, or subsets and removals that keep no row or every row, are refused."""
    asked = {"subsets": options.subsets, "fraction": options.fraction, "seeds": options.seeds}
    held = truth.design if truth and truth.models else {}
    for key, value in asked.items():
        if value is not None and key in held and held[key] != value:
            raise ConfigError(
                f"the truth file has {key} {held[key]}, --{key} asks {value}; leave it unset "
                "to use the truth's, or choose another --truth",
                str(path),
            )
    defaults = {"subsets": SUBSETS, "fraction": FRACTION, "seeds": SEEDS}
    pick = {k: v if v is not None else held.get(k, defaults[k]) for k, v in asked.items()}
    size = round(pick["fraction"] * rows)
    if not 0 < size < rows:
        raise ConfigError(
            f"--fraction {pick['fraction']:g} of the {rows} training rows keeps {size}; a subset "
            "must keep a row and leave one out",
            "--fraction",
        )
    if options.removal is not None and options.removal >= rows:
        raise ConfigError(
            f"--removal {options.removal} leaves none of the {rows} training rows", "--removal"
        )
    return Design(pick["subsets"], pick["fraction"], pick["seeds"])


def _files(
    cfg: Config, ref: str, paths: list[Path], options: Options, rows: int, refs: int
) -> tuple[list[ScoreFile], list[str]]:
    """The score files, each read and checked, and the columns whose LDS is measured."""
    for path in paths:
        check_file(path, "scores file", DataError, INDEX_FOLDER)
    wanted = list(options.columns) or ["influence"]
    reading = wanted + (list(RANKED) if options.bad else [])
    ref_sha, data_sha = data_identity(cfg.data, ref), data_identity(cfg.data)
    files = [read_scores(p, reading, rows, refs, ref_sha, data_sha) for p in paths]
    for file in files:
        missing = [c for c in wanted if c not in file.columns]
        if missing and (options.columns or not options.bad):
            raise ConfigError(
                f"the scores have no {missing[0]!r} column; --column names the one to validate",
                str(file.path),
            )
    return files, wanted


def _bad(cfg: Config, column: str, rows: int) -> np.ndarray:
    """(N,) the rows the data column ``column`` marks (nonzero, true)."""
    found = open_dataset(cfg.data).values_at(column, "--bad", set(range(rows)))
    try:
        bad = np.array([bool(found[i]) for i in range(rows)])
    except (RuntimeError, ValueError, TypeError) as e:  # a tensor or list of several values
        raise ConfigError(f"the --bad column {column!r} is not one value per row", "--bad") from e
    if bad.all() or not bad.any():
        raise ConfigError(
            f"the --bad column {column!r} marks {'every' if bad.any() else 'no'} training row; "
            "detection needs both kinds",
            "--bad",
        )
    return bad


def validate(
    cfg: Config,
    ref: str,
    scores: list[Path],
    *,
    options: Options = Options(),
    out: Path = Path("validation.parquet"),
    truth: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    on_model: Callable[[int], None] | None = None,
) -> pd.DataFrame | None:
    """Measure each score file against retraining: LDS per column (``options.columns``), the
    removal test (``options.removal``) and detection AUROC (``options.bad``); the table, also
    written to ``out`` (Parquet) and beside it as JSON (``.json``).

    Everything is checked before anything trains. The models retrained are kept in the truth
    file (default: ``OUT.truth.parquet`` beside ``out``), which later runs reuse and extend;
    ``on_start`` gets the number of models to train, ``on_model`` is called as each finishes.
    Under torchrun the ranks share the retraining; rank 0 returns the table, the others None.
    """
    check_options(cfg, options)
    rows, refs = _sizes(cfg, ref)
    check_ref(cfg, ref)
    bad = _bad(cfg, options.bad, rows) if options.bad else None
    files, wanted = _files(cfg, ref, scores, options, rows, refs)
    out = Path(out)
    truth = Path(truth) if truth else out.with_name(f"{out.stem}.truth.parquet")
    _check_outputs(cfg, ref, scores, out, truth)
    made = identity(cfg, ref, rows, options.same_order)
    held = read_truth(truth, made) if truth.is_file() else None
    design = _design(options, held, truth, rows)
    held = held or Truth(made, design.describe(rows), [])
    lds = subset_tasks(design, cfg.train.seed, rows, held)
    removals = _removals(files, wanted, options, cfg.train.seed, design.seeds, rows)
    tasks = lds + [t for more in removals.values() for t in more]
    with (
        distributed.session(cfg.distributed.join_timeout) as world,
        contextlib.ExitStack() as locks,
    ):
        if world.main:
            locks.enter_context(OutputLock(truth))
            locks.enter_context(OutputLock(out))
        held = train_missing(cfg, ref, tasks, held, truth, world, jobs=options.jobs,
                             same_order=options.same_order, resume=options.resume, on_start=on_start, on_model=on_model)  # fmt: skip
        if held is None:
            return None
        try:
            datamodel = Datamodel.of(held, lds, rows, options.target)
            table = _table(files, wanted, datamodel, held, removals, bad, options)
            _write(table, out, truth, design.describe(rows), options)
        except KeyboardInterrupt:  # not "before any example was saved": every model is
            raise Interrupted(
                "interrupted after the truth file was written, every model in it; run the same "
                "command again to measure from it",
                str(truth),
            ) from None
    return table


def _sizes(cfg: Config, ref: str) -> tuple[int, int]:
    """N, the training rows (``data.path`` up to ``data.limit``), and R, REF's rows."""
    return task_rows(cfg), len(
        open_dataset(dataclasses.replace(cfg.data, ids=None, limit=None), ref)
    )


def _removals(
    files: list[ScoreFile], wanted: list[str], options: Options, seed: int, seeds: int, rows: int
) -> dict[tuple[Path, str], list[Task]]:
    """The removal test's models for each (file, validated column), when it is asked for."""
    return {
        (file.path, column): removal_tasks(
            file, column, options.removal, options.removal_refs, seed, seeds, rows
        )
        for file in (files if options.removal else ())
        for column in wanted
        if column in file.columns
    }


def _check_outputs(cfg: Config, ref: str, scores: list[Path], out: Path, truth: Path) -> None:
    """The truth file, the table and its JSON: none an input, nor one another."""
    inputs = run_inputs(cfg, [("--ref", ref), *(("--scores", str(p)) for p in scores)])
    check_output(truth, inputs, option="--truth")
    if out.suffix == ".json":  # its table and the JSON beside it would be one file
        raise ConfigError(f"--out {out} is the JSON beside the table: name the .parquet", "--out")
    for path, kind in ((out, "validate"), (out.with_suffix(".json"), "json")):
        check_output(path, [*inputs, ("--truth", str(truth))], kind, option="--out")


def _table(
    files: list[ScoreFile],
    wanted: list[str],
    datamodel: Datamodel,
    truth: Truth,
    removals: dict[tuple[Path, str], list[Task]],
    bad: np.ndarray | None,
    options: Options,
) -> pd.DataFrame:
    """One row per (file, column): LDS (and removal) for the validated columns, AUROC for each
    column that ranks examples; ``seconds`` only where a file's metadata records it."""
    records = []
    timed = any(f.seconds is not None for f in files)
    detected = detection(files, bad) if bad is not None else [{} for _ in files]
    for file, found in zip(files, detected, strict=True):
        validated = [c for c in wanted if c in file.columns]
        for column in dict.fromkeys([*validated, *found]):
            row = {"file": str(file.path), "column": column}
            if column in validated:
                row["target"] = options.target
                row |= datamodel.lds(file.columns[column], options.target)
                if options.removal:
                    tasks = removals[file.path, column]
                    row |= removal(truth, tasks, file, options.removal_refs, options.target)
            if bad is not None:
                row["auroc"] = found.get(column, np.nan)
            if timed:
                row["seconds"] = file.seconds
            records.append(row)
    table = pd.DataFrame.from_records(records)
    if "references" in table:  # a count, missing on rows that only rank
        table["references"] = table["references"].astype("Int64")
    return table


def _write(table: pd.DataFrame, out: Path, truth: Path, design: dict, options: Options) -> None:
    """The table as Parquet at ``out`` (with a ``gradscope`` metadata key) and as JSON beside it."""
    meta = {
        "version": __version__,
        "command": "validate",
        "truth": str(truth.resolve()),
        "design": design,
        "options": dataclasses.asdict(options),
    }
    arrow = pa.Table.from_pandas(table, preserve_index=False)
    arrow = arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta, default=str)})
    replace_atomically(out, lambda f: pq.write_table(arrow, f), "the validation")
    records = arrow.to_pylist()  # every digit (pandas' JSON keeps 10, at most 15)
    records = [{k: None if v != v else v for k, v in row.items()} for row in records]  # NaN
    text = json.dumps({**meta, "results": records}, indent=2, default=str).encode()
    replace_atomically(out.with_suffix(".json"), lambda f: f.write(text), "the validation")
