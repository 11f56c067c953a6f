"""A tiny GPT-2 trained by the Hugging Face Trainer with gradscope's watch: every example's
loss, gradient norm and margin at every step, in watch.parquet."""

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradscope.training.watch_hf import WatchCallback

torch.set_num_threads(1)
torch.manual_seed(0)
# GPT-2's dropout (0.1) stays on: each step's passes under the watch draw the same masks
config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
tokens = torch.randint(0, 32, (24, 12))
tokens[::4] = tokens[0]  # every fourth row the same sentence: easy to learn
data = Dataset.from_dict(
    {"input_ids": tokens.tolist(), "labels": tokens.tolist(), "example_id": list(range(24))}
)
args = TrainingArguments(
    "trainer-out",
    per_device_train_batch_size=8,
    num_train_epochs=4,
    learning_rate=3e-3,
    remove_unused_columns=False,  # the example_id column reaches the model's call
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
    use_cpu=True,
)
trainer = Trainer(model, args, train_dataset=data, callbacks=[WatchCallback("watch.parquet")])
trainer.train()
