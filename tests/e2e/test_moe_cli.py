"""MoE policies through the real commands, on tiny Qwen3-MoE models: rlbatch-logprobs on a
transformers-made checkpoint equals transformers' float64 forward at ep 1, tp 2 and dp 2 x ep 2
x pp 2 x vpp 2; rlbatch-train at dp 2 x pp 2 x vpp 2 rolls out the checkpoint's samples and
trains on-policy (with the load-balancing loss on both stages), and resumed at ep 2 (the
distributed optimizer) continues the run and exports every expert; partial rollouts at dp 2 x
ep 2 sample what they sample at ep 1; a dp 2 x ep 2 checkpoint resumes at ep 1 (the plain optimizer); a
Qwen2-MoE (shared expert) checkpoint's log-probs equal transformers' at dp 2 x ep 2;
rlbatch-train at dp 2 x ep 2 learns the default task and exports every expert (transformers
loads the export, rlbatch-logprobs at ep 2 on it equals transformers on it); training from the
checkpoint with the router frozen leaves the routers as they were. SIGKILL + resume at dp 2 x
ep 2: grpo_qwen3_moe's shape twin (tests/e2e/test_shape_twins.py). LoRA on tiny_moe made a
Qwen2-MoE at dp 2 x ep 2 adapts the attention and the shared expert, and exports a PEFT adapter
that PEFT loads onto transformers' Qwen2-MoE base with the trainer's log-probs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hf_reference import (
    moe_reference,
    moe_reference_replayed,
    save_tiny_qwen2_moe,
    save_tiny_qwen3_moe,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOL = 1e-5
PIPELINED = ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.vpp=2"]
"""4 processes: two pipeline stages of one layer per chunk (the checkpoint's 4 layers), each
stage's two data-parallel ranks one expert-parallel group."""
MOE_RUN = ["+recipe=grpo_qwen", "model=tiny_moe", "parallel.dp=2", "parallel.ep=2",
           "logging.tensorboard=false"]  # fmt: skip


def _rows() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 259, (n,), generator=g).tolist() for n in (9, 25, 4, 17, 30, 2)]


def _forced_routing() -> list:
    """Expert ids to replay on rows 1 and 3 (random pairs of the 4 experts at each of the 3
    sparse layers, a few -1 = the router's own choice); None = route freely."""
    g = torch.Generator().manual_seed(2)
    out: list = [None] * len(_rows())
    for i in (1, 3):
        n = len(_rows()[i])
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n * 3)])
        ids = ids.view(n, 3, 2)
        ids[::5] = -1
        out[i] = ids.tolist()
    return out


def _logprobs(
    bin_dir, env, tmp_path: Path, hf: Path, name: str, *layout: str, routing=None
) -> list[list]:
    rows = _rows()
    routes = routing or [None] * len(rows)
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"input_ids": r} | ({} if x is None else {"routing": x})) + "\n"
            for r, x in zip(rows, routes, strict=True)
        )
    )
    out = tmp_path / f"{name}.jsonl"
    cmd = [str(bin_dir / "rlbatch-logprobs"), f"model.hf_path={hf}", f"logprobs.input={src}",
           f"logprobs.output={out}", "model.tokenizer=bytes", *layout]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line)["token_logprobs"] for line in out.read_text().splitlines()]


