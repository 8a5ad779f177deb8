"""CI runs README.md's commands, not its own: every install and test command of .ci/run, with each leg's
extras filled in, is a line of README.md's code blocks (pip's --quiet aside)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return {line for line in lines if line}


def ci_commands():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    body = text[text.index("leg() {"):text.index("\n}\n")]
    legs = re.findall(r"^leg (\S+) (\S+)$", text, re.M)   # python, extras
    assert len(legs) == 2, legs
    commands = [line.strip() for line in body.splitlines()
                if line.strip().startswith(("pip install", "python -m pytest"))]
    assert len(commands) == 3, commands
    return {command.replace(" --quiet", "").replace("$extras", extras)
            for _, extras in legs for command in commands}


def test_ci_runs_the_readme_commands():
    missing = ci_commands() - readme_commands()
    assert not missing, f".ci/run runs commands README.md does not show: {sorted(missing)}"


def test_ci_has_a_python_312_leg_with_megatron():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r'^leg "\$PY312" \S*megatron', text, re.M) and re.search(r"^PY312=\$\(python312\)$", text, re.M)
