"""rlbatch-train: compose and validate the config with Hydra, then hand over to the driver.

    rlbatch-train +recipe=grpo_qwen trainer.max_steps=200 parallel.pp=2
    rlbatch-train -m +recipe=grpo_qwen batching.train.max_tokens=512,1024

Hydra runs here once (one job per multirun point); each job launches fresh torchrun workers.
No torch at module level.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlbatch.cli.common import check_override_keys, fail_config, help_text, to_validated_run_config
from rlbatch.config.errors import ConfigErrors
from rlbatch.config.store import conf_dir, register_configs

USAGE = "GRPO training on megatron-core. rlbatch-train [+recipe=NAME] [KEY=VALUE ...] [-m]"
HYDRA_FLAGS = (
    "Hydra flags: -m/--multirun (sweeps: KEY=a,b), --cfg job (print the composed config),\n"
    "--info, --hydra-help. Run directory: outputs/<date>/<time>-<id>/, or outputs/<run_id>/ with\n"
    "parallel.run_id (multi-node: every node shares it) (multirun: multirun/...)."
)
TRAIN_ENTRY = "rlbatch.train.build:run"


JOBS: list[tuple[str, str, str, int]] = []
"""Multirun jobs run in this process: (number, overrides, run directory, exit code)."""


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_process = "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    again = resume_command(list(hydra_cfg.overrides.task), run_dir)
    if hydra_cfg.mode != RunMode.MULTIRUN or not in_process:  # other launchers report jobs
        code = _run(cfg, run_dir, again)
        if code:
            sys.exit(code)
        return
    try:  # a failing job does not stop the sweep; main() reports every job at the end
        code = _run(cfg, run_dir, again)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except Exception as err:  # noqa: BLE001 - reported in the table, the sweep goes on
        print(
            f"rlbatch-train: job {hydra_cfg.job.num}: {type(err).__name__}: {err}", file=sys.stderr
        )
        code = 1
    overrides = " ".join(hydra_cfg.overrides.task)
    JOBS.append((str(hydra_cfg.job.num), overrides, str(run_dir), code))


def resume_command(overrides: list[str], run_dir: Path) -> str:
    """The command line that continues the run in ``run_dir``: the job's own overrides (a
    multirun job's, not the sweep's), its run directory, and trainer.resume=auto (which alone,
    in a newly generated run directory, would start a fresh run), from the launch directory
    (relative paths among the overrides stay valid)."""
    import os
    import shlex

    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "trainer.resume"]
    again = ["rlbatch-train", *kept, f"hydra.run.dir={run_dir.resolve()}", "trainer.resume=auto"]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(again)}"


def _run(cfg, run_dir: Path, again: str) -> int:
    from rlbatch.grpo.preflight import check_before_launch
    from rlbatch.runtime.driver import launch

    run_cfg = to_validated_run_config(cfg, "rlbatch-train", extra=check_before_launch)
    identity = _teacher_identity(run_cfg, run_dir)
    _check_resume(run_cfg, run_dir, identity)
    return launch(run_cfg, run_dir, entry=TRAIN_ENTRY, resume_command=again)


def _teacher_identity(run_cfg, run_dir: Path):
    """What the distillation teacher is (rlbatch.grpo.teacher_identity), handed to the trainer
    for its checkpoints' meta.json; None without a teacher."""
    from rlbatch.config.distill import distill_on

    if not distill_on(run_cfg):
        return None
    from rlbatch.grpo.teacher_identity import teacher_identity, write_identity

    identity = teacher_identity(run_cfg)
    write_identity(run_dir, identity)
    return identity


TEACHER_KEYS = ("grpo.distill.teacher", "grpo.distill.teacher_url")
"""Where the teacher lives: may change on resume when the checkpoint records the teacher's
identity and this launch's teacher has the same one."""


def _check_resume(run_cfg, run_dir: Path, identity=None) -> None:
    """Before launch: the checkpoint trainer.resume picks is intact by its manifest (else the
    error lists every checkpoint and why), and the config may resume it (rlbatch.config.
    resume_check): every refused change is an error; the accepted ones are listed. The
    teacher is compared by its identity (``identity``, rlbatch.grpo.teacher_identity) when the
    checkpoint recorded one, not by the spelling of its path or URL."""
    from rlbatch.cli.common import fail_config
    from rlbatch.config.errors import ConfigError, ConfigErrors
    from rlbatch.config.resume_check import check_resume
    from rlbatch.train.integrity import NoIntactCheckpointError, resume_candidates

    if run_cfg.trainer.resume in ("none", ""):
        return
    root = Path(run_cfg.trainer.checkpoint.dir or run_dir / "checkpoints")
    try:
        candidates, _ = resume_candidates(run_cfg.trainer.resume, root)
    except (NoIntactCheckpointError, FileNotFoundError) as err:
        fail_config(
            ConfigErrors([ConfigError("trainer.resume", run_cfg.trainer.resume, str(err))]),
            "rlbatch-train",
        )
    if not candidates:
        return
    errors, notes = check_resume(run_cfg, candidates[0])
    from rlbatch.grpo.teacher_identity import identity_errors, saved_identity

    saved = saved_identity(candidates[0])
    if saved is not None:
        moved = [e for e in errors if e.key in TEACHER_KEYS]
        errors = [e for e in errors if e.key not in TEACHER_KEYS]
        errors += identity_errors(run_cfg, saved, identity, candidates[0])
        notes += [f"{e.key}: -> {e.value!r} (the same teacher)" for e in moved]
    if errors:
        fail_config(ConfigErrors(errors), "rlbatch-train")
    if notes:
        print(
            f"rlbatch-train: resuming {candidates[0]} with changes: " + "; ".join(notes),
            file=sys.stderr,
        )


def _report_sweep() -> int:
    """The table of every multirun job (status, run directory); 1 if any failed."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rlbatch-train multirun")
    for column in ("job", "overrides", "status", "run directory"):
        table.add_column(column)
    for num, overrides, run_dir, code in JOBS:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        table.add_row(num, overrides, status, run_dir, style=None if code == 0 else "red")
    console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 240)
    console.print(table, markup=False)
    failed = [num for num, _, _, code in JOBS if code]
    if failed:
        console.print(
            f"{len(failed)} of {len(JOBS)} job(s) failed: {', '.join(failed)}", markup=False
        )
    return 1 if failed else 0


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(help_text("rlbatch-train", USAGE, HYDRA_FLAGS))
        return
    unknown = check_override_keys(sys.argv[1:])
    if unknown:
        fail_config(ConfigErrors(unknown), "rlbatch-train")
    import hydra

    register_configs()
    app = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)
    app()
    if JOBS:
        sys.exit(_report_sweep())


if __name__ == "__main__":
    main()
