"""rlbatch-bench distill: held-out reward against optimizer steps and wall time for on-policy
distillation, GRPO and both, over several seeds, each arm a real ``rlbatch-train`` run.

    rlbatch-bench distill --teacher outputs/teacher/hf --seeds 0,1 --steps 20

Arms (the same student, data and evaluation; docs/benchmarks.md has figures):
- ``distill``: ``+recipe=distill_qwen`` (pure distillation, no reward);
- ``grpo``: ``+recipe=grpo_qwen`` (GRPO alone);
- ``both``: ``+recipe=distill_qwen grpo.distill.reward_coef=1 grpo.beta=0.02``.

Without ``--teacher`` the teacher is trained first by ``+recipe=grpo_qwen``
(``--teacher-steps``, its export <run_dir>/hf). Prints, per arm, the mean over seeds of
``eval/reward_mean`` at each evaluation with the training seconds up to it, and writes
``distill_bench.json`` and ``distill_bench.png`` (reward against steps and against seconds)
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARMS: dict[str, list[str]] = {
    "distill": ["+recipe=distill_qwen"],
    "grpo": ["+recipe=grpo_qwen"],
    "both": ["+recipe=distill_qwen", "grpo.distill.reward_coef=1.0", "grpo.beta=0.02"],
}
QUIET = ["logging.plot=false", "logging.tensorboard=false", "logging.progress=false"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench distill", description=__doc__.split("\n")[0])
    p.add_argument("--teacher", help="the teacher's HF directory (default: train one)")
    p.add_argument("--teacher-steps", type=int, default=60, help="steps of the teacher's run")
    p.add_argument("--seeds", default="0,1", help="comma-separated trainer.seed values")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each arm")
    p.add_argument("--eval-every", type=int, default=10, help="eval.every_steps of each arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"some of {','.join(ARMS)}")
    p.add_argument("--out", default="distill_bench", help="directory of the runs and results")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(list(argv))


def _train(out: Path, name: str, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """One rlbatch-train run into out/name; its metrics records."""
    train = Path(sys.executable).with_name("rlbatch-train")
    run = out / name
    proc = subprocess.run(
        [str(train), *overrides, *QUIET, f"hydra.run.dir={run}"],
        capture_output=True, text=True, cwd=out,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        raise RuntimeError(f"{name}: rlbatch-train failed\n{tail}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def curve(records: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, seconds of training up to it, eval/reward_mean) at each evaluation: the seconds
    sum step_time_s of the optimizer steps up to the evaluation (evaluation time excluded)."""
    out, seconds = [], 0.0
    for r in records:
        if "loss" in r:
            seconds += float(r.get("step_time_s") or 0.0)
        if "eval/reward_mean" in r:
            out.append((int(r["step"]), seconds, float(r["eval/reward_mean"])))
    return out


def mean_curves(curves: Sequence[Sequence[tuple[int, float, float]]]) -> list[dict[str, float]]:
    """The seeds' curves averaged point by point (the same evaluation steps in each): step,
    mean seconds, mean reward and its spread (min, max) over the seeds."""
    points = []
    for same_step in zip(*curves, strict=True):
        steps = {p[0] for p in same_step}
        assert len(steps) == 1, f"seeds evaluated at different steps: {steps}"
        rewards = [p[2] for p in same_step]
        points.append(
            {
                "step": float(same_step[0][0]),
                "seconds": math.fsum(p[1] for p in same_step) / len(same_step),
                "reward": math.fsum(rewards) / len(rewards),
                "reward_min": min(rewards),
                "reward_max": max(rewards),
            }
        )
    return points


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    teacher = args.teacher
    if teacher is None:
        # the run's HF export (<run_dir>/hf) is what the students distill from
        _train(out, "teacher", ["+recipe=grpo_qwen", f"trainer.max_steps={args.teacher_steps}"])
        teacher = str(out / "teacher" / "hf")
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    result: dict[str, Any] = {"teacher": str(Path(teacher).resolve()), "seeds": seeds, "arms": {}}
    for arm in arms:
        curves = []
        for seed in seeds:
            overrides = [*ARMS[arm], f"trainer.seed={seed}", f"trainer.max_steps={args.steps}"]
            overrides += [
                f"eval.every_steps={args.eval_every}",
                "trainer.checkpoint.export_hf=false",
            ]
            if arm != "grpo":
                overrides.append(f"grpo.distill.teacher={Path(teacher).resolve()}")
            curves.append(curve(_train(out, f"{arm}_seed{seed}", overrides)))
        result["arms"][arm] = {"per_seed": curves, "mean": mean_curves(curves)}
    (out / "distill_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "distill_bench.png")
    return result


def format_report(result: dict[str, Any]) -> str:
    lines = [f"teacher {result['teacher']}, seeds {result['seeds']}: held-out eval/reward_mean"]
    lines.append(f"{'arm':<8} {'step':>5} {'train s':>8} {'reward':>7} {'min':>6} {'max':>6}")
    for arm, data in result["arms"].items():
        for p in data["mean"]:
            lines.append(
                f"{arm:<8} {p['step']:>5.0f} {p['seconds']:>8.1f} {p['reward']:>7.3f} "
                f"{p['reward_min']:>6.3f} {p['reward_max']:>6.3f}"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Mean held-out reward against steps (left) and training seconds (right), one line an arm."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, data in result["arms"].items():
        pts = data["mean"]
        left.plot([p["step"] for p in pts], [p["reward"] for p in pts], marker="o", label=arm)
        right.plot([p["seconds"] for p in pts], [p["reward"] for p in pts], marker="o", label=arm)
    left.set_xlabel("optimizer step")
    right.set_xlabel("training seconds")
    for ax in (left, right):
        ax.set_ylabel("held-out reward (mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
