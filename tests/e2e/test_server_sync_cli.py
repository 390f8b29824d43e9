"""Weight syncs to a rollout server are whole and current, and no failed or interrupted sync
leaves the server broken: through the real commands (rlbatch-serve, rlbatch-train) with one
real vLLM server (the first of the session's server pool, tests/vllm_pool.py).

- a server of another model (layers, widths, RoPE base, norm epsilon) is refused before
  launch, naming each field;
- a push that misses a tensor fails at the server, naming the layer, and the next run on the
  same server trains normally;
- a server one sync behind (the previous sync's weights under the new label) is caught by the
  probe at a learning rate whose step moves the probe's log-probabilities by less than the
  probe's tolerance;
- a trainer SIGKILLed after each phase of a sync (pause, start, update, finish, resume) with
  the file transfer, and after start, mid-update and after finish with the gloo broadcast, resumes with trainer.resume=auto on the same
  server and ends with the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_pool import MODEL, SERVED_LEN, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.optional_extra]

SMALL = (
    "grpo.global_batch_size=16", "grpo.num_generations=4", "rollout.max_new_tokens=8",
    "trainer.checkpoint.every_steps=1",
)  # fmt: skip
"""A small step: 4 prompts x 4 samples of 8 tokens."""


@pytest.fixture(scope="module")
def server(vllm_server_pool):
    """The session pool's first server (the other server files train on it too: every run
    here leaves it on-policy, a run's takeover of a dead run's label included)."""
    return vllm_server_pool[0]


def _train(bin_dir, env, run_dir, url, *overrides):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MODEL, *SMALL, "rollout.backend=vllm_server",
         f"rollout.servers.urls=[{url}]", f"hydra.run.dir={run_dir}", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false", *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )  # fmt: skip


def _records(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(records):
    """The records without their clock and memory figures (which differ between two runs)."""
    return [
        {k: v for k, v in r.items()
         if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
        for r in records
    ]  # fmt: skip


def _out(proc) -> str:
    return proc.stdout[-4000:] + proc.stderr[-4000:]


def test_a_server_of_another_model_is_refused_before_launch(
    server, bin_dir, subprocess_env, tmp_path
):
    """A run of 3 layers, width 128, RoPE base 1e4 and norm epsilon 1e-5 against a server of 2
    layers, width 64, base 1e6 and epsilon 1e-6: an error naming the URL, each field with both
    values and the run's key, before any worker (the server would otherwise fail the first sync
    with a raw HTTP 500, or take it in part; of the same shapes, it takes the sync whole and
    samples every row from another model, mismatch_kl_k1 1.3e-4 with the probe off)."""
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, server, "model.num_layers=3", "model.hidden_size=128",
        "model.rope_theta=10000", "model.rms_norm_eps=1e-5",
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"rollout.servers.urls={server}: serves another model than this run's" in out, out
    assert "num_hidden_layers: the run's 3 (model.num_layers), the server's 2" in out, out
    assert "hidden_size: the run's 128 (model.hidden_size), the server's 64" in out, out
    assert "rope_theta: the run's 10000.0 (model.rope_theta), the server's 1000000.0" in out, out
    assert "rms_norm_eps: the run's 1e-05 (model.rms_norm_eps), the server's 1e-06" in out, out
    assert "rlbatch-serve" in out
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_probe_longer_than_the_server_holds_is_refused_before_launch(
    server, bin_dir, subprocess_env, tmp_path
):
    """rollout.servers.probe_tokens=152 on servers of 160 positions: the probe's 161 tokens
    (8 of prompt, 152 fixed, 1 sampled) are refused before launch, naming the key and the
    length; vLLM would otherwise answer the first probe with HTTP 400 after the first step,
    and the run would stop as if the server had failed."""
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, server, f"rollout.vllm.max_model_len={SERVED_LEN}",
        "rollout.servers.probe_tokens=152",
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rollout.servers.probe_tokens=152: makes the probe a sequence of 161 tokens" in out, out
    assert "rollout.servers.probe_tokens<=151" in out, out
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_probe_tolerance_below_a_bfloat16_engines_noise_is_refused_before_launch(
    server, bin_dir, subprocess_env, tmp_path
):
    """rollout.vllm.dtype=bfloat16 with probe_tolerance=1e-3 (float32's): a bfloat16 server
    of the right weights is ~3e-3 off the trainer (measured on this model), so the probe would
    stop the run after step 1 blaming the server's model; refused before launch with the
    floor (the server of the module, float32, is refused too, for its dtype)."""
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, server, "rollout.vllm.dtype=bfloat16",
        "rollout.servers.probe_tolerance=0.001",
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rollout.servers.probe_tolerance=0.001: is below the numeric noise" in out, out
    assert "rollout.servers.probe_tolerance>=0.05 for rollout.vllm.dtype=bfloat16" in out, out
    assert not (run_dir / "metrics.jsonl").exists()


def test_server_keys_on_another_backend_are_refused(bin_dir, subprocess_env, tmp_path):
    """rollout.servers' numbers (the resubmit bound, the probe's, the request deadline, the
    concurrency, where rlbatch would start servers) on the colocated backend, which has no
    server to start, wait for, abort a row or probe: configuration errors naming each key,
    not settings ignored."""
    run_dir = tmp_path / "run"
    keys = (
        "max_resubmits=2", "probe_tokens=0", "timeout_s=5.0", "max_concurrency=8",
        "port=9000", "start_timeout_s=60.0",
    )  # fmt: skip
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MODEL, f"hydra.run.dir={run_dir}",
         *(f"rollout.servers.{key}" for key in keys)],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, _out(proc)
    out = proc.stdout + proc.stderr
    for key in keys:
        assert f"rollout.servers.{key}: applies to rollout.backend=vllm_server" in out, out
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_sync_fault_the_run_would_never_meet_is_refused(bin_dir, subprocess_env, tmp_path):
    """debug.fail_sync with generation overlapping training (the generation worker pushes and
    never meets debug.fail_at_step: the run would finish without the fault), and with
    debug.fail_rank / fail_kind, which it does not use: errors naming each key, at once; and a
    debug.fail_at_step past trainer.max_steps, which no sync reaches."""
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, f"http://127.0.0.1:{free_port()}",
        "grpo.num_steps_async=1", "grpo.max_staleness=1", "debug.fail_sync=pause",
        "debug.fail_at_step=2", "debug.fail_rank=1", "debug.fail_kind=kill", "parallel.dp=2",
    )  # fmt: skip
    assert proc.returncode == 2, _out(proc)
    out = proc.stdout + proc.stderr
    assert "debug.fail_sync=pause: faults a sync of the training process" in out, out
    assert "debug.fail_rank=1: is not used with debug.fail_sync=pause" in out, out
    assert "debug.fail_kind=kill: is not used with debug.fail_sync=pause" in out, out
    past = _train(
        bin_dir, subprocess_env, tmp_path / "past", f"http://127.0.0.1:{free_port()}",
        "trainer.max_steps=2", "debug.fail_sync=pause", "debug.fail_at_step=3",
    )  # fmt: skip
    assert past.returncode == 2, _out(past)
    assert "debug.fail_at_step=3: names no step of this run" in past.stdout + past.stderr


def test_a_push_missing_a_tensor_fails_and_leaves_the_server_usable(
    server, bin_dir, subprocess_env, tmp_path
):
    """The sync for step 2 leaves one norm's weight out: the server refuses the update at its
    end, naming the layer that received nothing (vLLM alone would keep that layer's old
    weights with a warning in its log and take the label), and the run stops. A run started
    next on the same server takes it over and trains on-policy."""
    broken = _train(
        bin_dir, subprocess_env, tmp_path / "broken", server, "trainer.max_steps=2",
        "debug.fail_at_step=2", "debug.fail_sync=omit_tensor",
    )  # fmt: skip
    assert broken.returncode != 0, _out(broken)
    out = broken.stdout + broken.stderr
    assert "the weight update is incomplete" in out, out[-4000:]
    assert "layernorm (0 of 64 elements)" in out, out[-4000:]
    assert [r["step"] for r in _records(tmp_path / "broken")] == [1]
    after = _train(  # rollout.servers.max_resubmits: a key of the command line too
        bin_dir, subprocess_env, tmp_path / "after", server, "trainer.max_steps=1",
        "rollout.servers.max_resubmits=2",
    )  # fmt: skip
    assert after.returncode == 0, _out(after)
    assert abs(_records(tmp_path / "after")[0]["mismatch_kl_k1"]) < 1e-6


def test_a_server_one_sync_behind_is_caught_by_the_probe(server, bin_dir, subprocess_env, tmp_path):
    """At lr 1e-5 one step moves the probe's log-probabilities by less than its tolerance
    (1e-3): the sync for step 2 pushes step 1's weights under step 2's label, and the run stops
    because the server's log-probabilities of the probe's fixed tokens are nearer the previous
    sync's than the current ones. Without the probe this run would finish, one version
    behind."""
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, server, "trainer.max_steps=2", "trainer.optim.lr=1e-5",
        "debug.fail_at_step=2", "debug.fail_sync=stale",
    )  # fmt: skip
    assert proc.returncode != 0, _out(proc)
    out = proc.stdout + proc.stderr
    assert f"rollout server {server} holds the previous sync's weights" in out, out[-4000:]
    assert [r["step"] for r in _records(run_dir)] == [1]


PHASES = {
    "file": ("pause", "start", "update", "finish", "resume"),
    "broadcast": ("start", "update", "finish"),
}
"""The phases each transfer is killed after. Pausing and resuming are the same requests for
both transfers, and a broadcast trainer killed there leaves what a file one does (a paused server,
or a finished update under its label) plus a process group with a dead member, which the
broadcast's kills after start, mid-update and after finish leave too (with an update open)."""


