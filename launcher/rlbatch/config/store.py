"""Where conf/ and recipes/ live, and their registration with Hydra's ConfigStore.

Both directories ship inside the package (``rlbatch.conf`` / ``rlbatch.recipes``, mapped in
pyproject.toml), so the same lookup works from an editable install and from a wheel.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

_RUN_UID = f"{os.getpid()}{secrets.token_hex(2)}"
_STARTED = datetime.now()


def conf_dir() -> Path:
    """Directory of the primary config and its groups."""
    return Path(str(resources.files("rlbatch.conf")))


def recipes_dir() -> Path:
    return Path(str(resources.files("rlbatch.recipes")))


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    summary: str
    """First line of the recipe's header comment after its name."""
    path: Path


def list_recipes() -> list[RecipeInfo]:
    """Every shipped recipe with the one-line summary of its header comment."""
    infos = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        summary: list[str] = []
        collecting = False
        for line in path.read_text().splitlines():
            text = line.lstrip("#").strip()
            if not line.startswith("#"):
                break
            if text.startswith(f"{path.stem}:"):
                collecting, text = True, text.split(":", 1)[1].strip()
            if collecting:
                summary.append(text)
                if text.endswith(".") or not text:
                    break
        infos.append(RecipeInfo(path.stem, " ".join(summary).split(". ")[0].rstrip("."), path))
    return infos


_REGISTERED: list[bool] = []


def register_configs() -> None:
    """Register the recipes as group ``recipe`` (so ``+recipe=NAME`` works), the run-id
    resolvers and ``rlbatch_conf`` (the path of a file under conf/). Once per process: every
    command, and every compose of a process that composes many (the tests, rlbatch-plan sweeps),
    would otherwise parse every recipe again. The typed schema is not stored: nothing composes
    from it, and building it took a third of a second of every command's start."""
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for recipe in list_recipes():
        node = OmegaConf.load(recipe.path)
        store.store(group="recipe", name=recipe.name, node=node, package="_global_")
    if not OmegaConf.has_resolver("rlbatch_conf"):
        # Files shipped next to the configs (e.g. conf/data/gsm8k_sample.jsonl), by absolute path.
        OmegaConf.register_new_resolver("rlbatch_conf", lambda rel: str(conf_dir() / rel))
    if not OmegaConf.has_resolver("rlbatch_uid"):
        # Part of every run directory name: runs started in the same second never collide.
        OmegaConf.register_new_resolver("rlbatch_uid", lambda: _RUN_UID)
    if not OmegaConf.has_resolver("rlbatch_run_name"):
        OmegaConf.register_new_resolver("rlbatch_run_name", run_name)
    _REGISTERED.append(True)


def run_name(run_id: str | None, nnodes: int) -> str:
    """The run directory under outputs/: ``<run_id>`` when every node must find the same one
    (parallel.run_id, or a multi-node run's scheduler job id), else ``<date>/<time>-<uid>``."""
    from rlbatch.runtime.scheduler import scheduler_run_id

    if run_id is None and nnodes > 1:
        run_id = scheduler_run_id(os.environ)
    if run_id is not None:
        return run_id
    return f"{_STARTED:%Y-%m-%d}/{_STARTED:%H-%M-%S}-{_RUN_UID}"
