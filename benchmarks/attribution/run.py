"""LDS and cost of every gradscope scorer and of the peers, on settings anyone reruns on a CPU.

    python benchmarks/attribution/run.py [--settings digits_linear digits_mlp diabetes lm]
        [--subsets 60] [--seeds 2] [--peers /work/peers-venv/bin/python]
        [--json benchmarks/results/lds-DATE.json] [--markdown benchmarks/results/lds-DATE.md]
        [--only PATTERN ...] [--keep-truth] [--merge lds-OLD.json]
    python benchmarks/attribution/run.py --render lds-DATE.json --markdown lds-DATE.md

Per setting (configs/, data from make_data.py): ``gradscope train`` by the config's recipe (the
final checkpoint and the epoch ones), the trained model's loss and accuracy on the references,
then every scorer as one command, its wall-clock seconds its cost: ``influence --per-ref`` with
no flags (what a user gets), ``--curvature none`` (the inner product, and its ``cosine``
column), TracIn over the epoch checkpoints, each ``--curvature`` at each ``--damping``, the
ensemble over the epoch checkpoints (``influence`` of the TracIn config: each checkpoint's own
curvature, the scores summed; with no flags and under each curvature but the Hessian at each
damping), the
replay of the recorded run (``--through-training``; its cost for the mean over REF too, one
adjoint against the per-ref run's R); and each peer (peers.py, in its own environment) at its
defaults and over a grid of its knob. Every file is measured on two ground truths, each built
once by ``gradscope validate``: ``--subsets`` random halves x ``--seeds`` seeds, each trained
alone (the field's LDS), and ``--same-subsets`` removals of 1% of the rows trained in the full
run's batches and order under its seed (``--same-order``, the setting MAGIC reports), the
references' loss the target of both.
Every run is one thread (OMP_NUM_THREADS=1), its wall-clock and CPU seconds recorded, and the
commit it ran at. "Tuned" in the tables is the best of a tool's grid on this truth, for
gradscope's dampings as for the peers' knobs. ``--only`` runs the scorers whose
``tool:scorer:options`` key matches a pattern, ``--keep-truth`` reuses the truth files a
setting's folder holds, ``--merge`` puts the rows measured into an older results file (a
setting whose truths were rebuilt replaces its old measurement whole: the old rows were
measured on other truths).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from render import markdown  # noqa: E402
from results import environment, merged, shown  # noqa: E402
from scorers import GRADSCOPE, Run, influence, peer, timed, write_config  # noqa: E402
from suite import SETTINGS, Bench  # noqa: E402

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def quality(cfg, ref: Path) -> dict:
    """The trained model's mean loss on the references, and its accuracy where it classifies."""
    import dataclasses
    import tempfile

    import pandas as pd

    from gradscope.run import score_dataset
    from gradscope.scorers import NormsScorer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ref.parquet"
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(ref), ids=None),
                                  output=dataclasses.replace(cfg.output, path=str(out)))  # fmt: skip
        score_dataset(cfg, NormsScorer())
        frame = pd.read_parquet(out)
    made = {"ref_loss": float(frame["loss"].mean())}
    if "pred" in frame and "target" in frame:
        made["ref_accuracy"] = float((frame["pred"] == frame["target"]).mean())
    return made


def gradscope_runs(
    bench: Bench, config: Path, tracin: Path, record: Path, work: Path, only: list[str]
) -> list[Run]:
    """Every gradscope command of the setting that ``only`` keeps (``chosen``), run in turn."""
    epochs = {"checkpoints": "epochs"}
    ensembled = [c for c in bench.curvatures if c != "hessian"]  # gn's is never below it
    specs = [
        (config, "through-training", ["--through-training", str(record)],
         Run("gradscope", "through-training", {}, False)),
        (config, "default", [], Run("gradscope", "influence", {}, default=True)),
        (config, "plain", ["--curvature", "none"],
         Run("gradscope", "influence", {"curvature": "none"}, default=False)),
        (tracin, "tracin", ["--curvature", "none"],
         Run("gradscope", "tracin", {"checkpoints": "epochs"}, False)),
        *_dampings(bench, bench.curvatures, config, "influence", {}),
        *[spec for damping, tolerance in bench.cg for spec in _dampings(
            bench, ["gn"], config, "influence", {"solver": "cg", "cg_tolerance": tolerance},
            [damping])],
        (tracin, "ensemble", [], Run("gradscope", "ensemble", epochs, False)),
        *_dampings(bench, ensembled, tracin, "ensemble", epochs),
    ]  # fmt: skip
    runs = []
    for cfg, name, flags, run in specs:
        if not chosen(run, only):
            continue
        runs.append(influence(cfg, str(bench.ref), work / f"{name}.parquet", flags, run))
        if name == "plain":  # its cosine column
            runs.append(Run("gradscope", "cosine", run.options, False, run.file, "cosine",
                            run.status, run.note, run.seconds, run.cpu_s))  # fmt: skip
    return runs