@pytest.fixture(scope="module")
def uninterrupted(server, bin_dir, subprocess_env, tmp_path_factory):
    """The records of two uninterrupted steps on the server (the file transfer)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    ref = _train(bin_dir, subprocess_env, run_dir, server, "trainer.max_steps=2")
    assert ref.returncode == 0, _out(ref)
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    return records


@pytest.mark.parametrize("transfer", ["file", "broadcast"])
def test_a_trainer_killed_at_each_phase_of_a_sync_resumes_on_its_server(
    server, uninterrupted, bin_dir, subprocess_env, tmp_path, transfer
):
    """The trainer SIGKILLs itself during the sync for step 2, right after one of its phases,
    and is resumed (trainer.resume=auto, from step 1's checkpoint) on the same server, which
    the killed trainer left paused, mid-update (its update begun, half received over the
    broadcast, or received but not finished) or labelled with the killed run's weights; each
    resumed run is killed after the next phase, and the last one finishes: it takes the
    server's update over, pushes its whole weights, and its metrics equal the uninterrupted
    run's (which is the same for either transfer)."""
    overrides = ("trainer.max_steps=2", f"rollout.servers.transfer={transfer}")
    run_dir = tmp_path / "killed"
    for i, phase in enumerate(PHASES[transfer]):
        resume = ("trainer.resume=auto",) if i else ()
        killed = _train(
            bin_dir, subprocess_env, run_dir, server, *overrides, *resume,
            "debug.fail_at_step=2", f"debug.fail_sync={phase}",
        )  # fmt: skip
        assert killed.returncode != 0, (phase, _out(killed))
        assert [r["step"] for r in _records(run_dir)] == [1], (phase, _out(killed))
    resumed = _train(bin_dir, subprocess_env, run_dir, server, *overrides, "trainer.resume=auto")
    assert resumed.returncode == 0, _out(resumed)
    assert _untimed(_records(run_dir)) == _untimed(uninterrupted)
