"""The main job, ``python -m coalesced_int4 demo``, runs end to end and prints its report."""

import subprocess
import sys


def test_demo_runs_and_reports():
    result = subprocess.run(
        [sys.executable, "-m", "coalesced_int4", "demo", "--tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("quantized: 9 linear weights quantized", "reloaded from meta device: logits bit-identical",
                     "logits vs bf16: top-1 agreement", "linear path:", "tokens/s: int4 compiled"):
        assert expected in out, out
