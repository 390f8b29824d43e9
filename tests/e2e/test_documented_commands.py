"""Every command a recipe's header or a page of the docs shows works as written.

- Each ``rlbatch-train`` / ``rlbatch-plan`` / ``rlbatch-score`` command composes and validates
  (in process, the command's own scope): a documented command that stops with a configuration
  error (the grpo_code CPU twin's LCM error) fails here, naming the file and line. What is not
  on this machine is stood in for, each for a stated reason (``_stand_ins``).
- Each recipe's header commands run for real, shortened to one optimizer step, where a CPU can
  run them (a command whose keys another runnable command of the same recipe contains is run
  by that one: shared runs keep the CPU time modest); the docs' ``rlbatch-score`` commands run
  for real on canned completions, the http one against a real scorer on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from documented_commands import Command, documented_commands
from reward_servers import Scorer

COMMANDS = documented_commands(REPO)
HYDRA = ("rlbatch-train", "rlbatch-plan", "rlbatch-score")
SAMPLE = REPO / "tests" / "data" / "gsm8k_tiny.jsonl"
SHORT = ["trainer.max_steps=1", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", "logging.progress=false"]  # fmt: skip
"""What shortens a documented training run for CI: one optimizer step, no side outputs."""


def _expand(text: str) -> str:
    """The command with its ``$(...)`` substitutions run (``python`` is this interpreter)."""

    def run(m: re.Match) -> str:
        inner = re.sub(r"^python\b", sys.executable, m.group(1).strip())
        proc = subprocess.run(["bash", "-c", inner], capture_output=True, text=True, check=True)
        return proc.stdout.strip()

    return re.sub(r"\$\((.*?)\)", run, text)


def _overrides(command: Command) -> list[str]:
    """The command's KEY=VALUE overrides (a ``-m`` sweep at the first point of each sweep)."""
    words = Command(command.where, _expand(command.text)).argv[1:]
    sweep = "-m" in words
    out = []
    for w in words:
        if w.startswith("-") or "=" not in w:
            continue  # flags (--help, --cfg job, -m) and their arguments
        key, _, value = w.partition("=")
        if sweep and "," in value and not value.startswith("["):
            value = value.split(",")[0]
        out.append(f"{key}={value}")
    return out


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node0"}


def _stand_ins(overrides: list[str], cwd: Path) -> list[str]:
    """Overrides with what this machine lacks stood in for:

    - a dataset file (``data.path``, ``eval.data.path``, ``plan.lengths``, ``score.input``) that
      is not here: a small file of the same kind in the working directory (``null`` stays);
    - ``model.hf_path`` of a checkpoint or hub id that is not here: left out (the preset's
      architecture is validated instead of the checkpoint's);
    - a distillation teacher (``grpo.distill.teacher``) that is not here: a tiny random one
      (hf_reference.save_tiny_teacher) in the working directory;
    - ``trainer.resume`` of a run that has not happened, ``hydra/launcher`` and ``hydra.*``
      (where a run executes, not what it is): left out;
    - a multi-node command runs under SLURM, as its docs say: the validation sees a SLURM job's
      environment (:data:`SLURM`; a single-node command reads nothing of it).
    """
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") in ("model.hf_path", "trainer.resume") and not Path(value).exists():
            continue
        if key.startswith(("hydra/", "hydra.")):
            continue
        if key in ("data.path", "eval.data.path", "score.input") and value != "null" and not Path(value).exists():  # fmt: skip
            local = cwd / Path(value).name
            shutil.copy(SAMPLE, local)
            value = str(local)
        if key == "grpo.distill.teacher" and value != "null" and not Path(value).exists():
            from hf_reference import save_tiny_teacher

            local = cwd / "teacher"
            if not local.exists():
                save_tiny_teacher(local)
            value = str(local)
        if key == "plan.lengths" and not Path(value).exists():
            local = cwd / Path(value).name
            local.write_text(json.dumps([8, 16, 24, 32] * 16))
            value = str(local)
        out.append(f"{key}={value}")
    return out


