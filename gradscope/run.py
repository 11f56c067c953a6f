"""One scoring run: its output locked and kept off its inputs, its batches scored into the
partial folder (``resume.py``: the fingerprint and the parts) and assembled."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from . import distributed
from .config import Config
from .errors import Interrupted
from .inputs import minimal, run_inputs
from .io.data import Batch, made_by_code, open_dataset
from .io.lock import OutputLock
from .io.parquet import PartialRun, partial_path, saved_rows
from .job import Job, resolve_device
from .outliers import Spread, check_named, class_z, default_score, is_labels
from .resume import Parts, fingerprint, resumed_parts
from .scorers import NormsScorer, Scorer


def _length(dataset, limit: int | None) -> int | None:
    """Rows the dataset holds up to ``limit``; None when unknown (a stream)."""
    length = dataset.length
    return length if length is None or limit is None else min(length, limit)


def _metadata(cfg: Config, job: Job, scorer: Scorer, seconds: float) -> dict:
    """The file's metadata: the job's and the scorer's, and ``seconds``: this process's run and
    the scorer's work before it."""
    metadata = job.metadata(scorer.command) | scorer.metadata()
    metadata["seconds"] = round(seconds + scorer.seconds_before, 3)
    return minimal(metadata) if cfg.output.metadata == "minimal" else metadata


def _interrupted(path: str) -> None:
    """Ctrl-C outside a batch: ``Interrupted`` when batches are saved for ``--resume``."""
    partial = partial_path(path)
    saved = saved_rows(partial)
    if saved:
        raise Interrupted(
            f"interrupted with {saved} examples saved; run the same command with --resume to "
            "continue",
            str(partial),
        ) from None


def score_dataset(
    cfg: Config,
    scorer: Scorer | None = None,
    *,
    trust_checkpoint: bool = False,
    resume: bool = False,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path | None:
    """Score every example of ``cfg``'s dataset with ``scorer`` (norms by default) and write the
    Parquet file at ``output.path``.

    Before anything runs, the output is checked against every input and locked. Each batch's rows
    become a part file in the partial folder as soon as they are scored (see ``io/parquet.py``);
    with ``resume`` the parts of an interrupted run with the same fingerprint are kept and only
    the missing batches are scored. Under torchrun, rank r scores batches r, r + K, ... and rank 0
    assembles the file with the metadata as it stands after the last batch; other ranks return
    None. The first batch runs before anything is written, so input the model cannot take leaves
    no file. ``on_start`` gets the number of rows this process scores, None when unknown.
    """
    started = time.perf_counter()
    scorer = scorer or NormsScorer(trust_checkpoint)
    inputs = run_inputs(cfg, scorer.reads())
    scorer.check_output(cfg.output.path, inputs)
    with (
        distributed.session(cfg.distributed.join_timeout) as world,
        contextlib.ExitStack() as stack,
    ):
        if world.main:
            stack.enter_context(OutputLock(cfg.output.path))
        try:
            device = world.device(cfg.device)
            kind = resolve_device(device).type
            key = fingerprint(cfg, scorer.command, inputs, scorer.resume_key(cfg), kind)
            run = scorer.partial(cfg.output.path, key)
            run.refuse_foreign()  # before the model is built
            done = resumed_parts(run, key) if resume else None
            parts = Parts(run, world, key, done, hashed=made_by_code(cfg.data.path))
            job = Job.from_config(dataclasses.replace(cfg, device=device), trust_checkpoint)
            dataset = open_dataset(cfg.data)
            if on_start:
                on_start(world.rows(_length(dataset, cfg.data.limit), cfg.data.batch_size))
            if cfg.distributed.shard and world.size > 1:  # one process has nothing to shard over
                job.shard(next(iter(dataset.batches(cfg.data.batch_size, cfg.data.limit))))
            stack.enter_context(scorer)
            stack.enter_context(job.engine)
            scorer.setup(job)
            batches = dataset.batches(cfg.data.batch_size, cfg.data.limit)
            with dataset.columns.naming():  # the model cannot take them: which columns
                count = _score(parts, job, scorer, batches, on_batch)
            distributed.barrier()  # every rank's parts are written
            if not world.main:
                return None
            metadata = _metadata(cfg, job, scorer, time.perf_counter() - started)
            return run.assemble(count, metadata, lambda: _standardised(run, count))
        except KeyboardInterrupt:  # (or SIGTERM) outside a batch: hashing, loading, assembling
            _interrupted(cfg.output.path)
            raise  # nothing saved: the CLI says so


def _standardised(run: PartialRun, parts: int) -> dict[str, np.ndarray]:
    """``robust_z``, the robust z of the score the file ranks by over the finite rows, and
    ``class_z``, the same within each target class when the targets are class labels."""
    score = default_score(run.names())
    values = run.column(score, parts).astype(np.float64)
    ok = np.isfinite(values) & run.column("finite", parts)
    robust = np.where(ok, Spread.of(values[ok]).z(values), np.nan)
    target = run.column("target", parts)
    if not is_labels(target):
        return {"robust_z": robust}
    return {"robust_z": robust, "class_z": class_z(values, ok, target)}


def _class_ids(columns: dict) -> dict[str, np.ndarray]:
    """A batch's columns of class ids (``target``, ``pred``), where they hold integers."""
    return {
        n: np.asarray(columns[n])
        for n in ("target", "pred")
        if n in columns and np.asarray(columns[n]).dtype.kind in "iu"
    }


def _score(
    parts: Parts,
    job: Job,
    scorer: Scorer,
    batches: Iterable[Batch],
    on_batch: Callable[[int], None] | None,
) -> int:
    """Score this rank's batches that no part holds yet; the number of batches in the dataset.

    The ranks of a sharded model run their passes together: each runs one per round of
    ``size`` batches, scoring a batch that a part already holds again, and a rank left without
    a batch in the last round its first batch, each result dropped."""
    rows, number, first, passes = 0, -1, None, 0
    if job.sharded:
        parts.begin()  # now: no rank may wait at its barrier while another is in a pass
    try:
        for number, batch in enumerate(batches):
            first = batch if first is None else first
            if not parts.world.owns(number):
                continue
            if parts.wanted(number):
                columns = scorer.columns(job, batch)
                check_named(job.cfg.data.classes, _class_ids(columns), "data.classes")
                parts.write(number, columns, batch)
            else:
                parts.check(number, batch)
                if job.sharded:
                    scorer.columns(job, batch)
            passes += 1
            rows += len(batch)
            if on_batch:
                on_batch(len(batch))
        rounds = -(-(number + 1) // parts.world.size)
        for _ in range(rounds - passes if job.sharded else 0):
            scorer.columns(job, first)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted with {rows} examples saved; run the same command with --resume "
            "to continue",
            str(parts.run.dir),
        ) from None
    parts.begin()  # a rank with no batch of its own still meets the others
    return number + 1
