"""A built wheel installed into a fresh virtual environment finds conf/ and recipes/ and runs
the CLI; so does the editable install the tests run from."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from conftest import REPO
from rlbatch.config.store import conf_dir, recipes_dir

pytestmark = pytest.mark.e2e


def test_editable_install_finds_repo_conf():
    assert conf_dir() == REPO / "conf"
    assert recipes_dir() == REPO / "recipes"


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with only the rlbatch wheel installed; its dependencies are borrowed from
    the test environment through a path entry (no network, no editable finder)."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((root / "dist").glob("rlbatch-*.whl"))
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def test_wheel_ships_conf_and_recipes(wheel_venv, subprocess_env):
    py = wheel_venv / "bin" / "python"
    code = (
        "from rlbatch.config.store import conf_dir, recipes_dir, list_recipes;"
        "from rlbatch.cli.common import compose;"
        "cfg = compose(['+recipe=grpo_qwen', 'batching@batching.train=packed'], 't');"
        "print(conf_dir()); print(recipes_dir()); print(cfg.batching.train.mode.name);"
        "print(sorted(r.name for r in list_recipes()));"
        "print(compose(['+recipe=grpo_qwen2_5_math'], 't').data.path)"
    )
    out = subprocess.run(
        [str(py), "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=wheel_venv,
    ).stdout.splitlines()
    assert out[0].startswith(str(wheel_venv)) and out[0].endswith("rlbatch/conf")
    assert out[1].startswith(str(wheel_venv)) and out[1].endswith("rlbatch/recipes")
    assert out[2] == "packed"
    assert "grpo_qwen" in out[3] and "grpo_qwen2_5_7b" in out[3]
    assert out[4].startswith(str(wheel_venv)) and Path(out[4]).is_file()  # the GSM8K sample


def test_wheel_console_scripts(wheel_venv, subprocess_env):
    train = wheel_venv / "bin" / "rlbatch-train"
    out = subprocess.run(
        [str(train), "--help"],
        check=True,
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=wheel_venv,
    ).stdout
    assert "grpo_qwen" in out
    cfg = subprocess.run(
        [str(train), "+recipe=grpo_qwen", "--cfg", "job"],
        check=True,
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=wheel_venv,
    ).stdout
    assert "max_steps:" in cfg and "batching:" in cfg
    for script in ("rlbatch-plan", "rlbatch-bench", "rlbatch-logprobs", "rlbatch-export"):
        assert (wheel_venv / "bin" / script).is_file()


def test_wheel_holds_every_package(wheel_venv):
    """Every package of launcher/rlbatch is in the wheel (pyproject lists them by hand: a
    subpackage left out imports from the editable install, and fails from a wheel)."""
    import zipfile

    (wheel,) = (wheel_venv.parent / "dist").glob("rlbatch-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    source = REPO / "launcher"
    missing = [
        str(p.relative_to(source))
        for p in sorted(source.glob("rlbatch/**/__init__.py"))
        if str(p.relative_to(source)) not in shipped
    ]
    assert missing == []
