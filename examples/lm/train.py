"""Train a tiny GPT-2 on the tokenized lines (planted rows included) and save it with save_pretrained.

About a minute on two CPU cores. Writes ``model/`` (config.json, model.safetensors) and the
optimizer's state, ``lm_adam.pt`` (for ``--precondition``).
"""

import shutil
import time
from pathlib import Path

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).resolve().parent
SEED = 0
EPOCHS = 8
BATCH_SIZE = 32
LR = 3e-3
CONFIG = {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}


def padded(rows: list[list[int]], value: int) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (longest - len(r)) for r in rows])


def main() -> None:
    start = time.perf_counter()
    torch.set_num_threads(1)  # a fixed order of float reductions: reruns are bit-identical
    torch.manual_seed(SEED)
    data = datasets.load_from_disk(HERE / "data")
    ids, eos = list(data["input_ids"]), 0  # <|endoftext|> is token 0 of the tokenizer
    config = GPT2Config(**CONFIG, bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    steps = EPOCHS * -(-len(ids) // BATCH_SIZE)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(1, EPOCHS + 1):
        model.train()
        total = 0.0
        for idx in torch.randperm(len(ids), generator=gen).split(BATCH_SIZE):
            batch = [ids[i] for i in idx.tolist()]
            out = model(
                input_ids=padded(batch, eos),
                attention_mask=padded([[1] * len(r) for r in batch], 0),
                labels=padded(batch, -100),
            )
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            sched.step()
            total += out.loss.item() * len(idx)
        print(
            f"epoch {epoch}: mean loss {total / len(ids):.3f} ({time.perf_counter() - start:.0f} s)"
        )
    model.eval()
    shutil.rmtree(HERE / "model", ignore_errors=True)
    model.save_pretrained(HERE / "model")
    torch.save(opt.state_dict(), HERE / "lm_adam.pt")
    print(f"saved {HERE / 'model'} ({sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
