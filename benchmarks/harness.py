"""The harness that ``sweep.py`` (Hugging Face families) and ``layers.py`` (Opacus/BackPACK layer
cases) share: one case measured against the float64 loop, cases run in worker processes that a
hang or a crash cannot stop, and the JSON + markdown they write.

A case is ``(model, [(inputs, targets), ...], loss)``, batches of one signature with other
values; the measure records the worst relative error of ``gradscope.per_example_norms`` (a fresh
call per batch) and of one ``Engine`` over the batches against ``reference_norms``, how many of
the Engine's batches replayed the first's analysis, the parameters on the fallback with their
notes, and the time of a warm ``Engine`` pass (replayed where a program holds) against the
per-example loop on the same batch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from oracle import reference_norms
from provenance import measured_commit
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, naive_grads, prepared, total
from gradscope.losses import resolve_loss

WRONG = 1e-6  # a relative error above this is a wrong number
# "cpu": time the process's CPU time, not the wall clock (``--clock``); set by ``use_clock`` in
# the parent, read by the workers it starts
CLOCK = "GRADSCOPE_HARNESS_CLOCK"
Batch = tuple[tuple[Tensor, ...], Tensor]


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """max |a - e| / max |e|, as ``gradscope check`` and tests/oracle.py report it."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _best(
    fns: dict[str, Callable[[], object]], repeats: int, budget_s: float = 2.0
) -> dict[str, float]:
    """The least time of each of ``fns`` over ``repeats`` rounds (two at least, no more once
    ``budget_s`` is spent: slow models vary little), which run them in turn, starting each round
    with the next (drift in the machine's speed reaches each alike), with Python's garbage
    collector off, as ``timeit`` times: a worker that has built hundreds of models would
    otherwise pause in whichever pass a collection falls in."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    order = list(fns)
    now = time.process_time if os.environ.get(CLOCK) == "cpu" else time.perf_counter
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            if r >= 2 and sum(map(sum, times.values())) > budget_s:
                break
            for key in order[r % len(order) :] + order[: r % len(order)]:
                start = now()
                fns[key]()
                times[key].append(now() - start)
    finally:
        if was:
            gc.enable()
    return {key: min(t) for key, t in times.items()}


def add_clock(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time passes by the wall clock or by the process's CPU time (on a shared machine, "
        "where the wall clock counts the waits of other work: the loop's ratio swung by +-40%%)",
    )


def use_clock(clock: str) -> None:
    """The workers started after this time passes by ``clock`` (``add_clock``)."""
    os.environ[CLOCK] = clock


def _grad(losses: Tensor, params: list[Tensor]) -> None:
    """One ordinary backward of the batch's summed loss: the floor."""
    torch.autograd.grad(losses.sum(), params, allow_unused=True)


def measure(model: nn.Module, batches: list[Batch], loss: str, repeats: int = 21) -> dict:
    """Errors, fallback and timing of one case; an exception of gradscope's is a crash. A tiny
    model's pass at batch 3 takes milliseconds, and the least of five rounds moved a family by
    up to 1.5x against the loop from one run to the next (GroupViT 0.79 to 1.27 in one
    process); of 21, by 1.07-1.13: the rounds stop once two seconds are spent, so only the
    fast cases take them all."""
    rec: dict = {"status": "ok", "params": sum(1 for _ in model.parameters())}
    try:
        refs = [reference_norms(model, x, y, loss)[1] for x, y in batches]
    except Exception as e:  # noqa: BLE001 - the oracle could not run the model: not ours to judge
        return {"status": "skipped", "reason": f"oracle failed: {one_line(e)}"}
    stage = "api"
    try:
        errs = {}
        for k, ((x, y), ref) in enumerate(zip(batches, refs, strict=True)):
            errs[f"api{k + 1}"] = rel_err(gradscope.per_example_norms(model, x, y, loss), ref)
        stage = "engine"
        fn = resolve_loss(loss)
        with Engine(model, fn) as engine:
            for k, ((x, y), ref) in enumerate(zip(batches, refs, strict=True)):
                errs[f"engine{k + 1}"] = rel_err(total(engine.norms(x, y).norm_sq).sqrt(), ref)
            findings = engine.record.at(*batches[0])
            rec["replays"], rec["replay_why"] = findings.replays, findings.why
            rec["repeated"] = findings.repeated  # analysed, not self-checked again
        stage = "timing"
        rec.update(_timed(model, engine, batches, repeats))
        fallback = [p for p in engine.plan.params if p.is_fallback]
        rec["fallback"] = [{"name": p.name, "rule": p.rule, "note": p.note} for p in fallback]
        rec["rules"] = sorted({p.rule for p in engine.plan.params})
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        rec.update(status="crash", stage=stage, error=one_line(e))
        rec["traceback"] = traceback.format_exc(limit=-4)
        return rec
    rec["errors"] = errs
    rec["max_err"] = max(errs.values())
    if rec["t_loop"] > 0:
        rec["speedup"] = rec["t_loop"] / rec["t_gradscope"]
    return rec


