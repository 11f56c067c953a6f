"""Which damping the exact influence function wants: a small LDS on the bundled digits.

    python benchmarks/exact_damping.py [--subsets 40] [--kind gn|hessian] [--dampings 0.1,1,10]

The digits MLP (configs/digits.yaml, 8970 parameters) scores its 1500 training rows against each
of the 297 held-out digits (``--per-ref``) with the exact damped Gauss-Newton inverse (or
Hessian) at each damping (one fit, a Cholesky factor per damping), EK-FAC at a few, and the
plain inner product. Ground truth: ``--subsets`` random halves of the rows, each retrained once
with the config's recipe (``gradscope.training.fit``, seed = the subset's number); each
reference's loss under each. LDS: per reference, the Spearman correlation over the subsets of
the summed scores of the kept rows with minus its loss; the mean (and spread) over references.
One seed per subset: a noisier ground truth than the field's, fine for comparing dampings.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gradscope.config import load_config
from gradscope.curvature import compute_factors
from gradscope.curvature.factors import redamp
from gradscope.curvature.fitted import fit_exact
from gradscope.curvature.precondition import Curvature
from gradscope.engine import Influence, reference_gradients
from gradscope.errors import ConfigError
from gradscope.io.data import open_dataset
from gradscope.job import Job, config_loss
from gradscope.training.loop import fit

REF = "examples/digits/digits_ref.pt"


def scored(job: Job, dataset, refs: dict) -> np.ndarray:
    """(N, K) influence of every row against each reference direction."""
    influence = Influence(job.engine, refs, "hooks", norms=False)
    return np.concatenate(
        [influence(*job.to_device(b)).inner.numpy() for b in dataset.batches(256)]
    )


def all_scores(cfg, kind: str, dampings: list[float], ekfac: list[float]) -> dict:
    job = Job.from_config(cfg)
    dataset, ref = open_dataset(cfg.data), open_dataset(cfg.data, REF)
    methods = {}
    with job.engine:
        refs = reference_gradients(job.engine, (job.to_device(b) for b in ref.batches(256)), True)
        methods["none"] = scored(job, dataset, refs)
        start = time.perf_counter()
        batches = lambda: (job.to_device(b) for b in dataset.batches(cfg.data.batch_size))  # noqa: E731
        exact = fit_exact(job.engine, batches, kind, "dense", max(dampings))
        print(f"{kind} fit: {time.perf_counter() - start:.0f} s", flush=True)
        for d in dampings:
            try:
                methods[f"{kind} {d:g}"] = scored(job, dataset, exact.damped(d).refs(refs))
            except ConfigError as e:  # a Hessian indefinite under this damping
                print(f"{kind} {d:g}: {e}", flush=True)
        factors = compute_factors(job, ekfac=True)
        for d in ekfac:
            redamp(factors.blocks, d)
            methods[f"ekfac {d:g}"] = scored(job, dataset, Curvature(factors).refs(refs))
    return methods


def retrained_losses(cfg, subsets: int) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) masks of the kept rows and (M, K) the references' losses after retraining."""
    n = open_dataset(cfg.data).length
    data = torch.load(REF)
    loss, rng = config_loss(cfg), np.random.default_rng(0)
    masks, losses = np.zeros((subsets, n)), []
    for m in range(subsets):
        keep = np.sort(rng.choice(n, n // 2, replace=False))
        model = fit(cfg, keep, seed=m)
        with torch.no_grad():
            losses.append(loss(model(data["x"]), data["y"]).double().numpy())
        masks[m, keep] = 1
    return masks, np.stack(losses)


def lds(scores: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> tuple[float, float]:
    def centred_ranks(a: np.ndarray) -> np.ndarray:
        r = a.argsort(0).argsort(0).astype(float)
        return r - r.mean(0)

    a, b = centred_ranks(masks @ scores), centred_ranks(-losses)  # (M, K) each
    rho = (a * b).sum(0) / np.sqrt((a * a).sum(0) * (b * b).sum(0))
    return rho.mean(), rho.std()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsets", type=int, default=40)
    parser.add_argument("--kind", default="gn", choices=["gn", "hessian"])
    parser.add_argument("--dampings", default="0.01,0.03,0.1,0.3,1,3,10,30,100,300,1000")
    parser.add_argument("--ekfac", default="0.001,0.01,0.1,1,10")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/digits.yaml")
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    methods = all_scores(cfg, args.kind, floats(args.dampings), floats(args.ekfac))
    masks, losses = retrained_losses(cfg, args.subsets)
    print("| scores | LDS | spread over references |\n|---|---|---|")
    for name, s in methods.items():
        mean, spread = lds(s, masks, losses)
        print(f"| {name} | {mean:.3f} | {spread:.3f} |")


if __name__ == "__main__":
    main()
