"""rlbatch-train: compose and validate the config with Hydra, then hand over to the driver.

    rlbatch-train +recipe=grpo_qwen trainer.max_steps=200 parallel.pp=2
    rlbatch-train -m +recipe=grpo_qwen batching.train.max_tokens=512,1024

Hydra runs here once (one job per multirun point); each job launches fresh torchrun workers.
No torch at module level.
"""

from __future__ import annotations

import sys

from rlbatch.cli.common import help_text, to_validated_run_config
from rlbatch.config.store import conf_dir, register_configs

USAGE = "GRPO training on megatron-core. rlbatch-train [+recipe=NAME] [KEY=VALUE ...] [-m]"
HYDRA_FLAGS = (
    "Hydra flags: -m/--multirun (sweeps: KEY=a,b), --cfg job (print the composed config),\n"
    "--info, --hydra-help. Run directory: outputs/<date>/<time>-<id>/, or outputs/<run_id>/ with\n"
    "parallel.run_id (multi-node: every node shares it) (multirun: multirun/...)."
)
TRAIN_ENTRY = "rlbatch.train.build:run"


def _task(cfg) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from rlbatch.grpo.preflight import check_before_launch
    from rlbatch.runtime.driver import launch

    run_cfg = to_validated_run_config(cfg, "rlbatch-train", extra=check_before_launch)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    code = launch(run_cfg, run_dir, entry=TRAIN_ENTRY)
    if code:
        sys.exit(code)


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(help_text("rlbatch-train", USAGE, HYDRA_FLAGS))
        return
    import hydra

    register_configs()
    app = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)
    app()


if __name__ == "__main__":
    main()
