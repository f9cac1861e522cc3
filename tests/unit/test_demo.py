"""The main job, ``python -m coalesced_int4 demo``: SmolLM2 quantized at load, saved, reloaded
bit for bit, and still knowing its facts."""

import subprocess
import sys


def test_demo_runs_on_smollm2_and_reports():
    result = subprocess.run(
        [sys.executable, "-m", "coalesced_int4", "demo", "--tokens", "6"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("quantized at load: 210 of 211 linear weights", "from_pretrained: ",
                     "logits bit-identical", "next-token top-1 agreement with bf16", "linear path:",
                     "int4: The capital of Germany is Berlin", "tokens/s"):
        assert expected in out, out
