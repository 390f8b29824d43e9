"""rlbatch-export's input errors are configuration errors before any worker starts: not a run
directory, a step without a complete checkpoint (the available steps listed), a bad shard
size."""

from __future__ import annotations

import json

import pytest

from rlbatch.cli import export
from rlbatch.config.load import dump_run_config
from rlbatch.config.schema import RunConfig
from rlbatch.train import integrity


def test_parse_size():
    assert export.parse_size("2GB") == 2 * 10**9
    assert export.parse_size("40KiB") == 40 * 1024
    assert export.parse_size("1000") == 1000
    assert export.parse_size("lots") is None


def test_errors_before_launch(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        export.main([str(tmp_path), "--out", str(tmp_path / "hf")])
    assert exc.value.code == 2 and "no resolved.yaml" in " ".join(capsys.readouterr().err.split())

    cfg = RunConfig()
    cfg.run_dir = str(tmp_path)
    dump_run_config(cfg, tmp_path / "resolved.yaml")
    for step in (2, 4):
        ckpt = tmp_path / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"complete": True, "step": step}))
        integrity.write_manifest(ckpt, integrity.file_entries(ckpt, ["meta.json"]))
    with pytest.raises(SystemExit) as exc:
        export.main([str(tmp_path), "--out", "x", "--step", "3", "--max-shard-size", "big"])
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 2
    assert "--step=3" in err and "available: [2, 4]" in err and "--max-shard-size=big" in err
