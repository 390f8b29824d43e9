"""Multi-node keys from a job scheduler's environment, and the config errors when none is found."""

from __future__ import annotations

import shutil

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.schema import ParallelConfig
from rlbatch.config.store import run_name
from rlbatch.runtime.scheduler import (
    apply_scheduler_env,
    first_host,
    scheduler_run_id,
    scontrol_first_host,
)

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[07-10]"}


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),
        ("rack[2-3]-n[01-04]", "rack2-n01"),
        ("a-b-1,a-b-2", "a-b-1"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="exercises the fallback")
def test_without_scontrol_the_parse_answers():
    assert scontrol_first_host("gpu[07-10]") == "gpu07"


@pytest.mark.parametrize(
    ("env", "run_id"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
        ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}, "slurm-4242.1"),
        ({"PBS_JOBID": "77.pbs-server"}, "pbs-77.pbs-server"),
        ({"LSB_JOBID": "9"}, "lsf-9"),
    ],
)
def test_run_id_from_the_job_id(env, run_id):
    assert scheduler_run_id(env) == run_id


def test_slurm_fills_every_multi_node_key():
    p = ParallelConfig(dp=4, nnodes=4)
    apply_scheduler_env(p, SLURM, resolve_host=first_host)
    assert (p.run_id, p.node_rank, p.rdzv_endpoint) == ("slurm-4242", 3, "gpu07:29742")


def test_given_keys_win_over_the_scheduler():
    p = ParallelConfig(dp=2, nnodes=2, node_rank=0, run_id="mine", rdzv_endpoint="h:1")
    apply_scheduler_env(p, SLURM, resolve_host=first_host)
    assert (p.run_id, p.node_rank, p.rdzv_endpoint) == ("mine", 0, "h:1")


def test_single_node_ignores_the_scheduler():
    p = ParallelConfig(dp=2)
    apply_scheduler_env(p, SLURM, resolve_host=first_host)
    assert (p.run_id, p.node_rank, p.rdzv_endpoint) == (None, 0, None)


def test_run_directory_is_the_shared_run_id(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert run_name("exp1", 1) == "exp1"
    assert run_name(None, 1) != run_name("exp1", 1)  # a new <date>/<time>-<uid> per run
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_name(None, 2) == "slurm-4242"
    assert "slurm" not in run_name(None, 1)


def test_multi_node_without_a_scheduler_names_each_missing_key(monkeypatch, capsys):
    for var in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_JOB_NODELIST", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        compose(["parallel.nnodes=2", "parallel.dp=2", "parallel.run_id=a/b"], "test")
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "parallel.run_id=a/b" in err and "letters, digits" in err
    assert "parallel.node_rank=null" in err and "parallel.rdzv_endpoint=null" in err
    with pytest.raises(SystemExit):
        compose(["parallel.nnodes=2", "parallel.dp=2"], "test")
    err = " ".join(capsys.readouterr().err.split())
    assert "parallel.run_id=null: multi-node (nnodes=2): every node must share one run id" in err


@pytest.mark.parametrize(("nnodes", "step_nodes"), [(2, "4"), (1, "2")])
def test_srun_over_another_node_count_is_an_error(nnodes, step_nodes):
    p = ParallelConfig(dp=nnodes, nnodes=nnodes)
    errors = apply_scheduler_env(p, {**SLURM, "SLURM_STEP_NUM_NODES": step_nodes}, first_host)
    assert [(e.key, e.value) for e in errors] == [("parallel.nnodes", nnodes)]
    assert f"set parallel.nnodes={step_nodes}" in errors[0].message
    assert apply_scheduler_env(p, {**SLURM, "SLURM_STEP_NUM_NODES": str(nnodes)}) == []
