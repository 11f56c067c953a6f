"""The attribution benchmark's results file as Markdown: a summary table per ground truth
(default and tuned of every tool, per setting) and each setting's full table of runs."""

from __future__ import annotations

TITLES = {
    "digits_linear": "digits, logistic regression",
    "digits_mlp": "digits, MLP",
    "diabetes": "diabetes, MLP regression (mse)",
    "lm": "tiny GPT-2, fine-tuned",
}


def _options(options: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in options.items()) or "its defaults"


def _label(run: dict) -> str:
    """What a run is, in words: the tool's scorer and its options."""
    if run["tool"] != "gradscope":
        return f"{run['tool']} ({_options(run['options'])})"
    o = run["options"]
    if run["default"]:
        return "gradscope `influence` with no flags"
    if run["scorer"] == "cosine":
        return "gradscope `cosine` column (`--curvature none`)"
    if run["scorer"] == "tracin":
        return "gradscope TracIn over the epoch checkpoints (`--curvature none`)"
    if run["scorer"] == "through-training":
        return "gradscope `--through-training` (the recorded run, replayed)"
    if run["scorer"] == "ensemble":
        flags = (
            f"`--curvature {o['curvature']} --damping {o['damping']}`"
            if "damping" in o
            else "no flags"
        )
        return f"gradscope ensemble over the epoch checkpoints, {flags}"
    if o.get("curvature") == "none":
        return "gradscope `--curvature none` (inner product)"
    solver = f" --solver {o['solver']}" if "solver" in o else ""
    solver += f" --cg-tolerance {o['cg_tolerance']:g}" if "cg_tolerance" in o else ""
    return f"gradscope `--curvature {o['curvature']}{solver} --damping {o['damping']}`"


def _lds(run: dict, design: str) -> float | None:
    """The run's LDS on the design's truth; None where it was not measured, NaN where undefined."""
    found = run["lds"].get(design, {})
    return found.get("lds") if run["status"] == "ok" else None


def _seconds(run: dict) -> str:
    """The command's wall-clock seconds, and its CPU seconds where they were measured."""
    cpu = f", {run['cpu_s']:.0f} s CPU" if run.get("cpu_s") is not None else ""
    return f"{run['seconds']:.0f} s{cpu}"


def _cell(run: dict | None, design: str, commit: str) -> str:
    if run is None:
        return "—"
    lds = _lds(run, design)
    if lds is None:
        return "fails" if run["status"] != "ok" else "not validated"
    text = f"{lds:.2f}" if lds == lds else "n/a"
    at = f" @{run['commit']}" if run.get("commit", commit) != commit else ""
    return f"{text} ({_seconds(run)}){at}"


def _best(runs: list[dict], design: str) -> dict | None:
    measured = [r for r in runs if (lds := _lds(r, design)) is not None and lds == lds]
    return max(measured, key=lambda r: _lds(r, design)) if measured else None


def _kind(run: dict) -> tuple[str, str, str]:
    """What a damping grid groups by: scorer, curvature, solver ('' for the default)."""
    return run["scorer"], run["options"]["curvature"], run["options"].get("solver", "")


def summary_rows(runs: list[dict], design: str) -> dict[str, dict | None]:
    """Row name -> the run that fills it on the design's truth: gradscope's commands as they
    are, its best damping per curvature, each peer's defaults and its best option set
    ("tuned")."""
    rows: dict[str, dict | None] = {}
    for r in runs:
        if r["tool"] == "gradscope" and "damping" not in r["options"]:
            rows[_label(r)] = r
    fitted = [r for r in runs if r["tool"] == "gradscope" and "damping" in r["options"]]
    kinds = dict.fromkeys(_kind(r) for r in fitted)
    for scorer, c, solver in kinds:
        mine = [r for r in fitted if _kind(r) == (scorer, c, solver)]
        over = " ensemble over the epoch checkpoints," if scorer == "ensemble" else ""
        by = f" --solver {solver}" if solver else ""
        rows[f"gradscope{over} `--curvature {c}{by}`, best damping"] = _best(mine, design)
    for tool in dict.fromkeys(r["tool"] for r in runs if r["tool"] != "gradscope"):
        mine = [r for r in runs if r["tool"] == tool]
        rows[f"{tool}, its defaults"] = next((r for r in mine if r["default"]), None)
        rows[f"{tool}, tuned (best of its grid)"] = _best([r for r in mine if not r["default"]], design)  # fmt: skip
    return rows


