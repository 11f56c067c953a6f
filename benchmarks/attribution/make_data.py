"""Build the attribution benchmark's data files in data/ from data that ships with the repository.

    python benchmarks/attribution/make_data.py

- digits_train.pt, digits_ref.pt: the first 1000 rows of examples/digits/digits.pt with their
  true labels (the flipped ones undone) and the first 100 rows of digits_ref.pt: x (B, 64) in
  [0, 1], y (B,) class ids.
- diabetes_train.pt, diabetes_ref.pt: scikit-learn's diabetes table (data/diabetes.npz, from
  export_diabetes.py) shuffled, 342 training rows and 100 references; features and target
  standardised with the training rows' mean and deviation: x (B, 10), y (B, 1).
- lm_train.parquet, lm_ref.parquet: lines of Python's documentation (pydoc_data, as
  examples/lm/make_data.py reads them) that examples/lm/data does not hold, tokenized with
  examples/lm/tokenizer, 20 to 40 tokens after a leading <|endoftext|>: 256 training rows and
  64 references, columns input_ids, attention_mask, labels, text.
"""

import random
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DATA = HERE / "data"
SEED = 0
DIGITS_TRAIN, DIGITS_REF = 1000, 100
DIABETES_REF = 100
LM_TRAIN, LM_REF = 256, 64
MIN_TOKENS, MAX_TOKENS = 20, 40


def digits() -> None:
    train = torch.load(ROOT / "examples/digits/digits.pt", weights_only=True)
    ref = torch.load(ROOT / "examples/digits/digits_ref.pt", weights_only=True)
    x, y = train["x"][:DIGITS_TRAIN].clone(), train["y_true"][:DIGITS_TRAIN].clone()
    torch.save({"x": x, "y": y}, DATA / "digits_train.pt")
    torch.save(
        {"x": ref["x"][:DIGITS_REF].clone(), "y": ref["y"][:DIGITS_REF].clone()},
        DATA / "digits_ref.pt",
    )


def diabetes() -> None:
    table = np.load(DATA / "diabetes.npz")
    order = np.random.default_rng(SEED).permutation(len(table["y"]))
    x, y = table["x"][order], table["y"][order, None]  # (442, 10), (442, 1)
    n = len(y) - DIABETES_REF
    x = (x - x[:n].mean(0)) / x[:n].std(0)
    y = (y - y[:n].mean(0)) / y[:n].std(0)
    for name, rows in (("train", slice(0, n)), ("ref", slice(n, None))):
        part = {"x": torch.tensor(x[rows], dtype=torch.float32)}
        torch.save(part | {"y": torch.tensor(y[rows], dtype=torch.float32)}, DATA / f"diabetes_{name}.pt")  # fmt: skip


def lm() -> None:
    sys.path.insert(0, str(ROOT / "examples/lm"))
    from make_data import doc_lines

    seen = set(datasets.load_from_disk(ROOT / "examples/lm/data")["text"])
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples/lm/tokenizer")
    lines = [line for line in doc_lines() if line not in seen]
    random.Random(SEED).shuffle(lines)
    rows = []
    for line, ids in zip(lines, tokenizer(lines)["input_ids"], strict=True):
        if MIN_TOKENS <= len(ids) <= MAX_TOKENS and tokenizer.decode(ids) not in seen:
            ids = [tokenizer.eos_token_id, *ids]
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids, "text": line})  # fmt: skip
        if len(rows) == LM_TRAIN + LM_REF:
            break
    for name, part in (("train", rows[:LM_TRAIN]), ("ref", rows[LM_TRAIN:])):
        pq.write_table(pa.Table.from_pylist(part), DATA / f"lm_{name}.parquet")


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    digits()
    diabetes()
    lm()
    print("\n".join(f"{p.name} {p.stat().st_size}" for p in sorted(DATA.iterdir())))