def _timed(model: nn.Module, engine: Engine, batches: list[Batch], repeats: int) -> dict:
    """The warm pass of an Engine held over the batches, as a run holds its own, against the
    loop and the floor on the last batch. The Engine is a second one, on a copy of the model,
    its programs made over the same batches: an entered Engine keeps its module hooks on the
    model, and the loop's and the floor's passes must not meet them. A model that cannot be
    copied (a weight-norm tensor that is no leaf) is timed with ``engine`` entered for each
    pass alone, its hooks registered and removed in each (``held`` False)."""
    x, y = batches[-1]
    fn, names = engine.loss_fn, [p.name for p in engine.plan.included]
    params = [p.param for p in engine.plan.included]
    try:
        copied = copy.deepcopy(model)
    except RuntimeError:
        copied = None
    with contextlib.ExitStack() as stack:
        if copied is None:
            gradscope_pass = functools.partial(_entered, engine, x, y)
        else:
            timed = stack.enter_context(Engine(copied, fn))
            for inputs, targets in batches:
                timed.norms(inputs, targets)
            gradscope_pass = functools.partial(timed.norms, x, y)
        stack.enter_context(prepared(model, engine.plan))
        steps = {
            "t_gradscope": gradscope_pass,
            "t_loop": lambda: naive_grads(model, x, y, fn, names),
            "t_floor": lambda: _grad(fn(engine.forward(model, x), y), params),
        }
        return {"held": copied is not None, **_best(steps, repeats)}


def _entered(engine: Engine, x: tuple[Tensor, ...], y: Tensor) -> None:
    """One pass of ``engine`` entered for it alone."""
    with engine:
        engine.norms(x, y)


# ---------------------------------------------------------------- isolation


def serve(names: list[str], run_one: Callable[[str], dict], out: Path) -> None:
    """The worker: run each case, one JSON line before ("start") and one after it."""
    torch.set_num_threads(1)
    with out.open("a") as f:
        for name in names:
            f.write(json.dumps({"name": name, "start": True}) + "\n")
            f.flush()
            start = time.perf_counter()
            try:
                rec = run_one(name)
            except Exception as e:  # noqa: BLE001 - the case itself failed to build
                rec = {"status": "skipped", "reason": f"build failed: {one_line(e)}"}
            rec["name"], rec["wall_s"] = name, time.perf_counter() - start
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()


