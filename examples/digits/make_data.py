"""Build digits.pt (1500 rows, 10% flipped labels) and digits_ref.pt (297 clean rows).

Run once with a venv that has scikit-learn; it is the only file that needs it.
"""

from pathlib import Path

import torch
from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent
SEED = 0
N_TRAIN = 1500
N_FLIP = 150
N_CLASSES = 10


def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)

    gen = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(len(x), generator=gen)
    x, y = x[perm], y[perm]
    # Clone so each file stores only its own rows, not the shared full storage.
    x_train, y_true = x[:N_TRAIN].clone(), y[:N_TRAIN].clone()
    x_ref, y_ref = x[N_TRAIN:].clone(), y[N_TRAIN:].clone()

    flip_idx = torch.randperm(N_TRAIN, generator=gen)[:N_FLIP].sort().values
    # An offset in 1..9 (mod 10) picks uniformly among the 9 wrong classes.
    offset = torch.randint(1, N_CLASSES, (N_FLIP,), generator=gen)
    y_noisy = y_true.clone()
    y_noisy[flip_idx] = (y_true[flip_idx] + offset) % N_CLASSES
    flipped = torch.zeros(N_TRAIN, dtype=torch.bool)
    flipped[flip_idx] = True

    torch.save(
        {"x": x_train, "y": y_noisy, "y_true": y_true, "flipped": flipped},
        HERE / "digits.pt",
    )
    torch.save({"x": x_ref, "y": y_ref}, HERE / "digits_ref.pt")
    (HERE / "flipped.txt").write_text("".join(f"{i}\n" for i in flip_idx.tolist()))
    print(f"train {tuple(x_train.shape)}, ref {tuple(x_ref.shape)}, flipped {N_FLIP}")


if __name__ == "__main__":
    main()
