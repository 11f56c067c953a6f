"""Sweep the watch under the Hugging Face ``Trainer`` over every model type of the installed
``transformers`` that ``hf_tiny`` builds with a causal LM, a sequence, an image or an audio
classifier head: tiny config, float64 (``--float32``: float32, mixtures of experts on
transformers' ``grouped_mm`` rather than the loop over experts float64 needs), dropout 0.1
wherever the config has a rate (stochastic depth's, ``drop_path_rate``, included), SpecAugment's time masks where it has them (spans of 2), twelve
rows: of 3 to 8 tokens, padded to each batch's longest (some batches pad nothing, so a replay
meets the branch transformers reads on the mask), or an image's or a sound's main input
(``hf_tiny.main_input``); two epochs of SGD. Each family trains twice, with ``WatchCallback``
and without; the watched run must end at the plain run's weights and buffers.

    PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks OMP_NUM_THREADS=1 \\
        python benchmarks/watch_sweep.py [--only gpt2,bert] [--float32] [--timeout 120] \\
        [--out PATH]

Writes ``PATH`` (JSON) and a markdown table beside it (``.md``). Statuses: ``same`` (the
largest difference within 1e-6 of the largest weight: float32's rounding, both runs', ordered
differently; a float64 model may compute in float32 inside, as transformers' loss of a causal
LM's logits and OLMo's and Gemma's norms do), ``differs`` (a watched run that trained
otherwise: the bug this sweep is for), ``refused`` (a gradscope error, one line), ``failed``
(another error, the model's or this script's), ``skipped`` (a type ``hf_tiny`` builds with
none of the four heads, one that does not train without the watch, or not within
``--timeout``).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import tempfile
import time
import warnings
from pathlib import Path

import hf_tiny
import torch
from project import trainer_args  # tests/ is on the path, as for sweep.py's oracle

from gradscope.errors import GradscopeError

OUT = Path(__file__).parent / "results" / "watch-sweep.json"
HEADS = {
    "AutoModelForCausalLM": "lm",
    "AutoModelForSequenceClassification": "sequence",
    "AutoModelForImageClassification": "image",
    "AutoModelForAudioClassification": "audio",
}
LENGTHS = [8, 8, 8, 8, 8, 8, 3, 5, 8, 8, 8, 8]
SAME = 1e-6  # the largest weight difference, relative to the largest weight, of a run alike


def _rows(kind: str, model: torch.nn.Module, config) -> list[dict]:
    """Twelve rows: token ids of 3 to 8 tokens, or an image's or a sound's main input."""
    if kind in ("image", "audio"):
        name = model.main_input_name
        g = torch.Generator().manual_seed(1)
        values = hf_tiny.main_input(name, model, config, g, len(LENGTHS))[name]
        return [{name: v.tolist(), "labels": i % 3, "example_id": i} for i, v in enumerate(values)]
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = [(i * 3 + t) % 40 + 5 for t in range(n)]
        rows.append({"input_ids": ids, "labels": ids if kind == "lm" else i % 3, "example_id": i})
    return rows


def _collate(rows: list[dict], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Token ids padded to the batch's longest row, a language model's padding labels -100;
    another main input stacked, in the model's dtype."""
    example = torch.tensor([r["example_id"] for r in rows])
    if "input_ids" not in rows[0]:
        name = next(k for k in rows[0] if k not in ("labels", "example_id"))
        values = torch.tensor([r[name] for r in rows], dtype=dtype)
        return {name: values, "labels": torch.tensor([r["labels"] for r in rows]),
                "example_id": example}  # fmt: skip
    longest, b = max(len(r["input_ids"]) for r in rows), len(rows)
    ids, mask = torch.zeros(b, longest, dtype=torch.long), torch.zeros(b, longest, dtype=torch.long)
    tokens = isinstance(rows[0]["labels"], list)
    labels = torch.full((b, longest), -100) if tokens else torch.tensor([r["labels"] for r in rows])
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), 1
        if tokens:
            labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "example_id": example}