def _dampings(bench: Bench, curvatures, config: Path, scorer: str, options: dict, dampings=None):
    """The specs of ``influence`` of ``config`` under each curvature at each damping
    (``bench.dampings`` unless given), with ``options``' flags (``solver``, ``cg_tolerance``)."""
    specs = []
    for curvature in curvatures:
        for damping in bench.dampings if dampings is None else dampings:
            chosen = {**options, "curvature": curvature, "damping": damping}
            flags = [x for k, v in chosen.items() if k != "checkpoints"
                     for x in (f"--{k.replace('_', '-')}", str(v))]  # fmt: skip
            named = [str(options[k]) for k in ("solver", "cg_tolerance") if k in options]
            name = "-".join([scorer, curvature, *named, str(damping)])
            specs.append((config, name, flags, Run("gradscope", scorer, chosen, False)))
    return specs


def key(run: Run) -> str:
    """``tool:scorer`` and the options, ``k=v`` joined by commas: what ``--only`` matches."""
    return f"{run.tool}:{run.scorer}:" + ",".join(f"{k}={v}" for k, v in run.options.items())


def chosen(run: Run, only: list[str]) -> bool:
    """Whether ``--only``'s patterns (fnmatch, any; none: every run) keep the run."""
    return not only or any(fnmatch.fnmatchcase(key(run), p) for p in only)


def peer_runs(
    bench: Bench, cfg, python: str, checkpoints: list[str], work: Path, only: list[str]
) -> list[Run]:
    runs = []
    for name, option_sets in bench.peers.items():
        for n, options in enumerate(option_sets):
            if not chosen(Run(name, name, options, n == 0), only):
                continue
            passed = {k: v for k, v in options.items() if k != "over"}
            over = checkpoints if options.get("over") == "epochs" else checkpoints[-1:]
            job = {"peer": name, "options": passed, "config": str(bench.config),
                   "ref": str(bench.ref), "checkpoints": over, "out": str(work / f"{name}-{n}.npy")}  # fmt: skip
            runs.append(peer(python, job, cfg, str(bench.ref), Run(name, name, options, n == 0)))
    return runs


def validate(config: Path, bench: Bench, files: list[str], column: str, work: Path, design: dict):
    """``gradscope validate`` of column ``column`` of ``files`` on the design's truth (built by
    the first call): its seconds and its results, one per file."""
    name = design["name"]
    out = work / f"validation-{name}.parquet"
    command = [*GRADSCOPE, "validate", str(config), "--ref", str(bench.ref), "--scores", *files,
               "--truth", str(work / f"truth-{name}.parquet"), "--subsets", str(design["subsets"]),
               "--seeds", str(design["seeds"]), "--fraction", str(design["fraction"]),
               "--column", column, "--out", str(out)]  # fmt: skip
    command += ["--same-order"] if design["same_order"] else []
    out.with_suffix(".json").unlink(missing_ok=True)
    out.unlink(missing_ok=True)
    seconds, _, error = timed(command)
    if error:
        raise SystemExit(f"gradscope validate failed: {error}")
    return seconds, json.loads(out.with_suffix(".json").read_text())["results"]


def _validate_all(config: Path, bench: Bench, runs: list[Run], work: Path, design: dict) -> float:
    """Every run that scored, validated on the design's truth (its results in each run's
    ``lds[design name]``): the seconds the truth took to build."""
    scored = [r for r in runs if r.status == "ok"]
    if not scored:
        raise SystemExit("no scorer ran: " + "; ".join(dict.fromkeys(r.note for r in runs)))
    truth_s, _ = validate(config, bench, [scored[0].file], scored[0].column, work, design)
    for column in dict.fromkeys(r.column for r in scored):
        mine = [r for r in scored if r.column == column]
        _, results = validate(config, bench, list(dict.fromkeys(r.file for r in mine)), column, work, design)  # fmt: skip
        by = {Path(r["file"]).resolve(): r for r in results if r["column"] == column}
        for r in mine:
            found = by.get(Path(r.file).resolve(), {})
            kept = {k: v for k, v in found.items() if k not in ("file", "column", "target", "seconds")}  # fmt: skip
            r.lds[design["name"]] = kept
            r.run_s = found.get("seconds")
    return truth_s


def _trained(cfg, work: Path):
    """The recipe's run twice, as the user's ``gradscope train`` (its seconds the training's
    cost) and with ``--record`` (the record the replay reads, and its seconds)."""
    from gradscope.training.run import train_model

    start = time.perf_counter()
    train_model(cfg, None, overwrite=True)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    trained = train_model(cfg, None, overwrite=True, record=True)
    return trained, train_s, time.perf_counter() - start


