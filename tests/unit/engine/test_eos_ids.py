"""The run's end-of-response ids: the tokenizer's own (its eos_token, then every eos_token_id of
its directory's generation_config.json / config.json, as Hugging Face's generate stops) plus
model.extra_eos_token_ids; a bad extra id is a config error before launch; every consumer of a
response (rewards, the megatron_dynamic cut) reads the whole set; exports write it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlbatch.config.schema import ModelConfig
from rlbatch.engine.tokenizer import build_tokenizer, tokenizer_errors


def _chat_tokenizer_dir(path):
    """A word-level tokenizer whose chat model ends a turn with <|eot|> (tokenizer_config's
    eos_token) and a document with <|end|>; generation_config lists both, config.json one."""
    import tokenizers

    vocab = {"<pad>": 0, "<|end|>": 1, "[UNK]": 2, "hello": 3, "<|eot|>": 4, "world": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(["<pad>", "<|end|>", "<|eot|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    return path


def test_a_tokenizer_ends_at_its_eos_token_and_every_listed_eos_id(tmp_path):
    tok = build_tokenizer(replace(ModelConfig(), tokenizer_path=str(_chat_tokenizer_dir(tmp_path))))
    assert tok.eos_id == 4  # tokenizer_config's eos_token stays the primary
    assert tok.eos_ids == (4, 1)


def test_extra_eos_token_ids_add_to_the_tokenizers_own():
    assert build_tokenizer(ModelConfig()).eos_ids == (258,)  # the byte tokenizer
    tok = build_tokenizer(ModelConfig(extra_eos_token_ids=[35, 258, 10]))
    assert (tok.eos_id, tok.eos_ids) == (258, (258, 35, 10))


def test_an_extra_eos_id_outside_the_vocabulary_is_a_config_error(tmp_path):
    errors = tokenizer_errors(ModelConfig(extra_eos_token_ids=[35, 300]))
    assert len(errors) == 1 and "model.extra_eos_token_ids=[35, 300]" in str(errors[0])
    assert "300" in errors[0].message and "0..258" in errors[0].message
    hf = replace(ModelConfig(), tokenizer_path=str(_chat_tokenizer_dir(tmp_path)))
    assert tokenizer_errors(replace(hf, extra_eos_token_ids=[5])) == []
    assert "0..5" in str(tokenizer_errors(replace(hf, extra_eos_token_ids=[6]))[0])


def test_rewards_see_a_response_without_whichever_eos_ended_it():
    from rlbatch.grpo.rewards import reward_input
    from rlbatch.grpo.types import Prompt, Sample

    tok = build_tokenizer(ModelConfig(extra_eos_token_ids=[35]))
    prompt = Prompt(index=0, prompt_ids=(104,), answer="")
    for end in (258, 35):
        sample = Sample(prompt, 0, [104, 105, end], [-1.0] * 3, truncated=False, policy_version=0)
        assert reward_input(sample, tok).response == "hi"


def test_megatron_dynamic_rows_are_cut_at_the_first_eos_of_the_set():
    from rlbatch.engine.dynamic_inference import cut_at_eos

    assert cut_at_eos([5, 7, 9, 3], [-1.0, -2.0, -3.0, -4.0], (3, 7)) == (
        [5, 7],
        [-1.0, -2.0],
        False,
    )
    assert cut_at_eos([5, 6], [-1.0, -2.0], (3, 7)) == ([5, 6], [-1.0, -2.0], True)


@pytest.mark.parametrize("copied", [False, True])
def test_an_export_writes_the_runs_eos_ids_into_both_configs(tmp_path, copied):
    """config.json and generation_config.json of an export carry every end id: a reader that
    falls back to the architecture's defaults (LlamaConfig: EOS 2) would stop elsewhere."""
    from rlbatch.engine.hf import write_side_files
    from rlbatch.engine.hf_config import hf_config_dict

    (tmp_path / "src").mkdir()
    src = _chat_tokenizer_dir(tmp_path / "src")
    if not copied:
        (src / "generation_config.json").unlink()
    model = replace(ModelConfig(), tokenizer_path=str(src), extra_eos_token_ids=[5])
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(
        json.dumps(hf_config_dict(replace(model, architecture="llama")))
    )
    write_side_files(model, out)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["eos_token_id"] == [4, 1, 5]


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(__file__).parents[3] / "conf" / "model").glob("*.yaml"))
)
def test_extra_eos_token_ids_is_set_as_documented_on_every_model_preset(preset):
    """``model.extra_eos_token_ids=[...]`` (the form docs/rollout.md shows, no ``+``) composes
    with every model preset and reaches the run's config: no preset spells the key, so without
    a default in the primary config Hydra refused the override ("Key 'extra_eos_token_ids' is
    not in struct")."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(
            config_name="config", overrides=[f"model={preset}", "model.extra_eos_token_ids=[10]"]
        )
    assert list(cfg.model.extra_eos_token_ids) == [10]


def test_extra_eos_token_ids_reaches_the_validated_run_config():
    from rlbatch.cli.common import compose

    cfg = compose(["+recipe=grpo_qwen", "model.extra_eos_token_ids=[10,32]"], "t")
    assert cfg.model.extra_eos_token_ids == [10, 32]
    assert build_tokenizer(cfg.model).eos_ids == (258, 10, 32)
