"""LoRA adapters on megatron's parallel linears, single process, against independent float64
math: y = W x + b + (alpha / r) B A x per Hugging Face projection (q/k/v and gate/up taken
apart in HF order), and a transformers Qwen2 whose projections carry W + (alpha / r) B A."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from engine_helpers import make_plan, megatron_world, padded_mb, tiny_cfg  # noqa: F401

from rlbatch.config.schema import ModelConfig
from rlbatch.engine import hf, lora, schedule
from rlbatch.engine import model as engine_model
from rlbatch.engine.adapter import unwrap

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def _lora_cfg(cfg, **lora_fields):
    fields = dict(rank=RANK, alpha=ALPHA) | lora_fields
    cfg.model = replace(cfg.model, lora=replace(cfg.model.lora, **fields))
    return cfg


def _randomize_adapters(chunks, seed: int = 3) -> None:
    """Non-zero B (a fresh adapter has B = 0, which would hide any layout error)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(chunks):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value (fp32 against float64)."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _adapters(linear) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{projection: (A, B)} of a linear as float64 leaves."""
    branch = linear.lora
    return {
        p: (
            branch.lora_A[p].detach().double().requires_grad_(),
            branch.lora_B[p].detach().double().requires_grad_(),
        )
        for p in branch.lora_A
    }


def _hf_split(t: torch.Tensor, site: lora.Site, m: ModelConfig) -> list[torch.Tensor]:
    """Megatron's fused rows (dim 0) of one linear -> the HF projections' rows, in order."""
    if site.projections[0] == "q_proj":
        d = m.hidden_size // m.num_attention_heads
        return list(hf.split_qkv(t, m.num_attention_heads, m.num_query_groups, d))
    return list(t.chunk(len(site.projections)))


def _with_shared_expert(cfg):
    """The tiny model as a Qwen2-MoE: every layer sparse (4 experts, top 2) with a shared
    expert of width 24 (a width of its own, so a wrong geometry shows)."""
    from rlbatch.config.schema import Architecture

    cfg.model = replace(
        cfg.model, architecture=Architecture.qwen2_moe, qk_layernorm=False, num_moe_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24,
    )  # fmt: skip
    return cfg


@pytest.mark.parametrize("site", lora.SITES, ids=lambda s: s.path)
def test_linear_forward_and_gradients_match_float64(tiny_cfg, site):
    """Every site, a Qwen2-MoE's shared expert included."""
    cfg = _lora_cfg(_with_shared_expert(tiny_cfg) if site.shared_expert else tiny_cfg)
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    _randomize_adapters(chunks)
    linear = chunks[0].decoder.layers[1].get_submodule(site.path)
    m = cfg.model
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 2, linear.weight.shape[1], generator=g)  # [s, b, in]
    out, bias = linear(x)
    if bias is not None:
        out = out + bias
    upstream = torch.randn(out.shape, generator=g)
    (out * upstream).sum().backward()

    # float64, HF projection by projection
    weights = _hf_split(linear.weight.detach().double(), site, m)
    biases = (
        _hf_split(linear.bias.detach().double(), site, m)
        if getattr(linear, "bias", None) is not None and site.column
        else [None] * len(weights)
    )
    ups = _hf_split(upstream.double().permute(2, 0, 1), site, m)
    factors = _adapters(linear)
    xd = x.double()
    loss = torch.zeros((), dtype=torch.float64)
    for p, w, b, up in zip(site.projections, weights, biases, ups, strict=True):
        y = xd @ w.t() + (0 if b is None else b)
        if p in factors:
            a_, b_ = factors[p]
            y = y + SCALE * (xd @ a_.t()) @ b_.t()
        loss = loss + (y * up.permute(1, 2, 0)).sum()
        got = _hf_split(out.detach().double().permute(2, 0, 1), site, m)[site.projections.index(p)]
        assert _rel(got.permute(1, 2, 0), y.detach()) < 1e-5, p
    loss.backward()
    assert set(factors) == set(site.projections)
    for p, (a_, b_) in factors.items():
        assert _rel(linear.lora.lora_A[p].grad, a_.grad) < 1e-5, p
        assert _rel(linear.lora.lora_B[p].grad, b_.grad) < 1e-5, p
        assert b_.grad.abs().sum() > 0 and a_.grad.abs().sum() > 0
    assert linear.weight.grad is None  # frozen


