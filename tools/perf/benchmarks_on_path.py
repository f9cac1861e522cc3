"""Imported for its effect: puts the repository's ``benchmarks/`` folder on ``sys.path``, so the
instruments here reuse the user-facing benchmarks' timing and weight helpers by module name."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