def test_the_docs_and_recipes_show_commands_of_every_kind():
    names = {c.name for c in COMMANDS}
    assert {"rlbatch-train", "rlbatch-plan", "rlbatch-score"} <= names
    recipes = {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    launched = {
        c.where.split(":")[0].split("/")[-1][:-5] for c in COMMANDS if "recipes/" in c.where
    }
    assert launched == recipes  # every recipe's header shows its launch command
    twins = [c for c in COMMANDS if "recipes/grpo_code" in c.where and "model=tiny" in c.text]
    assert twins and "grpo.global_batch_size=16" in twins[0].text


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.name in HYDRA], ids=lambda c: c.where)
def test_every_documented_config_validates(command, tmp_path, monkeypatch):
    from rlbatch.cli.common import compose
    from rlbatch.cli.score import SCORE_SCOPE
    from rlbatch.config.validate import PLAN_SCOPE

    monkeypatch.chdir(tmp_path)
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    overrides = _stand_ins(_overrides(command), tmp_path)
    if command.name == "rlbatch-score":
        overrides = [o for o in overrides if not o.startswith("score.")]
    scope = {"rlbatch-plan": PLAN_SCOPE, "rlbatch-score": SCORE_SCOPE}.get(command.name)
    try:
        compose(overrides, command.name, scope)
    except SystemExit as exc:  # compose printed the errors
        raise AssertionError(f"{command.where}: {command.text!r} does not validate") from exc


def _runnable(command: Command) -> bool:
    """A training command a CPU runs as written: no checkpoint or hub model to load, at most
    two processes, one node."""
    keys = dict(o.partition("=")[::2] for o in _overrides(command))
    if "model.hf_path" in keys or keys.get("parallel.nnodes", "1") != "1":
        return False
    size = 1
    for k in ("parallel.dp", "parallel.tp", "parallel.pp"):
        size *= int(keys.get(k, "1"))
    return size <= 2


def _shared_runs() -> list[Command]:
    """The recipe header commands to run: runnable ones, each unless another runnable command
    (of any recipe's header: distill_qwen's shows how to train its teacher with grpo_qwen) has
    all its overrides (that run covers it). The test sets the run directory itself."""

    def own(c: Command) -> set[str]:
        return {o for o in _overrides(c) if not o.startswith("hydra.run.dir=")}

    runnable = [c for c in COMMANDS if "recipes/" in c.where and _runnable(c)]
    keep: list[Command] = []
    for c in runnable:
        mine = own(c)
        covered = any(mine < own(o) and o.name == c.name for o in runnable)
        if not covered and all(own(k) != mine or k.name != c.name for k in keep):
            keep.append(c)
    return keep


@pytest.mark.slow
@pytest.mark.parametrize("command", _shared_runs(), ids=lambda c: c.where)
def test_every_recipe_header_command_runs(command, bin_dir, subprocess_env, tmp_path):
    short = {o.partition("=")[0] for o in SHORT}
    own = [o for o in _overrides(command) if o.partition("=")[0] not in short]
    own = _stand_ins(own, tmp_path)  # e.g. a distillation recipe's teacher
    argv = [*own, *SHORT, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [str(bin_dir / command.name), *argv],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{command.where}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(r)["step"] for r in records if "loss" in json.loads(r)]
    assert steps == [1]  # (a recipe that evaluates adds a step-0 evaluation record)


ANSWERS = [
    {"prompt": "Print the sum of two integers read on one line.", "answer": "",
     "tests": [{"input": "1 2\n", "output": "3\n"}],
     "completion": "```python\na, b = map(int, input().split())\nprint(a + b)\n```"},
    {"prompt": "Print 5.", "answer": "", "tests": [{"input": "", "output": "5\n"}],
     "completion": "print(6)"},
]  # fmt: skip
"""The canned completions the docs' rlbatch-score commands read as answers.jsonl."""


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.name == "rlbatch-score"], ids=lambda c: c.where
)
def test_every_documented_score_command_runs(command, bin_dir, subprocess_env, tmp_path):
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ANSWERS))
    with Scorer() as server:
        argv = [re.sub(r"^data\.reward_url=http://[^/]+", f"data.reward_url={server.url}", o)
                for o in _overrides(command)]  # fmt: skip
        proc = subprocess.run(
            [str(bin_dir / command.name), *argv],
            capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, f"{command.where}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
    output = [o.partition("=")[2] for o in argv if o.startswith("score.output=")][0]
    out = [json.loads(x) for x in (tmp_path / output).read_text().splitlines()]
    assert len(out) == len(ANSWERS)
    if "code_exec" in json.dumps(argv) or "grpo_code" in command.text:
        assert [r["reward"] for r in out] == [1.0, 0.0]
    assert os.path.exists(tmp_path / output)
