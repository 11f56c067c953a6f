"""The ``influence`` command's scorer: each example's gradient against a reference gradient."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .. import distributed
from ..config import Config
from ..curvature.factors import KFAC
from ..curvature.fitted import (
    NONE,
    check_curvature,
    fit_curvature,
    resolve_curvature,
    resolve_damping,
)
from ..defaults import CG_TOLERANCE
from ..engine import MAX_PER_REF, BatchInfluence, Influence, check_engine, reference_gradients
from ..errors import ConfigError, DataError, check_file, reading
from ..inputs import data_inputs
from ..io.data import Batch, Dataset, code_rows_sha256, data_identity, open_dataset
from ..io.files import file_sha256
from ..io.held import is_held
from ..job import Job
from ..losses import nothing_counted
from .base import Inputs, Scorer, all_finite, counted, leading, leading_names, trailing_names


class InfluenceScorer(Scorer):
    """``<grad l_i, g_ref>`` at each checkpoint, weighted and summed (TracIn), with loss, grad_norm
    and cosine; one row per (example, reference example) pair with ``per_ref``.

    The models it builds for earlier checkpoints stay prepared (eval mode, gradients on) until
    the scorer exits. The references are computed in ``setup``.
    """

    command = "influence"

    def __init__(
        self,
        ref: str | Path,
        *,
        per_ref: bool = False,
        precondition: str | Path | None = None,
        engine: str = "auto",
        trust_checkpoint: bool = False,
        curvature: str | None = None,
        damping: float | None = None,
        solver: str = "auto",
        cg_tolerance: float = CG_TOLERANCE,
    ):
        super().__init__()
        check_curvature(curvature, solver, damping, precondition, cg_tolerance)
        self.curvature_given = curvature is not None
        self.curvature = resolve_curvature(curvature, precondition)
        self.damping, self.solver = resolve_damping(self.curvature, damping), solver
        self.cg_tolerance = cg_tolerance
        if precondition is not None:
            check_file(precondition, "preconditioner file", ConfigError)
        ref = str(ref)  # a path relative to the working directory, or file.py:make_dataset
        self.ref = ref if ".py:" in ref or is_held(ref) else str(Path(ref).resolve())
        self.precondition = str(Path(precondition).resolve()) if precondition else None
        self.per_ref, self.engine = per_ref, check_engine(engine)
        self.trust_checkpoint = trust_checkpoint
        self._scorers: list[Influence] = []
        self._weights: Tensor | None = None  # (C,) one per checkpoint
        self._ref_sq: Tensor | None = None  # (K,) sum_c w_c ||r_ck||^2
        self._described: dict = {}
        self._precondition_kind: dict = {}
        self._curvatures: list[dict] = []  # per checkpoint: what --curvature fitted

    def reads(self) -> Inputs:
        files = data_inputs("--ref", self.ref)
        return files + ([("--precondition", self.precondition)] if self.precondition else [])

    def resume_key(self, cfg: Config) -> dict:
        curvature = {"curvature": self.curvature, "damping": self.damping, "solver": self.solver,
                     "cg_tolerance": self.cg_tolerance}  # fmt: skip
        ref = {"ref": self.ref, "ref made by code": code_rows_sha256(cfg.data, self.ref)}
        return ref | {"per_ref": self.per_ref, "engine": self.engine} | curvature

    def names(self, cfg: Config) -> list[str]:
        names = [*leading_names(cfg), *(["ref_id"] if self.per_ref else []), "loss", "grad_norm"]
        if len(cfg.model.checkpoints) > 1:
            for k in range(len(cfg.model.checkpoints)):
                names += [f"loss@{k}", f"grad_norm@{k}"]
        return [*names, "influence", "cosine", *trailing_names(cfg)]

    def setup(self, job: Job) -> None:
        """Read REF and compute the reference gradients (under torchrun: on rank 0, then shared)."""
        # REF is read with the same input and target names; its rows need no ids
        ref_data = open_dataset(
            dataclasses.replace(job.cfg.data, ids=None, limit=None), self.ref, "--ref"
        )
        if self.per_ref and len(ref_data) > MAX_PER_REF:
            raise DataError(
                f"--per-ref writes one row per (example, reference) pair and takes at most "
                f"{MAX_PER_REF} reference examples; REF has {len(ref_data)}",
                self.ref,
            )
        checkpoints = job.cfg.model.checkpoints
        jobs = [job.at_checkpoint(c.path, self.trust_checkpoint) for c in checkpoints[:-1]]
        for other in jobs:
            self.stack.enter_context(other.engine)
        jobs.append(job)  # the job's own model is at the last checkpoint
        weights = [c.weight for c in checkpoints] or [1.0]
        paths = [c.path for c in checkpoints] or [job.cfg.model.checkpoint]
        for j in jobs:
            self._scorers.append(self._at_checkpoint(j, ref_data, j is job))
        self._weights = torch.tensor(weights, dtype=torch.float64)
        self._ref_sq = sum(
            w * s.ref_norm.pow(2) for w, s in zip(weights, self._scorers, strict=True)
        ).cpu()
        self._describe(data_identity(job.cfg.data, self.ref), len(ref_data), paths, weights)

    def _at_checkpoint(self, job: Job, ref_data: Dataset, last: bool) -> Influence:
        """The reference gradients at one checkpoint, and the engine scoring against them.
        A factors file must come from the last checkpoint's weights; every checkpoint uses it."""
        batches = _each_counts(job, ref_data.batches(job.cfg.data.batch_size), self.ref)
        if job.sharded:
            return self._sharded(job, batches)
        main = distributed.world().main
        # the plain inner product, or K-FAC's (``(S+d)^-1 u (A+d)^-1 v`` stays factored), of one
        # process: a weight's references kept as their factors where that costs less; another
        # curvature, a preconditioner file and the broadcast take them formed
        plain = self.curvature in (NONE, KFAC) and not self.precondition
        factored = plain and distributed.world().size == 1
        with reading(f"--ref {self.ref}"):
            refs = (
                reference_gradients(job.engine, batches, self.per_ref, factored) if main else None
            )
        if main and self.curvature != NONE:  # fitted over the data, once, on rank 0
            fitted = fit_curvature(
                job, self.curvature, self.solver, self.damping, self.cg_tolerance
            )
            refs = fitted.refs(refs)
            self._curvatures.append(fitted.describe())
        refs = distributed.broadcast_tensors(refs, job.device)
        if self.precondition:
            from ..curvature import load_preconditioner

            made = job.metadata("influence") if last else None  # (the last checks for all)
            pre = load_preconditioner(self.precondition, job.engine, made)
            refs = pre.refs(refs)
            self._precondition_kind = pre.describe()
        return Influence(job.engine, refs, self.engine, norms=True)

    def _sharded(self, job: Job, batches) -> Influence:
        """Under ``distributed.shard``: the reference gradient sharded like the parameters, each
        parameter's whole gathered as the backward reaches it; hooks only."""
        from .. import fsdp

        if not self.curvature_given:  # not a silently other scorer than one process's
            raise ConfigError(
                "with distributed.shard, influence scores the plain inner product only: pass "
                "--curvature none",
                "--curvature",
            )
        for option, given in (
            ("--per-ref", self.per_ref),
            ("--precondition", self.precondition is not None),
            ("--curvature", self.curvature != NONE),
            ("--engine jvp", self.engine == "jvp"),
        ):
            if given:
                raise ConfigError(f"{option} is not supported with distributed.shard", option)
        return Influence(job.engine, fsdp.reference_gradients(job.engine, batches), "hooks", True)

    def _describe(self, ref_sha256: str | None, refs: int, paths: list, weights: list) -> None:
        precondition = self.precondition
        self._described = {
            "ref": self.ref,
            "ref_sha256": ref_sha256,  # REF may be a folder, a glob, or made by code
            "ref_examples": refs,
            "per_ref": self.per_ref,
            "precondition": precondition
            and {"path": precondition, "sha256": file_sha256(precondition)}
            | self._precondition_kind,
            "engine": self.engine,
            "curvature": self.curvature,
            "damping": self.damping,
            "solver": self.solver,
            "curvatures": self._curvatures,
            "checkpoints": [
                {
                    "index": n,
                    "path": path,
                    "weight": w,
                    "ref_grad_norm": None if self.per_ref else s.ref_norm.item(),
                }
                for n, (path, w, s) in enumerate(zip(paths, weights, self._scorers, strict=True))
            ],
        }

    def metadata(self) -> dict:
        """What was computed, with the engine each checkpoint ended up using and why."""
        used = [s.method for s in self._scorers]
        notes = [s.note for s in self._scorers if s.note]
        return {"influence": self._described | {"engines_used": used, "notes": notes}}

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        inputs, targets = job.to_device(batch)
        results = [s(inputs, targets) for s in self._scorers]
        losses = counted(job, batch, [r.loss for r in results])
        return self.table(
            batch, [dataclasses.replace(r, loss=x) for r, x in zip(results, losses, strict=True)]
        )

    def table(self, batch: Batch, results: list[BatchInfluence]) -> dict[str, np.ndarray]:
        """The rows of one batch in column order, one per (example, reference) pair."""
        w = self._weights
        influence = sum(wc * r.inner.cpu() for wc, r in zip(w, results, strict=True))  # (B, K)
        norm_sq = sum(wc * r.norm_sq.cpu() for wc, r in zip(w, results, strict=True))  # (B,)
        # cosine in the space of all checkpoints' gradients each scaled by sqrt(weight)
        cosine = influence / (norm_sq[:, None] * self._ref_sq[None]).sqrt()
        b, k = influence.shape

        def rows(values: Tensor | np.ndarray) -> np.ndarray:  # one per (example, ref) pair
            array = values.numpy() if isinstance(values, Tensor) else values
            return np.repeat(array, k, axis=0)

        columns = {name: rows(v) for name, v in leading(batch).items()}
        if self.per_ref:
            columns["ref_id"] = np.tile(np.arange(k, dtype=np.int64), b)
        last = results[-1]
        columns["loss"] = rows(last.loss.cpu())
        columns["grad_norm"] = rows(last.norm_sq.cpu().sqrt())
        if len(results) > 1:
            for n, r in enumerate(results):
                columns[f"loss@{n}"] = rows(r.loss.cpu())
                columns[f"grad_norm@{n}"] = rows(r.norm_sq.cpu().sqrt())
        columns["influence"] = influence.flatten().numpy()
        columns["cosine"] = cosine.flatten().numpy()
        if batch.targets.dim() == 1:
            columns["target"] = rows(batch.targets)
        columns |= {name: rows(t.cpu()) for name, t in last.observed.items()}
        finite = all_finite(*(v for r in results for v in (r.loss, r.norm_sq)))  # (B,)
        columns["finite"] = (finite[:, None] & torch.isfinite(influence)).flatten().numpy()
        return columns


def _each_counts(job: Job, batches, ref: str):
    """Each REF batch on the device, every row of it counting a target: a row of none (every
    target ``ignore_index``, a one-token row under causal_lm) has no loss, which counted in the
    mean's denominator scaled every score by what it left out, and gave its --per-ref pairs 0."""
    first, loss = 0, job.cfg.loss
    for batch in batches:
        inputs, targets = job.to_device(batch)
        empty = nothing_counted(loss.name, loss.kwargs, targets)
        if empty is not None and bool(empty.any()):
            row = first + int(empty.nonzero()[0])
            raise DataError(
                f"the reference's row {row} has no target to predict (each is ignore_index): it "
                "has no loss, where the mean over REF would count it (and --per-ref score its "
                "pairs 0); leave it out",
                f"--ref {ref}",
            )
        first += len(targets)
        yield inputs, targets
