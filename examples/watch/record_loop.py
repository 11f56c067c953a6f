"""The digits MLP trained by a loop of your own under the watch, which also writes the run
record: watch.parquet (every example's loss, gradient norm and margin at every step) and
digits-loop.run, which ``gradscope influence configs/digits.yaml --through-training
digits-loop.run`` replays."""

import runpy
from pathlib import Path

import torch

from gradscope.training.watch import Watch

DIGITS = Path(__file__).resolve().parents[1] / "digits"
DigitsMLP = runpy.run_path(str(DIGITS / "model.py"))["DigitsMLP"]  # configs/digits.yaml's model

torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.load(DIGITS / "digits.pt", weights_only=True)  # configs/digits.yaml's data
x, y = data["x"], data["y"]
model = DigitsMLP(hidden=64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=36)
order = torch.Generator().manual_seed(0)
with Watch(model, "watch.parquet", "cross_entropy", record="digits-loop.run",
           optimizer=optimizer, clip=1.0) as watch:  # fmt: skip
    for epoch in range(3):
        for ids in torch.randperm(len(y), generator=order).split(128):  # positions in digits.pt
            optimizer.zero_grad()
            watch.step(x[ids], y[ids], ids, epoch=epoch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
print(f"{watch.steps} steps; wrote watch.parquet and digits-loop.run")