def summary(report: dict, design: str) -> list[str]:
    names = list(report["settings"])
    per = {n: summary_rows(report["settings"][n]["scorers"], design) for n in names}
    labels = list(dict.fromkeys(label for n in names for label in per[n]))
    lines = [
        "| scorer | " + " | ".join(TITLES.get(n, n) for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label in labels:
        cells = []
        for n in names:
            run = per[n].get(label)
            tuned = run is not None and ("best" in label or "tuned" in label)
            hidden = ("curvature", "checkpoints", "solver")  # said by the row's label
            shown = {k: v for k, v in (run or {}).get("options", {}).items() if k not in hidden}
            extra = f" [{_options(shown)}]" if tuned and _lds(run, design) is not None else ""
            cells.append(_cell(run, design, report["environment"]["commit"]) + extra)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _factory(factory: str) -> str:
    """``model.py:Name`` for a file's class (the results hold its absolute path), else as is."""
    where, _, name = factory.rpartition(":")
    return f"{where.rsplit('/', 1)[-1]}:{name}" if where.endswith(".py") else factory


def _truth(design: dict) -> str:
    """A design in words."""
    if design["same_order"]:
        return (f"{design['subsets']} removals of {1 - design['fraction']:.0%} of the rows, each "
                "trained in the full run's batches and order under its seed")  # fmt: skip
    return (f"{design['subsets']} random subsets of {design['fraction']:.0%} of the rows x "
            f"{design['seeds']} seeds, each trained alone")  # fmt: skip


def _took(s: dict, designs: list[dict]) -> str:
    """The replay's and the truths' seconds, where this report measured them."""
    parts = []
    if s.get("replay_mean_s") is not None:
        parts.append(
            f"the replay against the mean over the references took {s['replay_mean_s']:.1f} s"
        )
    if s.get("truth_s"):
        truths = ", ".join(f"{s['truth_s'][d['name']]:.0f} s ({d['name']})" for d in designs)
        parts.append(f"the ground truths took {truths}")
    return "; ".join(["", *parts]) if parts else ""


def setting(name: str, s: dict, designs: list[dict], commit: str) -> list[str]:
    recipe = s["recipe"]
    quality = f"reference loss {s['ref_loss']:.3f}" + (
        f", accuracy {s['ref_accuracy']:.0%}" if "ref_accuracy" in s else ""
    )
    out = [
        f"### {TITLES.get(name, name)} (`{name}`)",
        "",
        f"`{s['config']}` ({_factory(s['model']['factory'])}, loss {s['loss']}), {s['rows']} training "
        f"rows, references `{s['ref']}`; recipe {recipe['optimizer']} lr {recipe['lr']}, "
        f"{recipe.get('epochs') or recipe.get('steps')} {'epochs' if recipe.get('epochs') else 'steps'}, "
        f"batch {recipe.get('batch_size')}, weight decay {recipe.get('weight_decay')}"
        + (f", {recipe['warmup']} steps of warm-up" if recipe.get("warmup") else "") + "; trained in "
        f"{s['train_s']:.1f} s to {quality} ({s['record_s']:.1f} s recording the run)"
        + _took(s, designs) + ".",
        "",
        "| scorer | " + " | ".join(f"LDS, {d['name']} (std)" for d in designs)
        + " | seconds: scoring / command / command's CPU | commit | note |",
        "|---|" + "---:|" * len(designs) + "---:|---|---|",
    ]  # fmt: skip
    for r in s["scorers"]:
        cells = []
        for d in designs:
            lds = r["lds"].get(d["name"], {})
            mean = f"{lds['lds']:.3f}" if r["status"] == "ok" and "lds" in lds else r["status"]
            cells.append(mean + (f" ({lds['lds_std']:.3f})" if "lds_std" in lds else ""))
        note = r["note"].replace("|", "/")
        took = f"{r['run_s']:.1f} / " if r.get("run_s") is not None else ""
        cpu = f" / {r['cpu_s']:.1f}" if r.get("cpu_s") is not None else ""
        at = r.get("commit") or commit
        out.append(f"| {_label(r)} | {' | '.join(cells)} | {took}{r['seconds']:.1f}{cpu} | {at} | {note} |")  # fmt: skip
    return [*out, ""]


def markdown(report: dict) -> str:
    env, designs = report["environment"], report["designs"]
    peers = ", ".join(f"{k} {v}" for k, v in env.get("peers", {}).items())
    lines = [
        f"gradscope at `{env['commit']}`"
        + (f" ({env['note']})" if env.get("note") else "")
        + f"; Python {env['python']}, torch {env['torch']}"
        + (f"; peers (own environment): {peers}" if peers else "")
        + f"; {env['machine']}, {env['cpus']} CPUs, one thread per run. Ground truths, "
        "target the references' loss: "
        + "; ".join(f"{d['name']}, {_truth(d)}" for d in designs)
        + ". LDS is the mean over references "
        "of the Spearman correlation. Seconds: the scoring's own time as its file records it (from "
        "the loaded model; gradscope's from the start of its run, fitting the curvature "
        "included), beside the wall-clock of the one command that wrote the file (process "
        "start-up, imports included), and that command's CPU seconds where they were measured "
        "(the wall-clock waits where other work shares the cores). A cell measured at another "
        "commit than this one names it (`@commit`); each setting's table gives every row's.",
        "",
    ]
    for d in designs:
        lines += [
            f"LDS on the {d['name']} truth (seconds of the command); tuned and best-damping cells "
            "name the options that won on it:",
            "",
            *summary(report, d["name"]),
            "",
        ]
    for name, s in report["settings"].items():
        lines += setting(name, s, designs, env["commit"])
    return "\n".join(lines)