def _hf_qwen2(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(1)
    ref = transformers.Qwen2ForCausalLM(config).float().eval()
    ref.save_pretrained(tmp_path / "base")
    return ref, tmp_path / "base"


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj", "down_proj"]])
def test_model_equals_transformers_with_adapted_projections(megatron_world, tmp_path, targets):
    """Whole model, HF weights loaded, some projections adapted: logits equal transformers'
    Qwen2 (float64) whose adapted projections carry W + scale * B @ A (what PEFT computes);
    with adapters disabled they equal the base model's; merged weights equal the adapters."""
    ref, path = _hf_qwen2(tmp_path)
    cfg = replace(megatron_world)
    cfg.model, _ = hf.resolve_model_config(replace(ModelConfig(), hf_path=str(path)))
    cfg = _lora_cfg(cfg, target_modules=targets)
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    hf.load_hf_into(chunks, path)
    _randomize_adapters(chunks)
    lengths = [9, 4]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    inputs = schedule.make_inputs(seqs, padded_mb(range(2), lengths, 4))
    attn = torch.zeros_like(inputs.tokens)
    for j, n in enumerate(lengths):
        attn[j, :n] = 1
    with torch.no_grad():
        ours = schedule.model_forward(chunks[0].eval(), inputs).double()
        with lora.adapters_disabled(chunks):
            base = schedule.model_forward(chunks[0], inputs).double()
        theirs_base = ref.double()(input_ids=inputs.tokens, attention_mask=attn).logits
        adapted = 0
        for number, site, linear in lora.branches(chunks):
            for p in linear.lora.lora_A:
                mod = getattr(getattr(ref.model.layers[number - 1], site.hf_module), p)
                a_, b_ = (t.double() for t in (linear.lora.lora_A[p], linear.lora.lora_B[p]))
                mod.weight += SCALE * b_ @ a_
                adapted += 1
        theirs = ref(input_ids=inputs.tokens, attention_mask=attn).logits
    want = 2 * (7 if targets == ["all-linear"] else 3)
    assert adapted == want
    for j, n in enumerate(lengths):
        torch.testing.assert_close(ours[j, :n], theirs[j, :n], rtol=0, atol=2e-5)
        torch.testing.assert_close(base[j, :n], theirs_base[j, :n], rtol=0, atol=2e-5)
        assert (ours[j, :n] - base[j, :n]).abs().max() > 1e-2

    # merged weights in place of the base ones, adapters off: the adapted model again
    with torch.no_grad():
        for _, _, linear in lora.branches(chunks):
            linear.weight.copy_(lora.merged_weight(linear))
        with lora.adapters_disabled(chunks):
            merged = schedule.model_forward(chunks[0], inputs).double()
    for j, n in enumerate(lengths):
        torch.testing.assert_close(merged[j, :n], ours[j, :n], rtol=0, atol=2e-5)


def test_only_adapters_train(tiny_cfg):
    """Base weights frozen before DDP: DDP's gradient buffer and the optimizer hold the
    adapters only; after a step the base weights are unchanged and the adapters moved."""
    cfg = _lora_cfg(tiny_cfg)
    chunks = engine_model.build_model(cfg)
    optimizer, _ = engine_model.build_optimizer(cfg, chunks)
    model = unwrap(chunks[0])
    adapters = {id(p) for p in lora.adapter_parameters(chunks)}
    trainable = engine_model.num_trainable_parameters(chunks)
    # 2 layers x (qkv: 3 A [4, 64] + B [64|32|32, 4]; o: A [4, 64] + B [64, 4];
    #             fc1: 2 A [4, 64] + 2 B [176, 4]; fc2: A [4, 176] + B [64, 4])
    per_layer = (3 * 256 + 128 * 4) + (256 + 256) + (2 * 256 + 352 * 4) + (704 + 256)
    assert trainable == 2 * per_layer
    assert sum(b.grad_data.numel() for b in chunks[0].buffers) == trainable
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in in_optimizer) == trainable
    for name, p in model.named_parameters():
        assert p.requires_grad == (id(p) in adapters), name

    _randomize_adapters(chunks)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in (9, 6)]
    plan = make_plan([[padded_mb([0, 1], [9, 6])]])
    optimizer.zero_grad()
    for c in chunks:
        c.zero_grad_buffer()
    schedule.run_pass(
        chunks, plan.ranks[0], plan,
        lambda mb: schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4),
        schedule.next_token_loss,
    )  # fmt: skip
    assert optimizer.step()[0]
    for name, p in model.named_parameters():
        assert (not torch.equal(p.detach(), before[name])) == (id(p) in adapters), name


