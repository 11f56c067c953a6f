"""Lines of Python's own documentation as a tokenized dataset, with planted duplicates and corruptions.

Writes ``tokenizer/`` (a byte-level BPE trained on the text, loadable with AutoTokenizer) and
``data/`` (a ``datasets`` save_to_disk folder: input_ids, attention_mask, labels, text, kind).
``kind`` says what each row is: ``clean``, ``duplicate`` (one of DUP_LINES lines, each copied
DUP_COPIES times) or ``corrupted`` (a line with its tokens shuffled, or random characters).
Every row holds MIN_TOKENS to MAX_TOKENS tokens: a per-example gradient norm of a mean over
tokens shrinks as rows get longer, and a narrow band keeps that from ranking rows by length.
No download: the text is ``pydoc_data.topics``, which ships with Python.
"""

import random
import shutil
from pathlib import Path
from pydoc_data.topics import topics

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
SEED = 0
VOCAB = 512
MIN_TOKENS, MAX_TOKENS = 20, 40  # per row, before the leading <|endoftext|>
CLEAN = 2000
DUP_LINES, DUP_COPIES = 5, 16
SHUFFLED, RANDOM = 20, 20
EOT = "<|endoftext|>"


def doc_lines() -> list[str]:
    """Distinct lines of prose and code, 30 to 160 characters, in a fixed order."""
    lines = {line.strip() for text in topics.values() for line in text.splitlines()}
    return sorted(line for line in lines if 30 <= len(line) <= 160)


def train_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT)


def rows(lines: list[str], tokenizer: PreTrainedTokenizerFast, rng: random.Random) -> list[dict]:
    """Clean lines, then the planted ones, shuffled together; ids start with <|endoftext|>."""
    tokens = [ids for ids in tokenizer(lines)["input_ids"] if MIN_TOKENS <= len(ids) <= MAX_TOKENS]
    clean, dup_source = tokens[:CLEAN], tokens[CLEAN : CLEAN + DUP_LINES]
    made = [(ids, "clean") for ids in clean]
    made += [(ids, "duplicate") for ids in dup_source for _ in range(DUP_COPIES)]
    for ids in tokens[CLEAN + DUP_LINES : CLEAN + DUP_LINES + SHUFFLED]:
        made.append((rng.sample(ids, len(ids)), "corrupted"))
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ()[]{}:;.,=+-*/_'\""
    for _ in range(RANDOM):
        ids = tokenizer("".join(rng.choices(alphabet, k=200)))["input_ids"]
        made.append((ids[: rng.randint(MIN_TOKENS, MAX_TOKENS)], "corrupted"))
    rng.shuffle(made)
    out = []
    for ids, kind in made:
        ids = [tokenizer.eos_token_id, *ids]
        out.append(
            {
                "input_ids": ids,
                "attention_mask": [1] * len(ids),
                "labels": ids,
                "text": tokenizer.decode(ids[1:]),
                "kind": kind,
            }
        )
    return out


def main() -> None:
    rng = random.Random(SEED)
    lines = doc_lines()
    rng.shuffle(lines)
    tokenizer = train_tokenizer(lines)
    shutil.rmtree(HERE / "tokenizer", ignore_errors=True)
    tokenizer.save_pretrained(HERE / "tokenizer")
    table = rows(lines, tokenizer, rng)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "text": datasets.Value("string"),
            "kind": datasets.Value("string"),
        }
    )
    data = datasets.Dataset.from_list(table, features=features)
    shutil.rmtree(HERE / "data", ignore_errors=True)
    data.save_to_disk(HERE / "data")
    kinds = {k: sum(r["kind"] == k for r in table) for k in ("clean", "duplicate", "corrupted")}
    tokens = sum(len(r["input_ids"]) for r in table)
    print(f"{len(lines)} distinct lines; {len(table)} rows {kinds}; {tokens} tokens")


if __name__ == "__main__":
    main()