def _max_error(got: list[list], want: list[list]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(
        abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A transformers-made Qwen3-MoE (4 experts, top-2, layer 1 dense) and its float64
    reference log-probs (rows 1 and 3 with their experts forced: _forced_routing)."""
    path = tmp_path_factory.mktemp("moe") / "hf"
    save_tiny_qwen3_moe(path)
    logps, margin = moe_reference(path, _rows())
    forced = [
        x if x is not None else [[[-1, -1]] * 3] * len(r)
        for r, x in zip(_rows(), _forced_routing(), strict=True)
    ]
    replayed = moe_reference_replayed(path, _rows(), forced)
    # the forced experts change those rows' log-probs: the replay is visible
    assert _max_error([replayed[1], replayed[3]], [logps[1], logps[3]]) > 1e-2
    return path, replayed, margin


@pytest.mark.parametrize(
    "layout",
    [[], ["parallel.tp=2"], PIPELINED],
    ids=["ep1", "tp2", "dp2_ep2_pp2_vpp2"],
)
def test_logprobs_equal_transformers(bin_dir, subprocess_env, tmp_path, checkpoint, layout):
    """Rows routed freely, and rows whose "routing" the routers replay (rows 1 and 3: the
    relayout at ep 2 with pipeline stages and virtual chunks, and at tp 2 too), equal
    transformers' float64 forward with the same experts. (dp 2 x ep 2 at pp 1: the export
    check of test_dp2_ep2_learns_and_exports_every_expert.)"""
    hf, want, margin = checkpoint
    routing = _forced_routing()
    got = _logprobs(bin_dir, subprocess_env, tmp_path, hf, "out", *layout, routing=routing)
    # a top-k near a tie could flip between the fp32 and float64 forwards (another expert
    # set, another log-prob): the closest the routing comes to a tie is in the message
    error = _max_error(got, want)
    assert error <= TOL, f"max error {error:.2e}; smallest top-k margin {margin:.2e}"


def test_qwen2_moe_logprobs_equal_transformers_at_dp2_ep2(bin_dir, subprocess_env, tmp_path):
    """A transformers-made Qwen2-MoE (a shared expert behind its sigmoid gate in every sparse
    layer, top-2 not renormalised, q/k/v biases, layer 1 dense) through rlbatch-logprobs at
    dp 2 x ep 2 equals transformers' float64 forward. (Its export round trip:
    tests/unit/engine/test_hf.py.)"""
    hf = tmp_path / "qwen2_moe"
    save_tiny_qwen2_moe(hf)
    want, margin = moe_reference(hf, _rows())
    got = _logprobs(bin_dir, subprocess_env, tmp_path, hf, "qwen2_moe", "parallel.dp=2",
                    "parallel.ep=2")  # fmt: skip
    error = _max_error(got, want)
    assert error <= TOL, f"max error {error:.2e}; smallest top-k margin {margin:.2e}"


def _train(bin_dir, env, *args, check=True):
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MOE_RUN, *args],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing = ("_s", "_seconds", "seconds", "memory_gb")
    return [{k: v for k, v in r.items() if not (k.endswith(timing) or "per_s" in k)} for r in rows]


def _continues(resumed: list[dict], uninterrupted: list[dict], steps: list[int]) -> None:
    """A run resumed at another expert-parallel size continues as the uninterrupted one: the
    same samples (rewards, lengths: the data-parallel ranks and their seeds are the same) and,
    at fp32 rounding (the experts' tokens are grouped differently), the same losses and
    gradients; history before the resume carried over as it was."""
    by_step = {r["step"]: r for r in uninterrupted}
    assert [r["step"] for r in resumed] == [*range(1, steps[0]), *steps]
    assert resumed[: steps[0] - 1] == uninterrupted[: steps[0] - 1]
    for r in resumed[steps[0] - 1 :]:
        want = by_step[r["step"]]
        for key in ("reward_mean", "response_len_mean", "tokens"):
            assert r[key] == want[key], (r["step"], key)
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert r[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (r["step"], key)


def test_dp2_ep2_learns_and_exports_every_expert(bin_dir, subprocess_env, tmp_path):
    run_dir = tmp_path / "run"
    _train(bin_dir, subprocess_env, "trainer.max_steps=30", f"hydra.run.dir={run_dir}")
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, f"reward did not rise: {first:.3f} -> {last:.3f}"
    # the expert load of every MoE layer (2 here), a max / mean ratio over 4 experts
    loads = [[r[f"moe/load_imbalance_layer_{i}"] for i in (0, 1)] for r in records]
    assert all(1.0 <= x <= 4.0 for row in loads for x in row)
    assert records[0]["moe/load_imbalance_max"] == max(loads[0])
    hf = run_dir / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    want, _ = moe_reference(hf, _rows())  # transformers loads the export (every expert)
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(hf)
    # every expert counted once, although each rank holds half of them
    assert records[0]["trainable_params"] == sum(p.numel() for p in exported.parameters())
    got = _logprobs(bin_dir, subprocess_env, tmp_path, hf, "export", "parallel.dp=2",
                    "parallel.ep=2")  # fmt: skip
    assert _max_error(got, want) <= TOL


def test_dp2_ep2_trains_a_checkpoint_with_its_router_frozen(
    bin_dir, subprocess_env, tmp_path, checkpoint
):
    """Training the transformers-made checkpoint (a dense layer between sparse ones) with the
    router frozen: the routers come out as they went in, the experts trained. (SIGKILL and
    resume at dp 2 x ep 2 run in tests/e2e/test_shape_twins.py: grpo_qwen3_moe's twin.)
    The same run replays routing r2 (two iterations a round): each round's old-logprob pass
    records its routing at dp 2 x ep 2, and with the weights that sampled it that is the
    rollout's routing, token by token (prompt included; the last token has none). And it
    caps each expert at its fair share (model.moe_expert_capacity_factor=1.0): the dropped
    assignments are counted (moe/dropped_tokens). Step 1's checkpoint resumed at dp 2 x ep 1
    (megatron's plain optimizer: one optimizer instead of the dense + expert pair) continues
    the run, step 3 training with the Adam moments it loaded, under full activation recompute
    (its recomputed forwards replay the r2 record again)."""
    hf, _, _ = checkpoint
    ref_dir = tmp_path / "ref"
    args = ["trainer.max_steps=3", f"model.hf_path={hf}", "model.tokenizer=bytes",
            "model.moe_freeze_router=true", "grpo.routing_replay=r2", "grpo.num_iterations=2",
            "logging.samples=true", "model.moe_expert_capacity_factor=1.0",
            "trainer.checkpoint.every_steps=1", "trainer.checkpoint.keep_last=3",
            # each rank plans its old-logprob pass over its own samples: a small budget makes
            # the two ranks' micro-batch counts differ, which the expert group evens out with
            # fillers (its all-to-alls hung without them)
            "batching.infer.max_tokens=96"]  # fmt: skip
    _train(bin_dir, subprocess_env, *args, f"hydra.run.dir={ref_dir}")
    # a capacity of 1.0 x the fair share drops some assignments, counted, never all
    records = _metrics(ref_dir)
    assert all(r["moe/dropped_tokens"] > 0 and 0 < r["moe/dropped_fraction"] < 0.5 for r in records)
    same = total_pairs = 0
    for step in (1, 3):  # a round's first step: the old pass ran with the sampling weights
        for s in _samples(ref_dir, step):
            rollout, old = torch.tensor(s["routing"]), torch.tensor(s["old_routing"])
            assert (
                rollout.shape == old.shape == (len(s["prompt_ids"]) + len(s["response_ids"]), 3, 2)
            )
            assert (rollout[-1] == -1).all() and (old[:-1] >= 0).all()
            sets = rollout[:-1].sort(-1).values == old[:-1].sort(-1).values  # [len - 1, 3, 2]
            same += int(sets.all(-1).sum())
            total_pairs += sets.shape[0] * sets.shape[1]
    # decoding with a KV cache and the pass's full forward round differently, and the capacity
    # drops per forward (one token a row when decoding): a later layer's top-k may flip where
    # an earlier one was near a tie or dropped differently; a wrong layout would flip most
    assert total_pairs > 0 and same >= 0.99 * total_pairs

    from safetensors.torch import load_file

    before = load_file(str(hf / "model.safetensors"))
    after = {}
    for shard in (ref_dir / "hf").glob("*.safetensors"):
        after.update(load_file(str(shard)))
    routers = [k for k in before if k.endswith("mlp.gate.weight")]
    assert len(routers) == 3  # layers 0, 2, 3 (layer 1 is dense)
    assert all(torch.equal(before[k], after[k]) for k in routers)
    assert not torch.equal(before["model.layers.0.mlp.experts.3.up_proj.weight"],
                           after["model.layers.0.mlp.experts.3.up_proj.weight"])  # fmt: skip
    total = sum(t.numel() for t in before.values())
    frozen = sum(before[k].numel() for k in routers)
    assert _metrics(ref_dir)[0]["trainable_params"] == total - frozen

    ep1 = tmp_path / "ep1"
    _train(bin_dir, subprocess_env, *args, "parallel.ep=1", "trainer.checkpoint.export_hf=false",
           f"trainer.resume={ref_dir / 'checkpoints' / 'step_00000001'}", f"hydra.run.dir={ep1}",
           "model.recompute=full")  # fmt: skip
    _continues(_metrics(ep1), records, [2, 3])


def _samples(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _response_error(samples: list[dict], key: str, reference: list[list[float]]) -> float:
    """Largest gap between the samples' logged response log-probs ``key`` and a reference over
    the whole sequence (the response's start at len(prompt) - 1)."""
    return max(
        abs(a - b)
        for s, ref in zip(samples, reference, strict=True)
        for a, b in zip(s[key], ref[len(s["prompt_ids"]) - 1 :], strict=True)
    )


def test_r3_replays_the_rollout_routing_through_a_resume(
    bin_dir, subprocess_env, tmp_path, checkpoint
):
    """grpo.routing_replay=r3 with one step of run-ahead and two iterations a round: round 2
    (steps 3-4) was sampled by policy 1 ahead of time and saved in step 2's checkpoint with its
    routing; after the resume, step 3's old-logprob pass runs with the weights of step 2, which
    route some tokens elsewhere (moe/routing_mismatch > 0), and replays the rollout's routing:
    its log-probs equal transformers' float64 forward of step 2's weights with that routing
    forced, and differ from the same forward routing freely. The reference pass routes for
    itself: its log-probs are transformers' free forward of the initial checkpoint. The run
    trains with the load-balancing loss (model.moe_aux_loss_coeff) and logs it."""
    hf, _, _ = checkpoint
    run_dir = tmp_path / "r3"
    args = ["+recipe=grpo_qwen", "logging.tensorboard=false", "model=tiny_moe", f"model.hf_path={hf}",
            "model.tokenizer=bytes", "grpo.num_steps_async=1", "grpo.num_iterations=2",
            "grpo.overlap_generation=false", "grpo.routing_replay=r3",
            "grpo.global_batch_size=32", "grpo.num_generations=4", "logging.samples=true",
            "model.moe_aux_loss_coeff=0.01", f"hydra.run.dir={run_dir}"]  # fmt: skip

    def train(*extra: str) -> None:
        cmd = [str(bin_dir / "rlbatch-train"), *args, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]

    train("trainer.max_steps=2")
    step2 = tmp_path / "hf_step2"
    (run_dir / "hf").rename(step2)  # the weights step 3's old-logprob pass runs with
    train("trainer.max_steps=3", "trainer.resume=auto")

    record = _metrics(run_dir)[-1]
    assert record["step"] == 3 and record["moe/routing_mismatch"] > 0.02
    assert 0.5 < record["moe/aux_loss"] <= 2.0  # the balance loss trained with it (E / k = 2)
    samples = _samples(run_dir, 3)
    assert {s["policy_version"] for s in samples} == {1}  # sampled ahead, before the resume
    rows = [s["prompt_ids"] + s["response_ids"] for s in samples]
    routing = [s["routing"] for s in samples]
    assert all(len(r) == len(x) for r, x in zip(routing, rows, strict=True))
    replayed = moe_reference_replayed(step2, rows, routing)
    assert _response_error(samples, "old_logps", replayed) <= TOL
    free, _ = moe_reference(step2, rows)
    assert _response_error(samples, "old_logps", free) > 100 * TOL
    initial, _ = moe_reference(hf, rows)
    assert _response_error(samples, "ref_logps", initial) <= TOL


def _prompts_of_many_lengths(path: Path) -> Path:
    """64 prompts of 1 to 28 characters: data-parallel ranks then hold prompts of different
    lengths, so one rank's rows end while its expert-parallel peer still decodes (its idle
    forwards keep the peer's all-to-alls fed; 3 a stage at step 1 here)."""
    import random

    r = random.Random(0)
    with path.open("w") as f:
        for _ in range(64):
            text = "".join(r.choice("abcdefgh ") for _ in range(r.randint(1, 28)))
            f.write(json.dumps({"prompt": text, "answer": "x"}) + "\n")
    return path


def test_ep_with_pp2_vpp2_rolls_out_on_policy_and_resumes_across_ep(
    bin_dir, subprocess_env, tmp_path, checkpoint
):
    """Expert and pipeline parallelism together (dp 2 x pp 2 x vpp 2: 4 processes, one layer a
    chunk) through rlbatch-train from the transformers-made checkpoint, with the distributed
    optimizer. At ep 1 the built-in rollout's samples are the checkpoint's: behaviour
    log-probs equal transformers' float64 forward with the routing the rollout recorded (every
    stage's layers merged into it), which is transformers' own top-k; training is on-policy.
    Step 1's checkpoint resumed at ep 2 (megatron's optimizer then splits into a dense and an
    expert one, the checkpoint's common state is one) continues the run: the same samples
    (decoded in step across the stages: one replica's rows end first and it idles), losses and
    gradients at fp32 rounding; step 3 trains with the Adam moments it loaded. Its export
    holds every expert of both stages. Both runs train the load-balancing loss, each stage
    adding its own routers' share (model.moe_aux_loss_coeff); the resumed run recomputes every
    layer in backward (model.recompute=full), whose first forward gives the routers' logits no
    gradient: the equal losses and gradient norms say the balance loss's gradient reached each
    stage's routers through their recomputed forward (without it: tests/dist/
    test_moe_balance_pipeline.py's control). Both runs replay the rollout's routing
    (grpo.routing_replay=r3): under full recompute each chunk's recomputed forward replays its
    own micro-batch's routing again, whose forward came before later micro-batches' (1F1B,
    interleaved): equal losses and gradient norms again."""
    hf, _, _ = checkpoint
    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    args = [*PIPELINED, f"model.hf_path={hf}", "model.tokenizer=bytes", "data=jsonl",
            f"data.path={_prompts_of_many_lengths(tmp_path / 'prompts.jsonl')}",
            "data.reward=exact_match", "grpo.global_batch_size=32", "grpo.num_generations=4",
            "parallel.use_distributed_optimizer=true", "trainer.max_steps=3",
            "trainer.checkpoint.every_steps=1", "trainer.checkpoint.keep_last=3",
            "logging.plot=false", "logging.samples=true", "model.moe_aux_loss_coeff=0.05",
            "grpo.routing_replay=r3"]  # fmt: skip
    _train(bin_dir, subprocess_env, *args, "parallel.ep=1", "trainer.checkpoint.export_hf=false",
           f"hydra.run.dir={run_dir}")  # fmt: skip
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(abs(r["mismatch_kl_k1"]) < 1e-6 for r in records)  # trainer == rollout
    # the balance loss over every stage's MoE layers (its pp 1 equality: tests/dist/
    # test_moe_balance_pipeline.py): between 1 (balanced) and E / k = 2
    assert all(1.0 <= r["moe/aux_loss"] <= 2.0 for r in records)
    samples = _samples(run_dir, 1)
    rows = [s["prompt_ids"] + s["response_ids"] for s in samples]
    routing = torch.tensor([x for s in samples for x in s["routing"][:-1]])  # [tokens, 3, 2]
    assert (routing >= 0).all()  # every stage's layers recorded every fed token
    want = moe_reference_replayed(hf, rows, [s["routing"] for s in samples])
    assert _response_error(samples, "behaviour_logps", want) <= TOL
    free = torch.tensor([x for r in _router_choices(hf, rows) for x in r[:-1]])
    flips = int((routing.sort(-1).values != free.sort(-1).values).any(-1).sum())
    assert flips <= 0.001 * free.shape[0] * free.shape[1], f"{flips} expert sets flipped"

    _train(bin_dir, subprocess_env, *args, f"hydra.run.dir={resumed}", "model.recompute=full",
           f"trainer.resume={run_dir / 'checkpoints' / 'step_00000001'}")  # fmt: skip
    after = _metrics(resumed)
    _continues(after, records, [2, 3])
    assert all(abs(r["mismatch_kl_k1"]) < 1e-6 for r in after)
    # the rollout's routing reached every training micro-batch (replayed: r3)
    assert all(0 <= r["moe/routing_mismatch"] < 0.01 for r in after)
    for ours, theirs in zip(_samples(resumed, 2), _samples(run_dir, 2), strict=True):
        assert ours["response_ids"] == theirs["response_ids"]
        assert ours["routing"] == theirs["routing"]  # global expert ids, whatever the ep

    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(resumed / "hf")
    assert after[0]["trainable_params"] == sum(p.numel() for p in exported.parameters())


PARTIAL = ["+recipe=grpo_qwen", "model=tiny_moe", "model.tokenizer=bytes", "parallel.dp=2",
           "trainer.max_steps=3", "grpo.num_steps_async=1", "grpo.max_staleness=3",
           "grpo.partial_rollouts=true", "grpo.consumption_granularity=group",
           "grpo.overlap_generation=false", "debug.response_length_median=5",
           "logging.samples=true", "logging.plot=false", "logging.tensorboard=false",
           "trainer.checkpoint.export_hf=false", "grpo.routing_replay=r3"]  # fmt: skip


def test_partial_rollouts_of_an_moe_policy_at_ep2_are_those_of_ep1(
    bin_dir, subprocess_env, tmp_path, checkpoint
):
    """grpo.partial_rollouts with the transformers-made checkpoint at dp 2 x ep 2 (the stream
    decoded inline on the per-row decoder): rows outlive a round and go on under the next
    version; each rank's round decodes for as many steps as its own rows ask, its expert
    group kept in step by idle forwards (10 over its 4 rounds in a hand run). The samples,
    their token versions and behaviour log-probs are those of the same run at ep 1, and the
    tokens sampled by version 0 (the checkpoint) have transformers' float64 log-probs. Each
    row carries the routing of the forwards that last fed it (r3 replays it), the same at
    ep 1 and ep 2; at step 1, trained with the weights that sampled it, the training routers
    choose exactly that routing (moe/routing_mismatch 0)."""
    hf, _, _ = checkpoint
    runs = {}
    for ep in (1, 2):
        run_dir = tmp_path / f"ep{ep}"
        proc = subprocess.run(
            [str(bin_dir / "rlbatch-train"), *PARTIAL, f"model.hf_path={hf}", f"parallel.ep={ep}",
             f"hydra.run.dir={run_dir}"],
            capture_output=True, text=True, env=subprocess_env, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[ep] = [_samples(run_dir, step) for step in (1, 2, 3)]
    assert [r["step"] for r in _metrics(tmp_path / "ep2")] == [1, 2, 3]
    continued = [s for step in runs[2] for s in step if len(set(s["token_versions"])) > 1]
    assert continued, "no row outlived a round"
    for ours, theirs in zip(runs[2], runs[1], strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a["response_ids"] == b["response_ids"]
            assert a["token_versions"] == b["token_versions"]
            assert a["behaviour_logps"] == pytest.approx(b["behaviour_logps"], abs=1e-5)
            assert a["routing"] == b["routing"]  # global expert ids, whatever the ep
            routing = torch.tensor(a["routing"])  # [length, 3 MoE layers, k]
            assert routing.shape == (len(a["prompt_ids"]) + len(a["response_ids"]), 3, 2)
            assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()
    records = _metrics(tmp_path / "ep2")
    assert records[0]["moe/routing_mismatch"] == 0.0
    assert all("moe/routing_mismatch" in r for r in records)
    samples = [s for step in runs[2] for s in step]
    want, _ = moe_reference(hf, [s["prompt_ids"] + s["response_ids"] for s in samples])
    first = [
        abs(a - b)
        for s, ref in zip(samples, want, strict=True)
        for a, b, v in zip(
            s["behaviour_logps"], ref[len(s["prompt_ids"]) - 1 :], s["token_versions"], strict=True
        )
        if v == 0
    ]
    assert first and max(first) <= TOL


def _router_choices(path: Path, rows: list[list[int]]) -> list[list]:
    """transformers' float64 top-k experts of every token at every sparse layer (its own
    routing): per row ``[len, num_sparse_layers, k]``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager", attn_implementation="eager"
    )
    model = model.double().eval()
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for ids in rows:
            logits = model(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
            out.append(torch.stack([x.topk(k, dim=-1).indices for x in logits], 1).tolist())
    return out


QWEN2_MOE = ["model.architecture=qwen2_moe", "model.qk_layernorm=false", "model.add_qkv_bias=true",
             "model.moe_shared_expert_intermediate_size=40"]  # fmt: skip
"""tiny_moe as a Qwen2-MoE: a shared expert of width 40 beside the routed experts of every
layer, behind its sigmoid gate; q/k/v biases, no QK-norm."""
LORA_RUN = ["model.lora.rank=8", "trainer.max_steps=3", "trainer.checkpoint.every_steps=1",
            "trainer.checkpoint.keep_last=3", "trainer.optim.lr=3e-2", "logging.plot=false",
            "logging.samples=true"]  # fmt: skip


def _peft_logprobs(base: Path, adapter: Path, rows: list[list[int]]) -> list[list[float]]:
    """PEFT's LoRA model (transformers' MoE ``base`` + the adapter directory), float64:
    each row's per-token log-probs (position t scores token t + 1)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float64, experts_implementation="eager"
    )
    model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r])
            logps = model(input_ids=ids).logits[0].log_softmax(-1)
            out.append(logps[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def test_dp2_ep2_lora_trains_the_attention_and_shared_expert_and_exports_to_peft(
    bin_dir, subprocess_env, tmp_path
):
    """model.lora.rank=8 on tiny_moe made a Qwen2-MoE (every layer sparse, with a shared expert)
    at dp 2 x ep 2: all-linear adapts the attention and the shared expert's gate / up / down
    projections of both layers (the routed experts, the routers and the shared expert's gate stay
    frozen: 2 x (3,584 + 2,496) trainable parameters); rlbatch-export of step 2 writes the merged
    model, the base and a PEFT adapter (the shared expert's factors under transformers'
    mlp.shared_expert.* names) that PEFT loads onto transformers' Qwen2MoeForCausalLM base,
    whose log-probs equal the merged export's and the behaviour log-probs step 3 sampled with
    (the policy after step 2). (A SIGKILLed LoRA run resumes exactly in
    tests/e2e/test_lora_cli.py: expert parallelism does not shard the adapted linears, the
    shared expert being replicated on every data rank; MoE kill + resume at dp 2 x ep 2 is
    grpo_qwen3_moe's twin.)"""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    _train(bin_dir, subprocess_env, *LORA_RUN, *QWEN2_MOE, f"hydra.run.dir={run_dir}")
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["trainable_params"] == 2 * (3584 + 2496) for r in records)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and records[-1]["kl"] > 0

    out = tmp_path / "export"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-export"), str(run_dir), "--out", str(out), "--step", "2"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    shared = [k for k in tensors if ".mlp.shared_expert." in k]
    assert len(tensors) == 2 * 7 * 2 and len(shared) == 2 * 3 * 2
    assert all(".self_attn." in k for k in tensors if k not in shared)
    base = load_file(str(next((out / "base").glob("*.safetensors"))))
    merged = load_file(str(next(out.glob("*.safetensors"))))
    # routed experts, routers and the shared expert's gate: the base's, bit for bit
    experts = [k for k in base if ".mlp." in k and ".mlp.shared_expert." not in k]
    assert any(k.endswith("mlp.shared_expert_gate.weight") for k in experts)
    assert all(torch.equal(base[k], merged[k]) for k in experts)
    for name in ("self_attn.q_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.down_proj"):
        assert not torch.equal(base[f"model.layers.0.{name}.weight"],
                               merged[f"model.layers.0.{name}.weight"]), name  # fmt: skip
    live = {}  # <run_dir>/hf: the merged model after step 3, the experts still the base's
    for shard in (run_dir / "hf").glob("*.safetensors"):
        live.update(load_file(str(shard)))
    assert set(live) == set(base) and all(torch.equal(base[k], live[k]) for k in experts)
    assert not torch.equal(live["model.layers.1.self_attn.o_proj.weight"],
                           merged["model.layers.1.self_attn.o_proj.weight"])  # fmt: skip

    samples = _samples(run_dir, 3)
    rows = [s["prompt_ids"] + s["response_ids"] for s in samples]
    peft = _peft_logprobs(out / "base", out / "adapter", rows)
    exported, _ = moe_reference(out, rows)  # transformers on the merged export, float64
    assert _max_error(peft, exported) <= TOL
    # the engine decoded in fp32 with a KV cache; PEFT runs float64 whole sequences
    assert _response_error(samples, "behaviour_logps", peft) <= 1e-4
