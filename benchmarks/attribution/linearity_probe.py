"""Where a setting's through-training scores stop predicting its same-order truth: each removal of
1% of the rows retrained at weights 1 - eps for eps from small to 1 (the removal itself), in
float32 and float64, against the first-order prediction eps x the removed rows' summed score.

    PYTHONPATH=. python benchmarks/attribution/linearity_probe.py lm --refs 8 --subsets 20 \\
        --eps 1 0.1 0.01 0.001 --dtypes float64 [--set warmup=4 eps=1e-4]

For each dtype: ``gradscope train --record`` in that dtype, the per-reference replay of the
record (``influence --through-training``'s scores) on the first ``--refs`` references, and the
truth's own removals (the validate rule: ``--subsets`` of ``round(0.99 N)`` rows kept, every
row in the full run's batches and order, the left-out rows weighted 1 - eps). Printed per eps:
the LDS over these subsets and references (Spearman of the retrained change in each
reference's loss against the prediction), the median over (subset, reference) of the change
divided by its prediction (1 where the step is linear), and the relative error of the whole
(S, R) block. Also: the full run retrained twice (bitwise the same?), the recorded run's final
weights against the truth's full-weight retrain (``weights`` all 1: another rounding of the
batch mean), and the float32 truth against the float64 one at eps = 1 (rounding's share).
``--first-step`` instead looks at Adam's first step alone (``first_step``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import SETTINGS  # noqa: E402

from gradscope.config import load_config  # noqa: E402
from gradscope.job import config_forward, config_loss  # noqa: E402
from gradscope.training.loop import TrainingRows, build, fit  # noqa: E402
from gradscope.training.replay import through_training  # noqa: E402
from gradscope.training.run import train_model  # noqa: E402
from gradscope.validation.metrics import spearman  # noqa: E402
from gradscope.validation.retrain import evaluate, task_rows  # noqa: E402
from gradscope.validation.truth import subsets  # noqa: E402


def first_refs(ref: Path, k: int, folder: Path) -> str:
    """The first ``k`` rows of a Parquet REF, as a file in ``folder``."""
    out = folder / "ref.parquet"
    pq.write_table(pq.read_table(ref).slice(0, k), out)
    return str(out)


def retrained(cfg, ref: str, weights: np.ndarray) -> np.ndarray:
    """(R,) each reference's loss under the model trained with ``weights``."""
    return evaluate(cfg, fit(cfg, weights=weights), ref)[0]


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def probe(cfg, ref: str, removed: list[np.ndarray], eps: list[float], n: int) -> dict:
    """The replay's scores and the retrains of one dtype's config."""
    start = time.process_time()
    trained = train_model(cfg, None, overwrite=True, record=True)
    scores = through_training(cfg, trained.record, ref, per_ref=True)  # (N, R) -d f / d w
    replay_s = time.process_time() - start
    ones = np.ones(n)
    start = time.process_time()
    base = retrained(cfg, ref, ones)  # (R,)
    once_s = time.process_time() - start
    again = retrained(cfg, ref, ones)
    recorded = torch.load(cfg.model.checkpoint, weights_only=True)
    weighed = fit(cfg, weights=ones).state_dict()
    gap = max(float((recorded[k].double() - weighed[k].double()).abs().max()) for k in recorded)
    changes = {}  # eps -> (S, R) loss(removed at 1 - eps) - loss(full)
    for e in eps:
        rows = []
        for drop in removed:
            w = ones.copy()
            w[drop] = 1.0 - e
            rows.append(retrained(cfg, ref, w) - base)
        changes[e] = np.array(rows)
    # removing the rows by eps moves each loss by eps x their summed d f / d w = -eps x scores
    predicted = np.array([scores[drop].sum(0) for drop in removed])  # (S, R) per unit eps
    return {"scores": scores, "base": base, "rerun_gap": float(np.abs(again - base).max()),
            "record_gap": gap, "changes": changes, "predicted": predicted,
            "replay_cpu_s": replay_s, "retrain_cpu_s": once_s}  # fmt: skip


