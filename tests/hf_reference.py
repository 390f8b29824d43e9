"""The transformers side of rlbatch's HF parity tests: a tiny random Qwen2 saved as a local HF
directory (no download), and its per-token logprobs in float64 as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_tiny_qwen2(path: Path, num_layers: int, seed: int = 0) -> Any:
    """A random Qwen2ForCausalLM over the byte tokenizer's vocabulary, saved to ``path``."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


def save_tiny_teacher(path: Path, num_layers: int = 2, seed: int = 1) -> Any:
    """A distillation teacher for tests: :func:`save_tiny_qwen2` (another shape than the tiny
    student, no tokenizer files, the byte vocabulary's size) with its tied embeddings scaled by
    10, so that its next-token distributions are peaked, far from a fresh student's; a context
    of 1024 positions."""
    import torch

    model = save_tiny_qwen2(path, num_layers=num_layers, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)  # tied: the output layer too
    # a context that covers every run it teaches (a teacher shorter than the run is refused)
    model.config.max_position_embeddings = 1024
    model.save_pretrained(path)
    return model


def reference_logps(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[j+1] | ids[:j+1]) for j in 0..n-2, in float64."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


ROPE_THETA = 50000.0
VARIANTS = {
    # name: (transformers config class, extra config fields)
    "qwen2_theta": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2_linear": ("Qwen2Config", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2_yarn": (
        "Qwen2Config",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32}},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "llama3": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
         "rms_norm_eps": 1e-5},
    ),
}  # fmt: skip
"""Tiny random checkpoints, one per supported forward-changing option (RoPE base 50000
everywhere, so a base read as the 10000 default shows)."""