def _adapter_grads(cfg) -> dict[str, torch.Tensor]:
    """The adapters' gradients after one next-token pass (randomized adapters, fixed batch)."""
    from rlbatch.engine import parallel

    parallel.seed(cfg.trainer.seed)  # the same base weights for every build
    chunks = engine_model.build_model(cfg)
    _randomize_adapters(chunks)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in (9, 6)]
    plan = make_plan([[padded_mb([0, 1], [9, 6])]])
    schedule.run_pass(
        chunks, plan.ranks[0], plan,
        lambda mb: schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4),
        schedule.next_token_loss,
    )  # fmt: skip
    model = unwrap(chunks[0])
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_adapters_train_under_full_recompute_as_without_it(tiny_cfg):
    """model.recompute=full with LoRA: the frozen embedding's output is the first recomputed
    layer's input, and megatron's checkpoint passes a gradient only when an input needs one:
    the adapters got none at all (the run trained nothing). They get the same gradients as
    without recompute."""
    want = _adapter_grads(_lora_cfg(tiny_cfg))
    full = _lora_cfg(tiny_cfg)
    full.model = replace(full.model, recompute="full")
    got = _adapter_grads(full)
    assert got.keys() == want.keys() and want
    assert all(want[n].abs().max() > 0 for n in want)
    for n in want:
        # fp32 rounding of the recomputed forward: up to 2.4e-7 on this CPU, on gradients of
        # magnitude 0.3-3 (an adapter without its gradient would be off by the whole value)
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_initial_adapters_start_at_base_and_do_not_depend_on_layout(tiny_cfg):
    """B = 0 (the adapted model is the base model at step 0); A drawn per (seed, layer,
    projection): kaiming bound 1 / sqrt(in), gaussian std 1 / rank."""
    cfg = _lora_cfg(tiny_cfg)
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    for number, _, linear in lora.branches(chunks):
        for p, a in linear.lora.lora_A.items():
            assert torch.count_nonzero(linear.lora.lora_B[p]) == 0
            want = lora.initial_a(cfg.model.lora, cfg.trainer.seed, number, p, a.shape[1])
            torch.testing.assert_close(a.double(), want, rtol=0, atol=1e-7)
            assert a.abs().max() <= a.shape[1] ** -0.5
    gauss = lora.initial_a(replace(cfg.model.lora, rank=64, init="gaussian"), 1, 1, "q_proj", 4096)
    assert abs(gauss.std().item() - 1 / 64) < 1e-3


