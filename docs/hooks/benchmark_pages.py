"""The benchmark pages' tables, rendered from benchmarks/results/: a benchmark run writes a results
file and never edits prose.

- ``bench.py --json`` files (every file whose results are per workload and method): the tables
  of ratios to the floor, rendered by bench.py's own ``markdown``, and the targets below, of the
  newest file of each set of workloads, and a line for each earlier one; the CPU's on one page
  and the GPU's on another;
- ``cuda_check.py --json`` files (``*-check.json``): its table of errors and syncs;
- ``*-hf-sweep.md``, ``*-layers.md`` and ``*-check-bf16.md``: summaries written beside a JSON,
  or in place of one;
- ``lds-*.md``: the attribution benchmark's tables (benchmarks/attribution/run.py), the newest.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS_PER_TABLE = 5  # workloads side by side in one table


@dataclass(frozen=True)
class Target:
    """A goal an issue set: ``metric`` (time or mem, as a multiple of the floor, or of the
    method ``against`` on the same workload) of ``method`` at most ``limit`` on ``workloads``;
    with ``beat_loop``, also below the per-example loop's."""

    goal: str
    methods: tuple[str, ...]
    workloads: tuple[str, ...]
    metric: str = "time"
    limit: float | None = None
    beat_loop: bool = False
    against: str | None = None


TARGETS = (
    Target("norms ≤ 1.3× on W3 (issue 16)", ("norms:gradscope",), ("W3",), limit=1.3),
    Target(
        "norms ≤ 1.3× on the MoE and seq2seq workloads W9, W10 (issue 16)",
        ("norms:gradscope",),
        ("W9", "W10"),
        limit=1.3,
    ),
    Target(
        "norms ≤ 1.3× and faster than the loop on W5–W8",
        ("norms:gradscope",),
        ("W5", "W6", "W7", "W8"),
        limit=1.3,
        beat_loop=True,
    ),
    Target(
        "influence scoring ≤ 1.3× on W1–W8 (issue 20)",
        ("influence:gradscope hooks",),
        tuple(f"W{n}" for n in range(1, 9)),
        limit=1.3,
    ),
    Target(
        "influence scoring faster than the loop everywhere (issue 20)",
        ("influence:gradscope hooks",),
        tuple(f"W{n}" for n in range(1, 11)),
        beat_loop=True,
    ),
    Target(
        "jvp memory ≤ 2× (issue 20)",
        ("influence:gradscope jvp",),
        (*(f"W{n}" for n in range(1, 11)), "T1", "T2", "T3", "T4"),
        metric="mem",
        limit=2.0,
    ),
    Target(
        "peak memory ≤ 1.2× for norms and influence (issues 20, 49)",
        ("norms:gradscope", "influence:gradscope hooks"),
        (*(f"W{n}" for n in range(1, 11)), "T1", "T2", "T3", "T4", "H1", "H2", "H3", "H4"),
        metric="mem",
        limit=1.2,
    ),
    Target(
        "norms ≤ 1.15× the Linear-only hooks (floor:linear hooks) on H1–H4, T1–T4 (issue 49)",
        ("norms:gradscope",),
        ("H1", "H2", "H3", "H4", "T1", "T2", "T3", "T4"),
        limit=1.15,
        against="floor:linear hooks",
    ),
    Target(
        "norms ≤ 1.15× the all-layer hooks (norms:all-layer hooks), exact, on H1–H4, T1–T4 "
        "(issue 49's yardstick)",
        ("norms:gradscope",),
        ("H1", "H2", "H3", "H4", "T1", "T2", "T3", "T4"),
        limit=1.15,
        against="norms:all-layer hooks",
    ),
    Target(
        "influence (hooks, jvp) ≤ 1.1× norms on every workload (issue 49)",
        ("influence:gradscope hooks", "influence:gradscope jvp"),
        (*(f"W{n}" for n in range(1, 11)), "T1", "T2", "T3", "T4", "H1", "H2", "H3", "H4"),
        limit=1.1,
        against="norms:gradscope",
    ),
    Target(
        "norms and influence ≤ 1.5× on the host graphs H1–H3 (issue 28)",
        ("norms:gradscope", "influence:gradscope hooks"),
        ("H1", "H2", "H3"),
        limit=1.5,
    ),
    Target(
        "norms and influence ≤ 1.7× on the Mixtral host graph H4 (issue 28)",
        ("norms:gradscope", "influence:gradscope hooks"),
        ("H4",),
        limit=1.7,
    ),
    Target(
        "tiny workloads ≤ 1.5× (issues 20, 28)",
        ("norms:gradscope", "influence:gradscope hooks"),
        ("T1", "T2", "T3", "T4"),
        limit=1.5,
    ),
)


