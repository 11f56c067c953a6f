"""What a run computes for each batch: the norms and influence scorers, behind one protocol."""

from .base import Inputs, Scorer
from .influence import InfluenceScorer
from .norms import NormsScorer

__all__ = ["Inputs", "InfluenceScorer", "NormsScorer", "Scorer"]
