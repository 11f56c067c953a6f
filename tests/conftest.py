"""Tests import the shared oracle, and the model families the benchmarks also use, as plain
modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
