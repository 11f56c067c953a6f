"""The most bytes of tensors an op sequence creates and holds at once, read op by op."""

from __future__ import annotations

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewBytes(TorchDispatchMode):
    """The most bytes of storage created inside it and alive at once, read after every op."""

    def __init__(self, old: list[Tensor]):
        super().__init__()
        self.old = {t.untyped_storage().data_ptr() for t in old}
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t._is_zerotensor():  # autograd's zeros: no storage
                continue
            if t.untyped_storage().data_ptr() not in self.old:
                storage = t.untyped_storage()
                self.made.setdefault(
                    storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes())
                )
        self.peak = max(self.peak, sum(n for r, n in self.made.values() if not r.expired()))
        return out