def _config(model_type: str):
    config = hf_tiny.tiny_config(model_type)
    for key, value in config.to_dict().items():
        rate = "dropout" in key or key.endswith("_pdrop") or "drop_path" in key
        rate = rate or "drop_connect" in key  # stochastic depth's, a layer's output dropped
        if rate and isinstance(value, float) and "layerdrop" not in key:
            setattr(config, key, 0.1)
    config.pad_token_id = 0
    if getattr(config, "mask_time_length", 0) > 2:  # SpecAugment's spans, within tiny sounds
        config.mask_time_length = 2
    return config


def _train(
    model_type: str, auto: str, out: Path, watched: bool, dtype: torch.dtype
) -> torch.nn.Module:
    import datasets
    import transformers

    from gradscope.training.watch_hf import WatchCallback

    torch.manual_seed(0)  # float64's experts run eagerly (grouped_mm takes no float64)
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    config = _config(model_type)
    model = getattr(transformers, auto).from_config(config, **experts)
    args = trainer_args(
        str(out / "trainer"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, optim="sgd", seed=0,
    )  # fmt: skip
    data = datasets.Dataset.from_list(_rows(HEADS[auto], model, config))
    callbacks = [WatchCallback(out / "watch.parquet")] if watched else []
    collate = functools.partial(_collate, dtype=dtype)
    trainer = transformers.Trainer(
        model.to(dtype), args, train_dataset=data, data_collator=collate, callbacks=callbacks
    )
    trainer.train()
    return model


def run_one(model_type: str, dtype: torch.dtype = torch.float64) -> dict:
    head = hf_tiny.head(model_type)
    if head is None or head[0] not in HEADS:
        return {"status": "skipped", "note": "no causal LM or classifier head"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        try:
            plain = _train(model_type, head[0], Path(folder), False, dtype)
        except Exception as e:
            return {"status": "skipped", "note": f"trains not without the watch: {e}"[:300]}
        try:
            watched = _train(model_type, head[0], Path(folder), True, dtype)
        except GradscopeError as e:
            return {"status": "refused", "note": str(e)[:300], "head": head[0]}
        except Exception as e:
            return {"status": "failed", "note": f"{type(e).__name__}: {e}"[:300], "head": head[0]}
    mine = watched.state_dict()  # the weights and the buffers
    pairs = [(value, mine[name]) for name, value in plain.state_dict().items()]
    floats = [(p.double(), q.double()) for p, q in pairs if p.is_floating_point()]
    apart = max((p - q).abs().max().item() for p, q in floats)
    scale = max(p.abs().max().item() for p, _ in floats)
    counts = all(torch.equal(p, q) for p, q in pairs if not p.is_floating_point())
    status = "same" if apart <= SAME * scale and counts else "differs"
    seconds = round(time.perf_counter() - started, 1)
    return {"status": status, "apart": apart, "scale": scale, "head": head[0], "seconds": seconds}


class _Late(BaseException):
    """A family past ``--timeout`` (not an Exception: ``run_one`` must not take it for its own)."""


def _late(*_: object) -> None:
    raise _Late


def _timed(model_type: str, seconds: int, dtype: torch.dtype) -> dict:
    """``run_one`` stopped after ``seconds`` (a config hf_tiny leaves large: Perceiver's)."""
    signal.signal(signal.SIGALRM, _late)
    signal.alarm(seconds)
    try:
        return run_one(model_type, dtype)
    except _Late:
        return {"status": "skipped", "note": f"not done in {seconds} s"}
    finally:
        signal.alarm(0)


def _table(results: dict[str, dict]) -> str:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = ["# The watch under the Trainer, by model type", ""]
    lines += [", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    lines += ["| type | head | status | weights apart / largest | note |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if r["status"] == "skipped":
            continue
        ratio = f"{r['apart'] / r['scale']:.1e}" if "apart" in r else ""
        note = r.get("note", "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {r.get('head', '')} | {r['status']} | {ratio} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per family")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--float32", action="store_true",
                        help="float32 models, mixtures of experts on transformers' grouped_mm")  # fmt: skip
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    names = args.only.split(",") if args.only else hf_tiny.model_types()
    results = {}
    for name in names:
        results[name] = _timed(name, args.timeout, torch.float32 if args.float32 else torch.float64)
        if results[name]["status"] != "skipped":
            print(name, results[name]["status"], results[name].get("note", ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    table = _table(results)
    args.out.with_suffix(".md").write_text(table)
    print(table.splitlines()[2])


if __name__ == "__main__":
    main()