def replay_cost(config: Path, ref: str, record: Path, work: Path) -> float:
    """Seconds of ``influence --through-training`` against the mean over REF: one adjoint."""
    out = work / "through-training-mean.parquet"
    command = [*GRADSCOPE, "influence", str(config), "--ref", ref, "--out", str(out),
               "--through-training", str(record)]  # fmt: skip
    seconds, _, error = timed(command)
    if error:
        raise SystemExit(f"the mean replay failed: {error}")
    return seconds


def measure(
    bench: Bench, designs: list[dict], peers_python: str | None, only=(), keep_truth=False
) -> dict:
    """One setting: train, score with everything ``only`` keeps, validate it on each design's
    truth (built afresh, its seconds measured, unless ``keep_truth`` reuses the truth files
    the setting's folder holds: ``validate`` checks they are this recipe's)."""
    from gradscope.config import load_config

    cfg = load_config(bench.config)
    work = Path(cfg.model.checkpoint).parent
    work.mkdir(parents=True, exist_ok=True)
    for design in designs if not keep_truth else ():
        (work / f"truth-{design['name']}.parquet").unlink(missing_ok=True)
    trained, train_s, record_s = _trained(cfg, work)
    config = write_config(cfg, work / "config.yaml")
    listed = [{"path": str(p), "weight": float(w)} for p, w in trained.epochs]
    tracin = write_config(cfg, work / "tracin.yaml", checkpoint=None, checkpoints=listed)
    runs = gradscope_runs(bench, config, tracin, trained.record, work, list(only))
    replayed = chosen(Run("gradscope", "through-training", {}, False), list(only))
    replay_s = replay_cost(config, str(bench.ref), trained.record, work) if replayed else None
    if peers_python:
        epochs = [str(p) for p, _ in trained.epochs]
        runs += peer_runs(bench, cfg, peers_python, epochs, work, list(only))
    truth_s = {d["name"]: _validate_all(config, bench, runs, work, d) for d in designs}
    commit = environment(None)["commit"]
    for r in runs:
        r.commit = commit
    return {
        "config": shown(bench.config),
        "ref": shown(bench.ref),
        "model": {"factory": cfg.model.factory, "kwargs": cfg.model.kwargs},
        "loss": cfg.loss.name,
        "rows": trained.rows,
        "recipe": cfg.to_dict()["train"],
        "train_s": train_s,
        "record_s": record_s,
        "replay_mean_s": replay_s,
        "truth_s": None if keep_truth else truth_s,
        **quality(cfg, bench.ref),
        "scorers": [r.record() for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--subsets", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--same-subsets",
        type=int,
        default=100,
        help="removals of 1%% of the rows in the run's own order (0: none)",
    )
    parser.add_argument("--peers", help="the python of the peers' environment (none: no peers)")
    parser.add_argument("--note", default="", help="a line the report shows with the commit")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        help="run only the scorers whose tool:scorer:options key matches one of these fnmatch "
        "patterns (gradscope:influence:curvature=gn,* ; trak:*); the replay's mean with "
        "gradscope:through-training:",
    )
    parser.add_argument(
        "--keep-truth",
        action="store_true",
        help="reuse the truth files in each setting's run folder (validate checks their recipe)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        help="a results JSON these runs replace rows of (with --keep-truth; without, a setting "
        "measured replaces its old one whole); its other rows keep their commit",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--render", type=Path, help="render this JSON to --markdown, no run")
    args = parser.parse_args()
    if args.render:
        args.markdown.write_text(markdown(json.loads(args.render.read_text())))
        return
    designs = [{"name": "halves", "subsets": args.subsets, "seeds": args.seeds, "fraction": 0.5,
                "same_order": False, "target": "loss"}]  # fmt: skip
    if args.same_subsets:
        designs.append({"name": "same-order", "subsets": args.same_subsets, "seeds": 1,
                        "fraction": 0.99, "same_order": True, "target": "loss"})  # fmt: skip
    old = json.loads(args.merge.read_text()) if args.merge else None
    if old and old["designs"] != designs:
        raise SystemExit(f"{args.merge} was measured on other truths: {old['designs']}")
    report = {
        "environment": environment(args.peers) | {"note": args.note},
        "designs": designs,
        "settings": {},
    }
    for name, measured in (old or {"settings": {}})["settings"].items():  # rows with a commit
        report["settings"][name] = merged(measured, {"scorers": []}, old["environment"]["commit"])
    for name in args.settings:
        print(f"{name} ...", flush=True)
        new = measure(SETTINGS[name], designs, args.peers, args.only, args.keep_truth)
        if name in report["settings"] and args.keep_truth:  # rebuilt truths: the old rows go
            new = merged(report["settings"][name], new, old["environment"]["commit"])
        report["settings"][name] = new
        if args.json:  # after each setting: a crash keeps the ones measured
            args.json.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
