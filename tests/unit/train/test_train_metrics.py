"""metrics.jsonl contents, resume truncation, rank-0 only, summary table, PNG plot."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from rich.console import Console

from rlbatch.config.schema import LoggingConfig
from rlbatch.train.metrics import REQUIRED_KEYS, MetricsLogger, read_jsonl, summary_table
from rlbatch.train.plot import plot_metrics


def _record(step):
    rec = {k: float(step) / 10 for k in REQUIRED_KEYS}
    rec.update(
        step=step,
        reward_mean=0.1 * step,
        kl=0.01 * step,
        tokens=100 * step,
        tokens_per_s=1000.0 + step,
    )
    return rec


def _logger(run_dir, start=0, rank=0, **cfg):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    logging_cfg = LoggingConfig(tensorboard=False, **cfg)
    return MetricsLogger(
        run_dir, logging_cfg, rank=rank, max_steps=10, resumed_step=start, console=console
    ), out


def test_jsonl_one_object_per_step_with_required_keys(tmp_path):
    log, out = _logger(tmp_path)
    for step in range(1, 4):
        log.log(_record(step))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    recs = [json.loads(x) for x in lines]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(set(REQUIRED_KEYS) <= set(r) for r in recs)
    assert recs[2]["reward_mean"] == pytest.approx(0.3) and recs[2]["tokens"] == 300
    assert "step 3/10" in out.getvalue() and "reward 0.300" in out.getvalue()


def test_missing_key_is_an_error(tmp_path):
    log, _ = _logger(tmp_path)
    rec = _record(1)
    del rec["kl"], rec["dp_imbalance"]
    with pytest.raises(ValueError, match=r"\['kl', 'dp_imbalance'\]"):
        log.log(rec)


def _pure_record(step):
    """A pure distillation step (grpo.distill.reward_coef=0): no reward, a teacher KL."""
    rec = _record(step)
    del rec["reward_mean"], rec["reward_std"]
    rec["distill/teacher_kl"] = 2.0 - 0.1 * step
    return rec


def test_pure_distillation_shows_the_teacher_kl_where_others_show_a_reward(tmp_path):
    log, out = _logger(tmp_path)
    for step in range(1, 11):
        log.log(_pure_record(step))
    log.print_summary()
    log.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert not any("reward_mean" in r or "reward_std" in r for r in recs)
    text = out.getvalue()
    assert "step 10/10  teacher_kl 1.000  kl 0.1000" in text and "reward" not in text
    rows = [line.replace("│", " ").split() for line in text.splitlines() if "│" in line]
    assert ["distill/teacher_kl", "1.9", "1", "1.9", "1"] in rows
    # a record that lacks the reward without a teacher KL is not pure distillation: refused
    rec = _record(11)
    del rec["reward_std"]
    with pytest.raises(ValueError, match=r"lacks \['reward_std'\]"):
        log.log(rec)


def test_plot_of_pure_distillation_puts_the_teacher_kl_in_the_rewards_panel(tmp_path):
    from rlbatch.train.plot import PANELS, _panels

    pure = [{"step": 0, "eval/reward_mean": 0.1}, *(_pure_record(s) for s in range(1, 4))]
    assert [key for key, _ in _panels(pure)] == ["distill/teacher_kl", "kl", "tokens_per_s"]
    assert _panels([_record(1)]) == PANELS  # a run with rewards keeps its reward panel
    assert plot_metrics(pure, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_nan_becomes_null(tmp_path):
    log, _ = _logger(tmp_path)
    rec = _record(1)
    rec["grad_norm"] = math.nan
    log.log(rec)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["grad_norm"] is None


def test_resume_truncates_records_after_the_checkpoint(tmp_path):
    log, _ = _logger(tmp_path)
    for step in range(1, 8):  # crashed after step 7, last checkpoint at step 5
        log.log(_record(step))
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 8, "loss"')  # torn line of the killed process
    resumed, _ = _logger(tmp_path, start=5)
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4, 5]
    for step in range(6, 9):
        resumed.log(_record(step))
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 9))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8


def test_fresh_run_starts_a_new_file(tmp_path):
    log, _ = _logger(tmp_path)
    log.log(_record(1))
    again, _ = _logger(tmp_path, start=0)
    again.log(_record(1))
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_other_ranks_write_nothing(tmp_path):
    log, out = _logger(tmp_path / "r1", rank=1)
    log.log(_record(1))
    log.close()
    assert not (tmp_path / "r1").exists() and out.getvalue() == ""


def test_summary_table_first_and_last_tenth(tmp_path):
    history = [_record(s) for s in range(1, 21)]
    out = io.StringIO()
    Console(file=out, width=150).print(summary_table(history))
    row = next(line for line in out.getvalue().splitlines() if "reward_mean" in line)
    # first 0.1, last 2.0, mean of steps 1-2 = 0.15, mean of steps 19-20 = 1.95
    assert ["0.1", "2", "0.15", "1.95"] == row.replace("│", " ").split()[1:]


def test_plot_png_written(tmp_path):
    path = plot_metrics([_record(s) for s in range(1, 30)], tmp_path / "metrics.png", title="t")
    assert path == tmp_path / "metrics.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_warns(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot_metrics([_record(1)], tmp_path / "m.png") is None
    assert not (tmp_path / "m.png").exists()


def test_tensorboard_scalars_when_available(tmp_path, monkeypatch):
    from rlbatch.train import metrics

    calls = []

    class FakeWriter:
        def add_scalar(self, key, value, step):
            calls.append((key, value, step))

        def close(self):
            calls.append("closed")

    from rlbatch.train.tracking import TensorBoardSink

    sink = TensorBoardSink.__new__(TensorBoardSink)
    sink.writer = FakeWriter()
    monkeypatch.setattr(metrics, "open_sinks", lambda cfg, run_dir, start: [sink])
    log = MetricsLogger(
        tmp_path,
        LoggingConfig(tensorboard=True),
        rank=0,
        max_steps=3,
        console=Console(file=io.StringIO()),
    )
    log.log(_record(2))
    log.close()
    assert ("reward_mean", pytest.approx(0.2), 2) in calls and calls[-1] == "closed"
    assert not any(c[0] == "step" for c in calls if isinstance(c, tuple))


def test_progress_bar_on_a_terminal(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    log = MetricsLogger(
        tmp_path,
        LoggingConfig(tensorboard=False),
        rank=0,
        max_steps=4,
        resumed_step=1,
        console=console,
    )
    log.log(_record(2))
    log.close()
    text = out.getvalue()
    assert "2/4" in text and "reward 0.200" in text


def test_resume_into_a_new_run_dir_carries_the_history(tmp_path):
    history = [_record(s) for s in range(1, 4)]
    log = MetricsLogger(
        tmp_path / "new",
        LoggingConfig(tensorboard=False),
        rank=0,
        max_steps=6,
        resumed_step=3,
        history=history,
        console=Console(file=io.StringIO()),
    )
    log.log(_record(4))
    assert [r["step"] for r in read_jsonl(tmp_path / "new" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in log.history] == [1, 2, 3, 4]