def _bench():
    """bench.py, whose ``markdown`` renders its own results (imports torch and the workloads)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench

    return bench


def bench_files(device: str = "cpu") -> list[Path]:
    """The bench.py results files measured on ``device`` (cpu, cuda), newest name first."""
    files = []
    for path in sorted(RESULTS.glob("*.json"), reverse=True):
        report = json.loads(path.read_text())
        results = report.get("results")
        on = report.get("environment", {}).get("device", "cpu").split(":")[0]
        if isinstance(results, list) and results and "method" in results[0] and on == device:
            files.append(path)
    return files


def _environment(env: dict) -> str:
    peers = ", ".join(
        f"{name} {env[name]}" for name in ("opacus", "backpack-for-pytorch") if env.get(name)
    )
    gpu = f" ({env['gpu']}, {env.get('dtype', 'float32')})" if env.get("gpu") else ""
    return (
        f"gradscope at `{env.get('commit', '?')}`; Python {env.get('python')}, torch "
        f"{env.get('torch')}{', ' + peers if peers else ''}; {env.get('machine')}, "
        f"{env.get('cpus')} CPUs, {env.get('torch_threads')} torch thread(s), device "
        f"{env.get('device')}{gpu}; up to {env.get('repeats')} timed rounds after "
        f"{env.get('warmup')} "
        f"warm-up, {env.get('budget_s')} s of samples per method"
        + (f", a sample the calls that fill {env['sample_ms']:g} ms" if "sample_ms" in env else "")
        + ("; each call's CPU time (`--clock cpu`)." if env.get("clock") == "cpu" else ".")
    )


def _measured(by: dict, target: Target) -> tuple[str, list[str]]:
    """The target's measured values as one cell, and the workloads that miss it. Values are
    compared as shown, to two decimals."""
    groups, missed = [], []
    for method in target.methods:
        cells = []
        for w in target.workloads:
            r, loop = by.get((w, method)), by.get((w, method.split(":")[0] + ":loop"))
            value = r and r.get(f"{target.metric}_ratio")
            if value is not None and target.against:  # as a multiple of another method's
                base = by.get((w, target.against), {}).get(f"{target.metric}_ratio")
                value = value / base if base else None
            if value is None:
                continue
            value = round(value, 2)
            ok = target.limit is None or value <= target.limit
            if target.beat_loop and loop and loop.get("time_ratio") is not None:
                ok = ok and value < round(loop["time_ratio"], 2)
                cells.append(f"{w} {value:.2f} (loop {loop['time_ratio']:.2f})")
            else:
                cells.append(f"{w} {value:.2f}")
            if not ok:
                missed.append(w if len(target.methods) == 1 else f"{w} ({_label(method, target)})")
        if cells:
            name = f"{_label(method, target)}: " if len(target.methods) > 1 else ""
            groups.append(name + ", ".join(cells))
    return "; ".join(groups), missed


def _label(method: str, target: Target) -> str:
    """A method's name in a target's cell: its task ("norms"), or where the target's methods
    share one, the rest ("gradscope jvp")."""
    task, _, rest = method.partition(":")
    return rest if len({m.partition(":")[0] for m in target.methods}) == 1 else task


def targets(results: list[dict]) -> str:
    by = {(r["workload"], r["method"]): r for r in results}
    rows = ["| target | measured | |", "|---|---|---|"]
    for target in TARGETS:
        cell, missed = _measured(by, target)
        if cell:
            verdict = f"missed on {', '.join(missed)}" if missed else "met"
            rows.append(f"| {target.goal} | {cell} | {verdict} |")
    return "\n".join(rows)


def bench_results(device: str = "cpu") -> str:
    """The bench.py results files of ``device``: the newest of each set of workloads in full
    (its environment, its tables and the targets against it), then every earlier one in a
    line (its commit, workloads and the targets it missed), so that the page grows by a line
    a run, not by its tables."""
    bench, newest, earlier = _bench(), [], []
    seen: set[frozenset[str]] = set()
    for path in bench_files(device):
        report = json.loads(path.read_text())
        workloads = frozenset(r["workload"] for r in report["results"])
        if workloads in seen:
            earlier.append(_one_line(path.name, report))
        else:
            seen.add(workloads)
            newest += _in_full(bench, path.name, report)
    if earlier:
        newest += ["#### Earlier runs", "", "| file | commit | workloads | targets missed |"]
        newest += ["|---|---|---|---|", *earlier, ""]
    return "\n".join(newest)


def _in_full(bench, name: str, report: dict) -> list[str]:
    """One results file's environment, tables (``COLUMNS_PER_TABLE`` workloads side by side)
    and the targets against it, as lines of markdown."""
    results = [bench.Result(**r) for r in report["results"]]
    workloads = list(dict.fromkeys(r.workload for r in results))
    out = [f"### `{name}`", "", _environment(report["environment"]), ""]
    out += ["Time / peak memory, as multiples of the floor:", ""]
    for start in range(0, len(workloads), COLUMNS_PER_TABLE):
        chunk = workloads[start : start + COLUMNS_PER_TABLE]
        out += [bench.markdown([r for r in results if r.workload in chunk], chunk), ""]
    return out + ["Against the targets:", "", targets(report["results"]), ""]


def _one_line(name: str, report: dict) -> str:
    """An earlier results file as a row: where each target it measured was missed."""
    by = {(r["workload"], r["method"]): r for r in report["results"]}
    missed = []
    for target in TARGETS:
        cell, where = _measured(by, target)
        if cell and where:
            missed.append(f"{target.goal}: {', '.join(where)}")
    workloads = ", ".join(dict.fromkeys(r["workload"] for r in report["results"]))
    commit = report["environment"].get("commit", "?")
    return f"| `{name}` | `{commit}` | {workloads} | {'; '.join(missed) or 'none'} |"


def cuda_checks() -> str:
    """Each ``*-check.json`` of ``benchmarks/cuda_check.py``: where it ran, and its table."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import cuda_check

    out = []
    for path in sorted(RESULTS.glob("*-check.json"), reverse=True):
        report = json.loads(path.read_text())
        env = report["environment"]
        checks = [cuda_check.Check(**c) for c in report["checks"]]
        out += [f"### `{path.name}`", ""]
        out += [f"gradscope at `{env['commit']}` on {env['gpu']}, torch {env['torch']}:", ""]
        out += [cuda_check.markdown(checks), ""]
    return "\n".join(out)


def harness_summary(pattern: str) -> str:
    """The newest results file matching ``pattern`` (``*-layers.md``) a harness wrote, its
    headings moved two levels down to sit under the page's own."""
    paths = sorted(RESULTS.glob(pattern), reverse=True)
    if not paths:
        raise FileNotFoundError(f"no benchmarks/results/{pattern}")
    text = paths[0].read_text()
    text = re.sub(r"^(#+) ", lambda m: "#" * (len(m[1]) + 2) + " ", text, flags=re.M)
    return f"From `benchmarks/results/{paths[0].name}`:\n\n{text}"
