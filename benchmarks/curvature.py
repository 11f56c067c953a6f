"""Preconditioned passes against the plain ones, on bench.py's workloads, in one process.

    python benchmarks/curvature.py [--workloads W1,W2,W3,W4] [--repeats 5] [--threads 1]

Per workload: the floor (one forward+backward of the summed loss), the norms pass, the norms
pass with K-FAC / EK-FAC self-influence (``g^T P g`` beside the plain norm), the hooks influence
pass against plain and preconditioned references, and the factors themselves (K-FAC: one pass
over the batch; EK-FAC: two), which a run computes once, apart from scoring. Medians of
round-robin samples; ratios are to the pass without preconditioning measured in the same run.
Correctness is the test suite's (tests/curvature/), not checked here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from methods import floor, held  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from gradscope.curvature.factors import fit  # noqa: E402
from gradscope.curvature.precondition import Curvature  # noqa: E402
from gradscope.curvature.store import Factors, metadata  # noqa: E402
from gradscope.engine import Influence, Want, reference_gradients  # noqa: E402


def steps(workload: str) -> dict[str, Callable]:
    pb = WORKLOADS[workload].build()
    engine = held(pb)
    batch = lambda: [(pb.inputs, pb.targets)]  # noqa: E731

    def factors(ekfac: bool):
        def run() -> Curvature:
            blocks, n, _ = fit(engine.contributions, batch, ekfac=ekfac)
            return Curvature(Factors(blocks, metadata("", "empirical", n, {})))

        return run

    kfac, ekfac = factors(False)(), factors(True)()
    refs = reference_gradients(engine, [(pb.ref_inputs, pb.ref_targets)])
    # as the command keeps them for the plain inner product and K-FAC's: factored where cheaper
    kept = reference_gradients(engine, [(pb.ref_inputs, pb.ref_targets)], factored=True)
    plain = Influence(engine, kept, "hooks", norms=False)
    by_kfac = Influence(engine, kfac.refs(kept), "hooks", norms=False)
    by_ekfac = Influence(engine, ekfac.refs(refs), "hooks", norms=False)
    return {
        "floor": floor(pb),
        "norms": lambda: engine.norms(pb.inputs, pb.targets),
        "norms+kfac": lambda: engine.scores(pb.inputs, pb.targets, Want(transform=kfac.transform)),
        "norms+ekfac": lambda: engine.scores(
            pb.inputs, pb.targets, Want(transform=ekfac.transform)
        ),
        "influence": lambda: plain(pb.inputs, pb.targets),
        "influence+kfac": lambda: by_kfac(pb.inputs, pb.targets),
        "influence+ekfac": lambda: by_ekfac(pb.inputs, pb.targets),
        "factors kfac": factors(False),
        "factors ekfac": factors(True),
    }


def measure(workload: str, repeats: int) -> dict[str, float]:
    timed = steps(workload)
    samples: dict[str, list[float]] = {k: [] for k in timed}
    order = list(timed)
    for r in range(repeats + 1):  # the first round warms up
        for key in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            timed[key]()
            if r:
                samples[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W3,W4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| workload | floor | norms | + K-FAC | + EK-FAC | influence | + K-FAC | + EK-FAC "
        "| factors K-FAC | factors EK-FAC |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for w in args.workloads.split(","):
        print(row(w, measure(w, args.repeats)), flush=True)


def row(workload: str, t: dict[str, float]) -> str:
    def ms(k: str, base: str | None = None) -> str:
        return f"{1000 * t[k]:.0f} ms" + (f" ({t[k] / t[base]:.2f}x)" if base else "")

    cells = [
        ms("floor"),
        ms("norms"),
        ms("norms+kfac", "norms"),
        ms("norms+ekfac", "norms"),
        ms("influence"),
        ms("influence+kfac", "influence"),
        ms("influence+ekfac", "influence"),
        ms("factors kfac"),
        ms("factors ekfac"),
    ]
    return f"| {workload} | {' | '.join(cells)} |"


if __name__ == "__main__":
    main()
