"""The exact damped influence function of a setting on its first K references at many dampings
and tolerances from one conjugate-gradient run, and its LDS on the setting's halves truth beside
the LDS of a score file's on the same references: where the benchmark's CG rows (an hour of CPU
each on the LM) should look, at the cost of one.

    PYTHONPATH=. python benchmarks/attribution/cg_probe.py lm --refs 8 \\
        --dampings 30 100 300 1000 --tolerances 0.1 0.01 0.001 \\
        --against benchmarks/attribution/runs/lm/default.parquet

Run after ``run.py`` has trained the setting and built its truth (``--keep-truth`` folders).
The Krylov space of ``C + lambda I`` is that of C for every lambda, so one CG at the smallest
damping carries the others (multi-shift CG, Jegerlehner 1996: each shifted residual is a
multiple ``zeta`` of the base's); each (damping, tolerance) is kept at the iterate where each
reference's shifted relative residual first falls to the tolerance, as ``--cg-tolerance`` stops.
The products, the references' gradients and the mean eigenvalue (so lambda) are gradscope's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import SETTINGS  # noqa: E402

from gradscope.config import load_config  # noqa: E402
from gradscope.curvature.cg import mean_eigenvalue  # noqa: E402
from gradscope.curvature.products import Products  # noqa: E402
from gradscope.engine import reference_gradients  # noqa: E402
from gradscope.io.data import open_dataset  # noqa: E402
from gradscope.job import Job  # noqa: E402
from gradscope.validation.metrics import spearman  # noqa: E402

Report = Callable[[float, float, int, Tensor], None]


def multishift(matvec, b: Tensor, shifts: list[float], tolerances: list[float], report: Report):
    """CG on ``matvec`` (the base, (P, J) -> (P, J)) for the (P, K) ``b``, carrying
    ``(base + s I) x = b`` for each shift s >= 0; ``report(shift, tolerance, iteration, x)``
    once every reference's shifted relative residual has fallen to the tolerance."""
    one = torch.ones(b.shape[1], dtype=b.dtype)
    r, p, rs, norm = b.clone(), b.clone(), b.square().sum(0), b.norm(dim=0)  # (P, K) .. (K,)
    alpha_before, beta_before = one.clone(), one * 0
    zeta = {s: (one.clone(), one.clone()) for s in shifts}  # (now, before)
    x, ps = {s: torch.zeros_like(b) for s in shifts}, {s: b.clone() for s in shifts}
    kept = {(s, t): torch.zeros_like(b) for s in shifts for t in tolerances}
    done = {(s, t): torch.zeros(b.shape[1], dtype=torch.bool) for s in shifts for t in tolerances}
    iteration = 0
    while True:
        for (s, t), reached in done.items():
            new = (zeta[s][0].abs() * rs.sqrt() / norm <= t) & ~reached
            kept[s, t][:, new] = x[s][:, new]
            if new.any() and (reached | new).all():
                report(s, t, iteration, kept[s, t])
            reached |= new
        if all(d.all() for d in done.values()):
            return
        ap = matvec(p)
        alpha = rs / (p * ap).sum(0)  # (K,)
        for s in shifts:
            z, before = zeta[s]
            after = (
                z
                * before
                * alpha_before
                / (alpha * beta_before * (before - z) + before * alpha_before * (1 + s * alpha))
            )
            x[s] += alpha * after / z * ps[s]
            zeta[s] = after, z
        r -= alpha * ap
        new = r.square().sum(0)
        beta, rs = new / rs, new
        for s in shifts:
            ps[s] = zeta[s][0] * r + beta * (zeta[s][0] / zeta[s][1]).square() * ps[s]
        p = r + beta * p
        alpha_before, beta_before, iteration = alpha, beta, iteration + 1


def truth(path: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The halves: (M, N) masks of the rows each subset kept, (M, R) references' loss, the mean
    over the seeds."""
    table = pq.read_table(path).to_pandas()
    table = table[table["kind"] == "subset"]
    masks = np.zeros((table["subset"].max() + 1, rows))
    losses = np.zeros((len(masks), len(table["loss"].iloc[0])))
    for m, group in table.groupby("subset"):
        masks[m, group["rows"].iloc[0]] = 1
        losses[m] = np.stack(group["loss"].to_numpy()).mean(0)
    return masks, losses


def lds(scores: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """(N, R) scores -> (R,) Spearman of each reference's loss with minus its kept rows' sum."""
    return spearman(losses[:, : scores.shape[1]].T, -(masks @ scores).T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=list(SETTINGS))
    parser.add_argument("--refs", type=int, default=8, help="the first K references")
    parser.add_argument("--dampings", type=float, nargs="+", required=True)
    parser.add_argument("--tolerances", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--against", type=Path, help="a per-ref score file to compare")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = SETTINGS[args.setting]
    cfg = load_config(bench.config)
    work = Path(cfg.model.checkpoint).parent
    cfg = load_config(work / "config.yaml")
    data = open_dataset(cfg.data)
    ref = open_dataset(dataclasses.replace(cfg.data, ids=None, limit=None), str(bench.ref), "ref")
    masks, losses = truth(work / "truth-halves.parquet", len(data))
    if args.against:
        frame = pd.read_parquet(args.against)
        other = lds(frame.pivot(index="example_id", columns="ref_id", values="influence")
                    .sort_index().to_numpy(), masks, losses)  # fmt: skip
        print(f"{args.against}: LDS {np.nanmean(other):.4f}, on the first {args.refs} "
              f"references {np.nanmean(other[: args.refs]):.4f}", flush=True)  # fmt: skip
    job = Job.from_config(cfg)

    def batches():
        for batch in data.batches(cfg.data.batch_size, cfg.data.limit):
            yield job.to_device(batch)

    with job.engine:
        products = Products(job.engine, batches, "gn")
        gradients = reference_gradients(job.engine, (job.to_device(b) for b in ref.batches(64)), True)  # fmt: skip
        b = products.flat.flatten(gradients)[: args.refs].T.contiguous()  # (P, K)
        rows = products.flat.flatten(reference_gradients(job.engine, batches(), True))  # (N, P)
        mean = mean_eigenvalue(products)
        base = min(args.dampings) * mean
        start = time.process_time()

        def report(shift: float, tolerance: float, iteration: int, x: Tensor) -> None:
            damping = (shift + base) / mean
            found = lds((rows @ x).numpy(), masks, losses)
            print(f"damping {damping:g} tolerance {tolerance:g}: {iteration} iterations, LDS on "
                  f"the first {args.refs} references {np.nanmean(found):.4f} "
                  f"({time.process_time() - start:.0f} s of CPU)", flush=True)  # fmt: skip

        shifts = [d * mean - base for d in args.dampings]
        multishift(lambda v: products(v) + base * v, b, shifts, args.tolerances, report)


if __name__ == "__main__":
    main()
