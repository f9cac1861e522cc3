"""README's test command is the one CI runs, and it has exactly the two Quick start commands."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = ROOT.joinpath("README.md").read_text()
    quick_start = readme.split("## Quick start")[1].split("\n## ")[0]
    commands = [line.strip() for line in quick_start.splitlines() if line.startswith("    ")]
    assert len(commands) == 2
    assert commands[0].endswith("python -m coalesced_int4 demo")
    assert commands[1] in ROOT.joinpath(".ci/run").read_text().splitlines()
