"""The default suite's session setup (interpreter without a GPU, private pick store) for the
instruments' tests, which run apart: ``python -m pytest tools/perf/tests``."""

from tests.conftest import private_autotune_cache  # noqa: F401  (importing it sets the environment)
