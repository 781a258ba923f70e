"""The README's two set-up commands stay at its top, and CI runs the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_two_setup_commands_first():
    commands = readme_commands()
    assert len(commands) >= 2
    run, test = commands[:2]
    assert "pip install" in run and "specdecode" in run
    assert "pip install" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
