"""Datasets (built-in, JSONL, Parquet), chat templates and the prompt-length check."""

import json
import sys

import pytest

from rlbatch.config.schema import AnswerFormat, BuiltinTask, ChatTemplate, DataConfig, DataSource
from rlbatch.grpo.chat import QWEN_DEFAULT_SYSTEM, apply_chat_template
from rlbatch.grpo.data import DatasetError, load_examples, load_prompts, read_examples


class ByteEncoder:
    """UTF-8 bytes after a BOS id (the layout of the tiny model's byte tokenizer)."""

    bos_id = 257

    def encode(self, text):
        return [self.bos_id, *text.encode("utf-8")]


def test_builtin_prompts_tokenized_and_indexed():
    cfg = DataConfig(task=BuiltinTask.digit_copy, num_prompts=20)
    prompts = load_prompts(cfg, ByteEncoder(), seed=5)
    assert [p.index for p in prompts] == list(range(20))
    for p in prompts:
        assert p.prompt_ids == (257, *f"copy:{p.answer}=".encode())
        assert p.text == f"copy:{p.answer}="
    assert prompts == load_prompts(cfg, ByteEncoder(), seed=5)


def test_jsonl_with_custom_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"q": "1+1?", "a": 2}, {"q": "2+3?", "a": "5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cfg = DataConfig(source=DataSource.jsonl, path=str(path), prompt_key="q", answer_key="a")
    ex = load_examples(cfg, seed=0)
    assert [(e.prompt, e.answer) for e in ex] == [("1+1?", "2"), ("2+3?", "5")]


def test_jsonl_missing_key_names_row_and_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    cfg = DataConfig(source=DataSource.jsonl, path=str(path))
    with pytest.raises(ValueError, match="line 2: no field 'prompt'.*data.prompt_key"):
        load_examples(cfg, seed=0)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data.path is null but data.source=jsonl"):
        load_examples(DataConfig(source=DataSource.jsonl), seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(DataConfig(source=DataSource.jsonl, path=str(tmp_path / "x")), seed=0)


def test_too_long_prompts_are_rejected_with_their_index(tmp_path):
    path = tmp_path / "d.jsonl"
    texts = ["short", "x" * 40, "ok", "y" * 33]
    path.write_text("\n".join(json.dumps({"prompt": t, "answer": "1"}) for t in texts))
    cfg = DataConfig(source=DataSource.jsonl, path=str(path), max_prompt_len=32)
    with pytest.raises(ValueError) as err:
        load_prompts(cfg, ByteEncoder(), seed=0)
    msg = str(err.value)
    assert "data.max_prompt_len=32" in msg
    assert "line 2: prompt is 41 tokens" in msg and "line 4: prompt is 34 tokens" in msg
    assert "line 1" not in msg and msg.startswith("2 bad row(s)")


def test_parquet_without_pyarrow_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    cfg = DataConfig(source=DataSource.parquet, path=str(path))
    with pytest.raises(ValueError, match=f"data.path={path} is Parquet.*pip install pyarrow"):
        load_examples(cfg, seed=0)


def test_parquet_reads_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    ex = load_examples(DataConfig(source=DataSource.parquet, path=str(path)), seed=0)
    assert [(e.prompt, e.answer) for e in ex] == [("a", "1"), ("b", "2")]


def test_qwen_template_matches_qwen2_5_chatml():
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
        " assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert apply_chat_template(ChatTemplate.qwen, "What is 2+2?") == expected
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert apply_chat_template(ChatTemplate.qwen, msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert QWEN_DEFAULT_SYSTEM in apply_chat_template(ChatTemplate.qwen, [msgs[1]])


def test_none_template_passes_text_and_rejects_messages():
    assert apply_chat_template(ChatTemplate.none, "copy:12=") == "copy:12="
    with pytest.raises(ValueError, match="data.chat_template=none"):
        apply_chat_template(ChatTemplate.none, [{"role": "user", "content": "x"}])


def test_jsonl_chat_messages_are_templated(tmp_path):
    path = tmp_path / "d.jsonl"
    msgs = [{"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"prompt": msgs, "answer": "x"}))
    cfg = DataConfig(
        source=DataSource.jsonl, path=str(path), chat_template=ChatTemplate.qwen, max_prompt_len=200
    )
    (p,) = load_prompts(cfg, ByteEncoder(), seed=0)
    assert p.text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_every_bad_row_is_reported_at_once(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        b'{"prompt": "ok", "answer": "1"}',
        b'{"prompt": "no answer"}',
        b"{not json",
        b'{"prompt": "caf\xe9", "answer": "2"}',  # Latin-1, not UTF-8
        b'{"prompt": 7, "answer": "3"}',
        b'{"prompt": "p", "answer": null}',
        b"[1, 2]",
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(source=DataSource.jsonl, path=str(path))
    with pytest.raises(DatasetError) as err:
        load_examples(cfg, seed=0)
    assert [p.where for p in err.value.problems] == [f"line {i}" for i in (2, 3, 4, 5, 6, 7)]
    msg = str(err.value)
    assert "line 4: not UTF-8 (byte 0xe9" in msg and "line 3: not valid JSON" in msg
    assert "line 5: 'prompt' is int" in msg and "line 6: 'answer' is NoneType" in msg


def test_listing_stops_at_20_then_counts(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join("{bad" for _ in range(25)))
    with pytest.raises(DatasetError) as err:
        load_examples(DataConfig(source=DataSource.jsonl, path=str(path)), seed=0)
    msg = str(err.value)
    assert msg.startswith("25 bad row(s)") and "line 20:" in msg and "line 21:" not in msg
    assert msg.endswith("... and 5 more")


def test_gsm8k_answers_and_extra_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"question": "Q1", "answer": "3 + 4 = 7\n#### 7", "id": "a"},
        {"question": "Q2", "answer": "so 1,200 in all.\n#### 1,200", "id": "b"},
        {"question": "Q3", "answer": "no marker", "id": "c"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(
        source=DataSource.jsonl,
        path=str(path),
        prompt_key="question",
        answer_format=AnswerFormat.gsm8k,
    )
    examples, problems = read_examples(cfg, seed=0)
    assert [(e.prompt, e.answer, e.fields) for e in examples] == [
        ("Q1", "7", {"id": "a"}),
        ("Q2", "1200", {"id": "b"}),
    ]
    assert [(p.where, "####" in p.message) for p in problems] == [("line 3", True)]


def test_hf_save_to_disk_directory_is_a_source(tmp_path):
    datasets = pytest.importorskip("datasets", reason="optional extra 'datasets' not installed")
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": [1, 2], "src": ["x", "y"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(source=DataSource.hf_disk, path=str(tmp_path / "ds"))
    ex = load_examples(cfg, seed=0)
    assert [(e.prompt, e.answer, e.fields) for e in ex] == [
        ("a", "1", {"src": "x"}),
        ("b", "2", {"src": "y"}),
    ]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['train'\].*save one split"):
        load_examples(DataConfig(source=DataSource.hf_disk, path=str(tmp_path / "dd")), seed=0)
