"""Training the configured model by its ``train`` recipe: ``gradscope train``, and the retrains
that ``gradscope validate`` measures scores against (``fit``)."""

from .loop import fit, recipe

__all__ = ["fit", "recipe"]