def first_step(cfg, eps: list[float], rows: int = 8) -> None:
    """Adam's first step, lr g / (|g| + adam eps) of the first batch's gradient g, as each of its
    first ``rows`` rows' weight goes to 1 - eps: how many weights' steps change sign, and the
    norm of the step's change over its first order's (the median over the rows)."""
    training, model = TrainingRows(cfg, None), build(cfg, cfg.train.seed)
    drawn = torch.get_rng_state()  # the dropout state the run's first step begins in
    order = torch.randperm(len(training), generator=torch.Generator().manual_seed(cfg.train.seed))
    x, y = training.batch(order[: cfg.train.batch_size])
    params = [p for p in model.parameters() if p.requires_grad]
    forward, loss, lr, tiny = config_forward(cfg), config_loss(cfg), cfg.train.lr, cfg.train.eps
    model.train()

    def step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.set_rng_state(drawn)
        losses = loss(forward(model, x), y)  # (B,)
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad((losses * w).mean(), params)])
        return g.double(), lr * g.double() / (g.double().abs() + tiny)  # (P,) (P,)

    g0, u0 = step(torch.ones(len(y)))
    for e in eps:
        flips, ratios = [], []
        for i in range(rows):
            w = torch.ones(len(y))
            w[i] = 1 - e
            g, u = step(w)
            linear = lr * tiny / (g0.abs() + tiny) ** 2 * (g - g0)  # (P,) the first order
            flips.append(int(((u > 0) != (u0 > 0)).sum()))
            ratios.append(float((u - u0).norm() / linear.norm()))
        print(f"first step, eps {e:g}: {np.mean(flips):.0f} of {len(g0)} weights change sign; "
              f"|change| / |first order| {np.median(ratios):.3g}")  # fmt: skip


def table(name: str, got: dict) -> None:
    print(f"\n{name}: replay {got['replay_cpu_s']:.0f} s CPU, a retrain "
          f"{got['retrain_cpu_s']:.1f} s CPU; full retrained twice: max |loss gap| "
          f"{got['rerun_gap']:.2e}; recorded run vs weights-all-1 retrain: max |weight gap| "
          f"{got['record_gap']:.2e}")  # fmt: skip
    print("   eps   LDS  median(change/pred)  rel.err  median|change|")
    pred = got["predicted"]
    for e, change in got["changes"].items():
        lds = np.nanmean(spearman(change.T, pred.T))  # over subsets, per reference
        ratio = np.median(change / (e * pred))
        err = np.linalg.norm(change - e * pred) / np.linalg.norm(e * pred)
        print(f"{e:6g} {lds:5.3f} {ratio:20.3f} {err:8.3f} {np.median(np.abs(change)):14.3e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=list(SETTINGS))
    parser.add_argument("--refs", type=int, default=16)
    parser.add_argument("--subsets", type=int, default=30)
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.1, 0.01, 0.001])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--first-step", action="store_true", help="Adam's first step only")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE",
        help="recipe keys replaced (a gentler recipe): lr=1e-4 eps=1e-4 warmup=4",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = SETTINGS[args.setting]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ref = first_refs(bench.ref, args.refs, folder)
        cfg = load_config(bench.config)
        changed = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
        train = dataclasses.replace(cfg.train, **changed)
        if args.first_step:
            first_step(dataclasses.replace(cfg, train=train), args.eps)
            return
        n = task_rows(cfg)
        kept = subsets(train.seed, n, 0.99, args.subsets)  # the same-order truth's
        removed = [np.setdiff1d(np.arange(n), k) for k in kept]
        got = {}
        for dtype in args.dtypes:
            model = dataclasses.replace(cfg.model, checkpoint=str(folder / dtype / "model.pt"))
            (folder / dtype).mkdir()
            mine = dataclasses.replace(cfg, model=model, dtype=dtype, train=train)
            got[dtype] = probe(mine, ref, removed, args.eps, n)
            table(dtype, got[dtype])
        if len(got) == 2:
            a, b = (got[d]["changes"][1.0] for d in args.dtypes if 1.0 in got[d]["changes"])
            print(f"\n{args.dtypes[0]} vs {args.dtypes[1]} truth at eps 1: LDS between them "
                  f"{np.nanmean(spearman(a.T, b.T)):.3f}, rel. diff "
                  f"{np.linalg.norm(a - b) / np.linalg.norm(b):.3f}")  # fmt: skip
            sa, sb = (got[d]["predicted"] for d in args.dtypes)
            print(
                f"replay {args.dtypes[0]} vs {args.dtypes[1]}: rel. diff "
                f"{np.linalg.norm(sa - sb) / np.linalg.norm(sb):.2e}"
            )


if __name__ == "__main__":
    main()