def run_isolated(script: str, names: list[str], out: Path, timeout: float, jobs: int) -> dict:
    """Run ``script --worker`` over ``names`` in ``jobs`` processes; a case that hangs past
    ``timeout`` seconds or kills its worker is recorded and the worker restarted after it."""
    results: dict[str, dict] = {}
    queues = [names[i::jobs] for i in range(jobs)]
    logs = [out.with_suffix(f".w{i}.jsonl") for i in range(jobs)]
    for log in logs:
        log.unlink(missing_ok=True)
    procs: list[subprocess.Popen | None] = [None] * jobs
    seen = [0] * jobs  # lines of each log already read
    current: list[tuple[str, float] | None] = [None] * jobs
    while any(queues) or any(p is not None for p in procs):
        for i in range(jobs):
            if procs[i] is None and queues[i]:
                cmd = [sys.executable, script, "--worker", str(logs[i]), *queues[i]]
                procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                current[i] = (queues[i][0], time.monotonic())
            if procs[i] is None:
                continue
            text = logs[i].read_text() if logs[i].exists() else ""
            lines = text[: text.rfind("\n") + 1].splitlines()  # a line still being written waits
            for line in lines[seen[i] :]:
                rec = json.loads(line)
                if rec.get("start"):
                    current[i] = (rec["name"], time.monotonic())
                else:
                    results[rec["name"]] = rec
                    queues[i].remove(rec["name"])
                    current[i] = None
                    print(f"{rec['name']:40s} {_brief(rec)}", flush=True)
            seen[i] = len(lines)
            code = procs[i].poll()
            hung = current[i] and time.monotonic() - current[i][1] > timeout
            if code is None and not hung:
                continue
            if code is None:
                procs[i].kill()
            stderr = procs[i].communicate()[1].decode(errors="replace").strip().splitlines()
            procs[i] = None  # the next worker appends to the same log: it keeps every record
            if current[i] and current[i][0] in queues[i]:
                name = current[i][0]
                why = f"timeout after {timeout:g}s" if hung else f"worker died ({code})"
                last = stderr[-1][:300] if stderr else ""
                results[name] = {"name": name, "status": "crash", "stage": "process",
                                 "error": f"{why}: {last}".strip(": ")}  # fmt: skip
                queues[i].remove(name)
                print(f"{name:40s} {_brief(results[name])}", flush=True)
            current[i] = None
        time.sleep(0.2)
    return {n: results[n] for n in names if n in results}


def collect(paths: list[Path]) -> dict[str, dict]:
    """The records in worker logs (of a run that was stopped); a case started and never ended
    is a crash."""
    results: dict[str, dict] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("start"):
                results.setdefault(rec["name"], {"name": rec["name"], "status": "crash",
                                                 "stage": "process", "error": "never ended"})  # fmt: skip
            else:
                results[rec["name"]] = rec
    return results


def _brief(rec: dict) -> str:
    if rec["status"] == "ok":
        fb = len(rec.get("fallback", []))
        return f"ok err={rec['max_err']:.1e} fallback={fb} x{rec.get('speedup', 0):.1f}"
    return f"{rec['status']}: {rec.get('reason') or rec.get('error')}"[:160]


# ---------------------------------------------------------------- output


