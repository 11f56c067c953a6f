"""The matrix products one warm pass of each method runs, by kind, in MFLOP (torch's FlopCounterMode,
the backward's included), the arithmetic the time ratios of bench.py rest on:

    python benchmarks/products.py W1 floor norms:gradscope "influence:gradscope hooks"

On W1 (an MLP, one position per example) ``norms`` needs the forward and the backward to the
layers' inputs alone (||s||^2 ||a||^2 per layer), while hooks ``influence`` needs s^T R a per
example and layer, a product the size of the layer's weight gradient: the count says whether a
method runs more than that minimum.

What the counter does not see or overstates: ``grouped_mm`` (transformers' grouped experts) is
not counted at all, and a grouped convolution's weight gradient is counted as if its groups were
one (gradscope's conv rule folds a call's examples into the groups: as many times its real
count as the call has examples).
"""

from __future__ import annotations

import argparse

import torch
from methods import METHODS
from torch.utils.flop_counter import FlopCounterMode
from workloads import WORKLOADS


def products(workload: str, key: str, warm: int = 3) -> dict[str, float]:
    """{op name: MFLOP} of one call of ``key``'s step on ``workload``, after ``warm`` calls.
    The warm calls run under the counter too: its global module hooks are part of the model's
    state a gradscope program replays at, so a pass that first meets them is analysed."""
    step = METHODS[key].setup(WORKLOADS[workload].build())
    with FlopCounterMode(display=False) as counter:
        for _ in range(warm):
            step()
        before = dict(counter.get_flop_counts()["Global"])
        step()
        after = counter.get_flop_counts()["Global"]
    counts = {op: flops - before.get(op, 0) for op, flops in after.items()}
    return {str(op).split(".")[-1]: flops / 1e6 for op, flops in counts.items() if flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("methods", nargs="+", help="METHODS keys")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for key in args.methods:
        by_op = products(args.workload, key)
        ops = ", ".join(f"{op} {mflop:.1f}" for op, mflop in sorted(by_op.items()))
        print(f"{key}: {sum(by_op.values()):.1f} MFLOP ({ops})")


if __name__ == "__main__":
    main()