def test_dropout_only_in_training_passes(tiny_cfg):
    cfg = _lora_cfg(tiny_cfg, dropout=0.5)
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    _randomize_adapters(chunks)
    linear = chunks[0].decoder.layers[0].mlp.linear_fc2
    x = torch.randn(6, 1, linear.weight.shape[1])
    with torch.no_grad():
        eval_a, eval_b = linear(x)[0], linear(x)[0]
    train_a, train_b = linear(x)[0], linear(x)[0]
    assert torch.equal(eval_a, eval_b)
    assert not torch.equal(train_a, train_b)
    with lora.adapters_disabled(chunks):
        base = linear(x)[0]
    torch.testing.assert_close(base, x @ linear.weight.t())


def _train_steps(cfg, chunks, optimizer, num_steps: int) -> None:
    """Real next-token passes and optimizer steps (the adapters move)."""
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in (9, 6, 12)]
    plan = make_plan([[padded_mb([0, 1], [9, 6]), padded_mb([2], [12])]])
    for _ in range(num_steps):
        optimizer.zero_grad()
        for c in chunks:
            c.zero_grad_buffer()
        schedule.run_pass(
            chunks, plan.ranks[0], plan,
            lambda mb: schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4),
            schedule.next_token_loss,
        )  # fmt: skip
        assert optimizer.step()[0]


def test_rollout_engine_samples_the_adapted_policy(tiny_cfg):
    """After LoRA steps the built-in engine's behaviour log-probs are the trainer's forward with
    the adapters on (the policy it trains), not the base model's: the "rollouts keep sampling
    the base model" bug cannot happen with rollout.backend=megatron."""
    from rlbatch.grpo.stages import make_logps_fn
    from rlbatch.grpo.types import Prompt
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

    cfg = _lora_cfg(tiny_cfg)
    cfg.trainer.optim.lr = 5e-2
    chunks = engine_model.build_model(cfg)
    optimizer, _ = engine_model.build_optimizer(cfg, chunks)
    _train_steps(cfg, chunks, optimizer, 3)
    assert all(torch.count_nonzero(b) > 0 for n, b in _named_adapters(chunks) if "lora_B" in n)

    prompts = [Prompt(index=i, prompt_ids=(5 + i, 17, 33), answer="") for i in range(2)]
    engine = MegatronRolloutEngine(chunks, SamplingParams(max_new_tokens=8, eos_id=-1))
    samples = engine.generate(prompts, 2, 3, seed=4)
    cfg.grpo.num_generations = 2
    trainer = make_logps_fn(chunks, cfg)(samples)
    with lora.adapters_disabled(chunks):
        base = make_logps_fn(chunks, cfg)(samples)
    gap = 0.0
    for s, want, off in zip(samples, trainer, base, strict=True):
        assert s.behaviour_logps == pytest.approx(want, abs=1e-5)
        gap = max(gap, max(abs(a - b) for a, b in zip(want, off, strict=True)))
    assert gap > 1e-2  # the adapters changed the policy the engine samples


def _named_adapters(chunks):
    model = unwrap(chunks[0])
    return [(n, p) for n, p in model.named_parameters() if lora.is_adapter_key(n)]


@pytest.mark.slow  # a bf16 policy of hidden 512: ~50 s on 2 cores
def test_bf16_engine_samples_adapter_updates_smaller_than_a_bf16_step():
    """An adapter update of rms 1e-5 on bf16 weights whose bf16 step is larger than twice every
    entry of it (tests/lora_bf16.py): merged into the weights and rounded to bf16 it vanishes;
    the built-in engine applies the adapters unmerged, as training does, so its behaviour
    log-probs equal the trainer's forward within bf16 noise instead of lagging by the
    update's whole effect."""
    import lora_bf16

    gap = lora_bf16.builtin_gap()
    assert gap.effect > 1e-3, gap  # the trainer's forward sees the update
    assert abs(gap.mean_gap) < 0.35 * gap.effect, gap  # a merged engine: mean gap ~ -effect
    assert gap.max_gap < 2 * gap.max_noise, gap  # per token: bf16 noise of two kernels
