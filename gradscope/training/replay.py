"""Attribution through training: the reverse replay of a recorded run. Each training row's score
is -d f(theta_T) / d w_i at w = 1, f the mean loss over the references (or each one's loss),
w_i the weight of row i in every batch that holds it: positive where up-weighting the row lowers
the reference loss, as ``influence`` signs its scores.

The walk goes segment by segment, last first: a segment's weights and optimizer states are
recomputed from its checkpoint (one segment in memory), checked against where the run went, then
its steps are walked backward carrying the adjoints (``adjoint.py``). After each segment the
adjoints and scores so far are saved, so that a killed replay continues from there."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..config import Config
from ..errors import DataError, Interrupted, ModelError
from ..io.atomic import replace_atomically
from ..job import config_forward, config_loss, resolve_device
from .adjoint import Called, Problem
from .loop import TrainingRows
from .record import Record, open_record, rng, set_rng
from .references import reference_gradients
from .steps import Tensors

ADJOINTS = "adjoints.pt"
# R references' double backward: one vmapped call up to this many trained weights, one call per
# reference above (measured: vmap 4-6x faster at 5K weights, the loop 2x faster at 1.1M)
VMAP_WEIGHTS = 250_000
# a segment recomputed may end this far from the run's weights: this share of what its steps
# moved them, plus this many ulps of the largest per step (``_check_end``)
MOVED, ULPS = 0.01, 4


def through_training(
    cfg: Config,
    run: str | Path,
    ref: str | Path,
    *,
    per_ref: bool = False,
    partial: str | Path | None = None,
    on_start: Callable[[int], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Each training row's score through the run recorded in ``run`` (``gradscope train
    --record``, or a watched loop's ``record=``) for the references in the data file ``ref``:
    (N,) against their mean loss, or (N, R) against each one's with ``per_ref``, N the rows
    ``cfg`` trains on, in their order.

    ``partial``: a folder where the adjoints are saved after each segment; a replay of the same
    record and references finds them there and continues. ``on_start`` gets the number of steps
    to walk back, ``on_step`` each step walked. The caller's random state is left as it was.
    """
    record = open_record(run, cfg)
    device = resolve_device(cfg.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        rows = TrainingRows(cfg, None)
        record.check_rows(rows, cfg.data)
        model = record.start_model(cfg)
        called = Called(model, config_forward(cfg))
        names = [f"model.{n}" for n, p in model.named_parameters() if p.requires_grad]
        tokens = (cfg.loss.name, cfg.loss.kwargs.get("ignore_index", -100))
        problem = Problem(called, names, rows, config_loss(cfg), record.update, record.clip,
                          tokens if record.meta.get("tokens") else None)  # fmt: skip
        replay = _Replay(problem, record, on_step)
        final = [p.to(rows.device) for p in record.final()]
        refs = reference_gradients(cfg, problem, final, str(ref), per_ref)
        # the references by their gradients: a .py:fn's data has no hash, and may change
        key = {"record": record.sha256(), "ref": _digest(refs), "per_ref": per_ref}
        saved = (_resumed(Path(partial), key) if partial else None) or _start(record, refs)
        if on_start:
            on_start(record.meta["steps"])
        if on_step and saved["next"] < record.segments - 1:
            on_step(record.meta["steps"] - record.bounds(saved["next"] + 1)[0])
        scores = replay.walk(saved, Path(partial) if partial else None, key)
    scores = -scores.T.cpu().numpy()  # (N, R): -d f / d w, influence's sign
    return scores if per_ref else scores[:, 0]


def _digest(refs: Tensors) -> str:
    """The sha256 of the references' gradients, bit for bit."""
    h = hashlib.sha256()
    for g in refs:
        h.update(g.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _start(record: Record, refs: Tensors) -> dict:
    """The adjoints after the last step: the references' gradients, none on the optimizer."""
    first = record.checkpoint(record.segments - 1)
    state = [refs[0].new_zeros(refs[0].shape[0], *s.shape) for s in first["state"]]
    return {"next": record.segments - 1, "adjoints": refs + state, "scores": None}


class _Replay:
    """The walk back over a record's segments."""

    def __init__(self, problem: Problem, record: Record, on_step: Callable[[int], None] | None):
        self.problem, self.record, self.on_step = problem, record, on_step
        self.picked, self.lrs = record.steps(len(problem.rows))
        self.drawn = record.drawn()  # step -> its random state, where not the last's
        self.device = problem.rows.device
        trained = dict(problem.called.named_parameters())
        weights = sum(trained[name].numel() for name in problem.names)
        self.batched = weights <= VMAP_WEIGHTS  # R > 1: vmap the double backward (else a loop)

    def walk(self, saved: dict, partial: Path | None, key: dict) -> Tensor:
        """(R, N) d f / d w from segment ``saved["next"]`` down to the first, what is done
        saved in ``partial`` after each segment."""
        adjoints = [a.to(self.device) for a in saved["adjoints"]]
        r = adjoints[0].shape[0]
        scores = saved["scores"]
        if scores is None:
            scores = torch.zeros(r, len(self.problem.rows), dtype=torch.float64)
        for k in range(saved["next"], -1, -1):
            try:
                adjoints = self._segment(k, adjoints, scores)
            except KeyboardInterrupt:
                done = self.record.segments - 1 - k
                if partial is None or not done:
                    raise
                raise Interrupted(
                    f"interrupted with {done} of {self.record.segments} segments replayed; run "
                    "the same command again to continue from there",
                    str(partial),
                ) from None
            if partial is not None:
                saved = {"next": k - 1, "adjoints": [a.cpu() for a in adjoints], "scores": scores}
                _save(partial, key, saved)
        return scores

    def _segment(self, k: int, adjoints: Tensors, scores: Tensor) -> Tensors:
        """Segment ``k``: recomputed from its checkpoint, then walked back; ``scores`` (R, N)
        gains each of its steps' d f / d w."""
        trail, end = self._forward(k)
        first, last = self.record.bounds(k)
        for t in range(last - 1, first - 1, -1):
            at = trail[t - first]
            adjoints, dw, moved = self._reverse(at, t, adjoints)
            then = trail[t - first + 1][0] if t + 1 < last else end
            how = "the step recomputed on the walk back"
            _check_end(moved, at[0], then, (t, t + 1), self.record, how)
            scores.index_add_(1, self.picked[t], dw.detach().double().cpu())  # (R, B) into (R, N)
            if self.on_step:
                self.on_step(1)
        return adjoints

    def _reverse(self, at: tuple, t: int, adjoints: Tensors) -> tuple[Tensors, Tensor, Tensors]:
        """Step ``t`` in reverse, R references' double backward vmapped or one at a time as
        ``VMAP_WEIGHTS`` says, the same way every run: the scores' last bits never depend on
        the machine's load."""
        return self.problem.reverse(at, self.picked[t], self.lrs[t], t, adjoints, self.batched)

    def _forward(self, k: int) -> tuple[list[tuple[Tensors, Tensors, dict]], Tensors]:
        """The weights, optimizer state and random state at each step of segment ``k``,
        recomputed from its checkpoint, and the weights after its last step, checked against
        where the run went."""
        checkpoint = self.record.checkpoint(k)
        params = [p.to(self.device) for p in checkpoint["params"]]
        state = [s.to(self.device) for s in checkpoint["state"]]
        set_rng(checkpoint["rng"])
        self.problem.called.train()
        trail = []
        first, last = self.record.bounds(k)
        for t in range(first, last):
            if t in self.drawn:
                set_rng(self.drawn[t])
            trail.append((params, state, rng()))
            params, state = self.problem.forward(params, state, self.picked[t], self.lrs[t], t)
        end = self.record.final() if k == self.record.segments - 1 else None
        end = self.record.checkpoint(k + 1)["params"] if end is None else end
        _check_end(params, checkpoint["params"], end, (first, last), self.record)
        return trail, params


def _check_end(
    params: Tensors,
    start: Tensors,
    recorded: Tensors,
    steps: tuple[int, int],
    record: Record,
    how: str = "replaying the run from its checkpoint",
) -> None:
    """The weights recomputed over ``steps`` (first, one past the last) from ``start`` must be
    ``recorded``, the run's, to rounding: else the run drew randomness the record does not
    hold (numpy's, or a generator of the model's own, which the walk back finds moved on where
    one segment's replay did not), the model is not the one that trained (another forward over
    the same parameter names), or its steps are not the recipe's.

    Allowed: ``MOVED`` of what the steps moved the weights (max |recorded - start|) plus
    ``ULPS`` ulps of the largest weight per step, and never more than sqrt(eps) max(1, |w|),
    the bound before. A faithful replay on the CPU is the run bit for bit or off by rounding:
    over the tests, the digits example and watched loops, at most 1.8e-4 of the movement
    (float32 AdamW on a tiny GPT-2 under the HF Trainer: Adam's division by sqrt(v) makes the
    rounding in a near-zero gradient a difference in the step; 2.7e-6 for the digits MLP,
    2e-13 in float64); a replay of another model or of numpy's dropout, 0.4 to 1.5 of it,
    which sqrt(eps) |w| alone (3.4e-4 in float32) let through at lr 1e-4. The ulps are for
    steps that move the weights by no more than their rounding."""
    eps = torch.finfo(params[0].dtype).eps
    off, moved = _largest(params, recorded), _largest(recorded, start)
    scale = max(p.abs().max().item() for p in recorded)
    rounding = ULPS * eps * scale * (steps[1] - steps[0])
    allowed = min(MOVED * moved + rounding, eps**0.5 * max(1.0, scale))
    if not off <= allowed:
        k = steps[0] // record.meta["segment"]
        raise ModelError(
            f"{how} does not reach its weights after step {steps[1]}, in segment {k} (steps "
            f"{record.bounds(k)[0]} to {record.bounds(k)[1] - 1}): off by {off:.3g} where its "
            f"steps moved them by {moved:.3g}, a faithful replay within {allowed:.2g}; the model "
            "draws randomness the record does not hold (numpy's, Python's, a generator of its "
            "own), is not the model that trained, or was trained otherwise than its recipe says",
            str(record.folder),
        )


def _largest(a: Tensors, b: Tensors) -> float:
    """max |a - b| over every element of every tensor."""
    return max((p.cpu() - q.cpu()).abs().max().item() for p, q in zip(a, b, strict=True))


def _resumed(folder: Path, key: dict) -> dict | None:
    """What an interrupted replay of the same record and references saved; None when none did."""
    file = folder / ADJOINTS
    if not file.is_file():
        return None
    try:
        saved = torch.load(file, weights_only=True)
    except Exception as e:
        raise DataError(
            f"the interrupted replay's {ADJOINTS} does not read back ({type(e).__name__}); "
            "delete the folder to start over",
            str(folder),
        ) from e
    return saved if saved["key"] == key else None


def _save(folder: Path, key: dict, saved: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    replace_atomically(
        folder / ADJOINTS, lambda f: torch.save(saved | {"key": key}, f), "the adjoints"
    )