def save_tiny(path: Path, variant: str, num_layers: int = 2, legacy: bool = False) -> Any:
    """A random model of ``variant`` over the byte tokenizer's vocabulary, saved to ``path``
    by transformers (5.x layout: rope_parameters), norms and biases perturbed. ``legacy``
    rewrites config.json to the transformers 4 layout (top-level rope_theta, rope_scaling)."""
    import json

    import torch
    import transformers

    cls_name, extra = VARIANTS[variant]
    extra = dict(extra)
    rope = {"rope_type": "default", **extra.pop("rope_parameters", {}), "rope_theta": ROPE_THETA}
    config = getattr(transformers, cls_name)(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters=rope, attn_implementation="eager", **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if legacy:
        file = Path(path) / "config.json"
        data = json.loads(file.read_text())
        params = data.pop("rope_parameters")
        data["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type") != "default":
            data["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        file.write_text(json.dumps(data))
    return model


# Llama-3 style: bos variable, loop controls, tojson, raise_exception, a system default
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system = 'Be brief.' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>\n"
    "{% for m in loop_messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>\n{% endfor %}{{ {'n': loop_messages | length} | tojson }}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def save_chat_tokenizer(tmp_path: Path, as_file: bool = False) -> Path:
    """A character-level tokenizer directory with a Llama-3 style chat template (in
    tokenizer_config.json, or chat_template.jinja with ``as_file``), loadable by transformers."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp_path.mkdir(parents=True, exist_ok=True)

    vocab = {c: i for i, c in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz .,?!'\"{}:0123")))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|eot_id|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },  # fmt: skip
    }
    if as_file:
        (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_qwen_style_tokenizer(path: Path, as_vocab_merges: bool = False) -> Any:
    """A Qwen2-style byte-level BPE (the 256 bytes, Qwen's three special tokens, 5 merges: 264
    ids, the tiny model's vocabulary) trained by the ``tokenizers`` library; EOS <|im_end|>.
    Saved as tokenizer.json, or (``as_vocab_merges``) as vocab.json + merges.txt with a
    Qwen2Tokenizer tokenizer_config.json, as older checkpoints ship. Returns the tokenizer."""
    import json

    from tokenizers import ByteLevelBPETokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        ["the answer is 42, the tool says: the answer"] * 20, vocab_size=264, min_frequency=1,
        special_tokens=QWEN_SPECIALS, show_progress=False,
    )  # fmt: skip
    config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if as_vocab_merges:
        tok.save_model(str(path))
        config["tokenizer_class"] = "Qwen2Tokenizer"
        config["added_tokens_decoder"] = {
            str(tok.token_to_id(t)): {"content": t, "special": True, "normalized": False,
                                      "lstrip": False, "rstrip": False, "single_word": False}
            for t in QWEN_SPECIALS
        }  # fmt: skip
    else:
        tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def save_turn_ending_qwen2(path: Path, eos_id: int, push: float = 5.0) -> Any:
    """A tiny random Qwen2 (tied embeddings, vocabulary 264) whose ``eos_id`` embedding is moved
    towards the mean final hidden state, so that its sampled turns end with EOS after a few
    tokens (a random model almost never samples EOS); saved to ``path``."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, attn_implementation="eager", initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        u = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        model.model.embed_tokens.weight[eos_id] += push * u / u.norm()
    model.save_pretrained(path)
    return model


def save_scripted_qwen2(
    path: Path, conversation: list[int], replies: list[tuple[int, int]], max_positions: int = 1536
) -> Any:
    """A tiny Qwen2 (vocabulary 264, untied output layer) that samples given replies: its body
    is random (init std 0.3, so that its hidden states tell positions apart), and its output
    layer is fitted by cross-entropy on the body's final hidden states of ``conversation``
    (the ids of a whole conversation) so that each reply ``conversation[start:end]`` follows
    the ids before it with a probability near 1 (the fitted layer doubled: every target the top
    token by more than 16 logits, measured). Used to make a policy emit a tool call it would never sample at random;
    saved to ``path``."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=264, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, attn_implementation="eager", initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    at = [i for start, end in replies for i in range(start - 1, end - 1)]
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([conversation])).last_hidden_state[0, at]
    targets = torch.tensor([conversation[i + 1] for i in at])
    head = torch.zeros(264, hidden.shape[-1], requires_grad=True)
    optimizer = torch.optim.Adam([head], lr=0.1)
    for _ in range(600):
        loss = torch.nn.functional.cross_entropy(hidden @ head.T, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model.lm_head.weight.copy_(2.0 * head)
    model.save_pretrained(path)
    return model


def save_tiny_qwen3_moe(
    path: Path, seed: int = 0, num_layers: int = 4, max_positions: int = 256
) -> Any:
    """A random Qwen3MoeForCausalLM over the byte tokenizer's vocabulary (4 experts, top-2,
    renormalised; layer 1 dense, the others sparse), router and norms perturbed so that the
    routing is decisive and varied, saved by transformers (per-expert tensor names)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=264, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def save_tiny_qwen2_moe(path: Path, seed: int = 0) -> Any:
    """A random Qwen2MoeForCausalLM over the byte tokenizer's vocabulary: 4 experts, top-2 not
    renormalised (Qwen2-MoE's default), a shared expert behind its sigmoid gate in every sparse
    layer, q/k/v biases; layer 1 dense. Router, gate and norms perturbed so that the routing is
    decisive and the shared expert's gate is away from 0.5; saved by transformers."""
    import torch
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=264, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        mlp_only_layers=[1], max_position_embeddings=256, qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False, attn_implementation="eager", use_sliding_window=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            if name.endswith("_proj.bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def moe_reference(path: Path, rows: list[list[int]]) -> tuple[list[list[float]], float]:
    """transformers' float64 forward of a local Qwen3-MoE directory: each row's per-token
    log-probs, and the smallest gap between the k-th and (k+1)-th routing probability over
    every token and sparse layer (how far the top-k is from a tie)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager", attn_implementation="eager"
    )
    model = model.double().eval()
    k = model.config.num_experts_per_tok
    logps, margin = [], float("inf")
    with torch.no_grad():
        for ids in rows:
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
            logp = torch.log_softmax(out.logits[0], -1)
            logps.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
            for router_logits in out.router_logits:
                top = torch.softmax(router_logits, -1).topk(k + 1, dim=-1).values
                margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
    return logps, margin


def moe_reference_replayed(
    path: Path, rows: list[list[int]], routing: list[Any]
) -> list[list[float]]:
    """transformers' float64 forward of a local Qwen3-MoE directory with each sparse layer's
    experts forced: ``routing[i]`` is row i's ``[len, num_sparse_layers, k]`` expert ids (-1 =
    the router's own top-k), sparse layers in model order. The routing weights stay the
    router's: softmax over every expert, gathered at the forced ids, renormalised when
    norm_topk_prob (transformers' own rule, in float64). Returns per-token log-probs."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager", attn_implementation="eager"
    )
    model = model.double().eval()
    routers = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")  # one interface
    gates = [m for m in model.modules() if type(m).__name__ in routers]
    if not gates:  # a free forward would pass for a replayed one
        raise ValueError(f"{path}: no router of {routers} to force")
    forced: list[Any] = [None] * len(gates)

    def forward_of(slot: int, gate: Any) -> Any:
        def forward(hidden: Any) -> Any:
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1)
            ids = probs.topk(gate.top_k, dim=-1).indices
            want = forced[slot]
            ids = torch.where(want[:, :1] >= 0, want, ids)
            values = probs.gather(1, ids)
            if gate.norm_topk_prob:
                values = values / values.sum(dim=-1, keepdim=True)
            return logits, values.to(logits.dtype), ids

        return forward

    for slot, gate in enumerate(gates):
        gate.forward = forward_of(slot, gate)
    logps = []
    with torch.no_grad():
        for ids, route in zip(rows, routing, strict=True):
            route_t = torch.as_tensor(route, dtype=torch.long)  # [len, layers, k]
            for slot in range(len(gates)):
                forced[slot] = route_t[:, slot]
            out = model(input_ids=torch.tensor([ids]))
            logp = torch.log_softmax(out.logits[0], -1)
            logps.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return logps
