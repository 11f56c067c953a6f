"""Memory per process of `distributed.shard: fsdp` against whole-model ranks (README, Large runs).

    python benchmarks/fsdp_memory.py make /tmp/fsdp        # a 160M GPT-2 folder, data, 2 configs
    export MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072 OMP_NUM_THREADS=1
    torchrun --nproc-per-node 2 --standalone benchmarks/fsdp_memory.py /tmp/fsdp/plain.yaml
    torchrun --nproc-per-node 2 --standalone benchmarks/fsdp_memory.py /tmp/fsdp/fsdp.yaml

Each process prints the parameter bytes it holds, its resident memory after its first batch, and
the peak over its later batches (Linux: VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def status(key: str) -> float:
    """MiB of ``key`` (VmRSS, VmHWM) in /proc/self/status."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) / 1024


def make(root: Path) -> None:
    import torch
    import transformers
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=1024, n_layer=12, n_head=16
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    torch.save({"ids": torch.randint(0, 8192, (24, 64))}, root / "data.pt")
    for name, shard in (("plain", None), ("fsdp", "fsdp")):
        raw = {
            "model": {"factory": "transformers:GPT2LMHeadModel", "pretrained": "gpt2"},
            "data": {"path": "data.pt", "inputs": "ids", "targets": "ids", "batch_size": 4},
            "loss": {"name": "causal_lm"},
            "device": "cpu",
            "dtype": "float32",
            "distributed": {"shard": shard},
            "output": {"path": f"{name}.parquet"},
        }
        (root / f"{name}.yaml").write_text(yaml.safe_dump(raw))


def measure(config: str) -> None:
    from gradscope import distributed
    from gradscope.config import load_config
    from gradscope.run import score_dataset
    from gradscope.scorers import NormsScorer

    class Measured(NormsScorer):
        batches = 0

        def setup(self, job) -> None:
            super().setup(job)
            self.loading = status("VmHWM")
            local = [p.to_local() if hasattr(p, "to_local") else p for p in job.model.parameters()]
            self.params = sum(t.numel() * t.element_size() for t in local) / 2**20

        def columns(self, job, batch):
            columns = super().columns(job, batch)
            self.batches += 1
            if self.batches == 1:  # decisions made: from here on every batch is alike
                self.first = status("VmRSS")
                Path("/proc/self/clear_refs").write_text("5")
            return columns

        def __exit__(self, *exc) -> None:
            print(
                f"rank {distributed.world().rank}: parameters held {self.params:.0f} MiB; "
                f"resident after the first batch {self.first:.0f} MiB; peak over the later "
                f"batches {status('VmHWM'):.0f} MiB; peak before scoring {self.loading:.0f} MiB",
                flush=True,
            )
            super().__exit__(*exc)

    score_dataset(load_config(config), Measured())


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        measure(sys.argv[1])