def environment() -> dict:
    import importlib.metadata as md

    env = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "gradscope"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    env["commit"] = measured_commit()
    env["cpus"], env["threads"] = os.cpu_count(), 1
    env["clock"] = os.environ.get(CLOCK, "wall")
    env["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return env


def write(results: dict, out: Path, title: str, extra: dict | None = None) -> str:
    """The JSON beside a markdown summary of the same name; returns the markdown."""
    payload = {"environment": environment(), **(extra or {}), "results": list(results.values())}
    out.write_text(json.dumps(payload, indent=1, default=str))
    text = summary(results, title, payload["environment"], extra)
    out.with_suffix(".md").write_text(text)
    return text


def summary(results: dict, title: str, env: dict, extra: dict | None) -> str:
    rows = list(results.values())
    ok = [r for r in rows if r["status"] == "ok"]
    crash = [r for r in rows if r["status"] == "crash"]
    skipped = [r for r in rows if r["status"] == "skipped"]
    wrong = [r for r in ok if r["max_err"] > WRONG]
    fell = [r for r in ok if r["fallback"]]
    slow = [r for r in ok if r.get("speedup", 1) < 1]
    # the API calls and the Engine share the model's record: every batch after the first
    replayed = [r for r in ok if r.get("replays", 0) == len(r["errors"]) - 1]
    # of the others, those whose every batch after the first skipped the self-check
    repeated = [r for r in ok if r.get("repeated", 0) == len(r["errors"]) - 1]
    lines = [
        f"# {title}",
        "",
        f"gradscope at `{env['commit']}`, torch {env['torch']}, transformers "
        f"{env.get('transformers')}, {env['cpus']} CPUs, 1 thread, float64, timed by the "
        f"{'CPU' if env.get('clock') == 'cpu' else 'wall'} clock, {env['date']}.",
        "",
        f"- cases: {len(rows)}; measured: {len(ok)}; crashed: {len(crash)}; skipped: {len(skipped)}",
        f"- wrong (max relative error > {WRONG:g}): {len(wrong)}",
        f"- with any parameter on the fallback: {len(fell)}",
        f"- gradscope (warm Engine pass) slower than the per-example loop: {len(slow)}",
        f"- replayed every batch after the first: {len(replayed)}; analysed every batch: "
        f"{len(ok) - len(replayed)}, of which self-checked on the first alone: {len(repeated)}",
        *(  # the Engine entered for each timed pass: a model that cannot be copied
            [f"- timed with the Engine entered for each pass: {', '.join(unheld)}"]
            if (unheld := [r["name"] for r in ok if r.get("held") is False])
            else []
        ),
        *(f"- {k}: {v}" for k, v in (extra or {}).items() if not isinstance(v, (dict, list))),
        "",
    ]
    unreplayed: dict[str, list[str]] = {}
    for r in ok:
        if r not in replayed:
            unreplayed.setdefault(r.get("replay_why") or "(no reason recorded)", []).append(
                r["name"]
            )
    if unreplayed:
        lines += ["## Not replayed, grouped by reason", "", "| reason | cases |", "|---|---|"]
        lines += [
            f"| {_cell(why)} | {len(names)}: {', '.join(sorted(names))} |"
            for why, names in sorted(unreplayed.items(), key=lambda kv: -len(kv[1]))
        ] + [""]
    if wrong:
        lines += ["## Wrong", "", "| case | max err | errors |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['max_err']:.2e} | {_errs(r)} |" for r in wrong] + [""]
    if crash:
        lines += ["## Crashes", "", "| case | stage | error |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r.get('stage')} | {_cell(r['error'])} |" for r in crash]
        lines += [""]
    if fell:
        lines += ["## Fallback, grouped by reason", ""]
        groups: dict[str, dict[str, list[dict]]] = {}
        vmaps: dict[str, dict[str, list[dict]]] = {}
        for r in fell:
            for p in r["fallback"]:
                key = _reason(p["note"], r.get("prefix", ""))
                groups.setdefault(key, {}).setdefault(r["name"], []).append(p)
                if _vmap(p["note"]):
                    vmaps.setdefault(_vmap(p["note"]), {}).setdefault(r["name"], []).append(p)
        for title_, group in (("", groups), ("### vmap failed (the loop ran), by error\n", vmaps)):
            lines += [title_] if title_ else []
            for reason, hit in sorted(group.items(), key=lambda kv: -len(kv[1])):
                n = sum(len(v) for v in hit.values())
                lines.append(f"- **{_cell(reason)}** — {len(hit)} cases, {n} tensors: " + ", ".join(
                    f"{c} ({_what(v)})" for c, v in sorted(hit.items())))  # fmt: skip
            lines += [""]
    if slow:
        lines += [
            "## Slower than the loop",
            "",
            "| case | gradscope s | loop s | floor s | fallback |",
        ]
        lines += ["|---|---|---|---|---|"]
        lines += [
            f"| {r['name']} | {r['t_gradscope']:.4f} | {r['t_loop']:.4f} | {r['t_floor']:.4f} "
            f"| {len(r['fallback'])} |"
            for r in sorted(slow, key=lambda r: r["speedup"])
        ] + [""]
    if skipped:
        lines += ["## Skipped", "", "| case | reason |", "|---|---|"]
        lines += [f"| {r['name']} | {_cell(r['reason'])} |" for r in skipped] + [""]
    return "\n".join(lines)


def _what(params: list[dict]) -> str:
    """How many tensors, and the module classes the notes name."""
    classes = sorted({m for p in params for m in re.findall(r"no rule for (\w+)", p["note"])})
    loop = sum(p["rule"] == "fallback:loop" for p in params)
    return f"{len(params)}" + (f" {'/'.join(classes)}" if classes else "") + (
        f", {loop} by loop" if loop else "")  # fmt: skip


def _errs(r: dict) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:240]


def _reason(note: str, prefix: str = "") -> str:
    """A note's first clause, the family's prefix of the class it names as ``*``: reasons that
    group across families (``MixtralExperts`` and ``Qwen3MoeExperts`` are ``*Experts``)."""
    first = note.split("; ")[0]
    return first.replace(f" {prefix}", " *") if prefix else first


def _vmap(note: str) -> str | None:
    """Why vmap failed, when it did (the parameter then ran in the per-example loop)."""
    hit = re.search(r"vmap failed: ([^;]*)", note)
    return re.sub(r"\d+", "N", hit.group(1).strip()[:160]) if hit else None
