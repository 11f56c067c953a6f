"""Sweep every model type of the installed ``transformers``: tiny config, random init, float64,
three batches of one signature; gradscope against the float64 per-example loop
(``benchmarks/harness.py``).

    PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks OMP_NUM_THREADS=1 nice -n 10 \\
        python benchmarks/sweep.py [--only gpt2,llama] [--jobs 1] [--timeout 180] \\
        [--clock cpu] [--out PATH]

Writes ``PATH`` (JSON) and the markdown summary beside it (``.md``). ``--jobs N`` runs N
workers at once: sooner, but workers timed side by side on a machine of few CPUs disturb each
other's timings (on 2 CPUs, ``--jobs 2`` read MarkupLM at 0.82x the loop's speed, a run of it
alone at 1.6x): count the families slower than the loop from a ``--jobs 1`` run. ``--clock
cpu`` times by the process's CPU time, which work sharing the cores does not count.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import harness
import hf_tiny

OUT = Path(__file__).parent / "results" / "hf-sweep.json"


def run_one(model_type: str) -> dict:
    try:
        problem = hf_tiny.build(model_type)
    except hf_tiny.Unbuildable as e:
        return {"status": "skipped", "reason": str(e)[:400]}
    rec = harness.measure(problem.model, problem.batches, problem.loss)
    rec["auto"], rec["loss"] = problem.auto, problem.loss
    cls = type(problem.model.model).__name__
    rec["prefix"] = re.split(r"For[A-Z]|Model", cls)[0]  # MixtralForCausalLM -> Mixtral
    return rec


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        harness.serve(sys.argv[3:], run_one, Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per family")
    parser.add_argument("--out", type=Path, default=OUT)
    harness.add_clock(parser)
    parser.add_argument("--collect", nargs="*", type=Path, help="worker logs to summarize instead")
    args = parser.parse_args()
    harness.use_clock(args.clock)
    names = args.only.split(",") if args.only else hf_tiny.model_types()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.collect:
        results = harness.collect(args.collect)
    else:
        results = harness.run_isolated(__file__, names, args.out, args.timeout, args.jobs)
    heads: dict[str, int] = {}
    for r in results.values():
        if r["status"] != "skipped":
            heads[r.get("auto", "?")] = heads.get(r.get("auto", "?"), 0) + 1
    extra = {"heads of the families run": ", ".join(f"{k} {v}" for k, v in heads.items())}
    extra["workers timed at once"] = len(args.collect) if args.collect else args.jobs
    text = harness.write(results, args.out, "Tiny-config sweep of the transformers families", extra)
    print("\n".join(text.splitlines()[:12]))


if __name__ == "__main__":
    main()
