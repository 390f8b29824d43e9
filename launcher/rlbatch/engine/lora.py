"""Low-rank adapters (LoRA) on megatron-core's parallel linear layers (docs/lora.md).

    attach_adapters(chunks, cfg.model, seed)     # before DDP: adapters in, every base weight frozen
    with adapters_disabled(chunks): ...          # the base model (the reference policy)
    merged_weight(linear)                        # this rank's shard of W + scale * B @ A (fp32 at least)
    active_branch(linear)                        # the adapters a forward applies (None: off / none)
    peft_name(layer_index, projection, "A")      # the adapter's Hugging Face PEFT tensor name
    full_adapters(chunks)                        # {PEFT name: full tensor} (gathered over tp)
    load_full_adapters(chunks, tensors)          # the inverse: full tensors into the tp shards

Each adapted megatron linear holds a child module ``lora`` (:class:`LoraBranch`) with one
(A, B) pair per Hugging Face projection it fuses, and a forward hook that adds the branch's
output to the linear's. Projections and their megatron homes (:data:`SITES`):

| megatron linear (parallel)          | HF projections             | A (tp shard)        | B (tp shard)        |
|-------------------------------------|----------------------------|---------------------|---------------------|
| self_attention.linear_qkv (column)  | q_proj, k_proj, v_proj     | [r, in] whole       | [out/tp, r] rows    |
| self_attention.linear_proj (row)    | o_proj                     | [r, in/tp] columns  | [out, r] whole      |
| mlp.linear_fc1 (column)             | gate_proj, up_proj         | [r, in] whole       | [out/tp, r] rows    |
| mlp.linear_fc2 (row)                | down_proj                  | [r, in/tp] columns  | [out, r] whole      |
| mlp.shared_experts.linear_fc1 (col) | shared_expert.gate/up_proj | [r, in] whole       | [out/tp, r] rows    |
| mlp.shared_experts.linear_fc2 (row) | shared_expert.down_proj    | [r, in/tp] columns  | [out, r] whole      |

Every projection keeps its own A and B, so the adapted model is exactly the HF model with PEFT
adapters on those modules: for q/k/v the branch computes each projection's delta in HF order and
interleaves them into megatron's fused layout (per query group: that group's query heads, its
key head, its value head), for gate/up it concatenates this rank's gate and up slices, as the
base weight does. A tp shard of B holds a contiguous block of the HF rows (a block of query
groups, of the intermediate size), so the shard of B is ``B.chunk(tp, dim=0)[tp_rank]`` and of
a row-parallel A ``A.chunk(tp, dim=1)[tp_rank]``.

Tensor parallelism gives the tp 1 forward and gradients: a column-parallel branch computes
``A x`` (rank r) on every rank, marks it with megatron's copy-to-tp-region (its gradient is
all-reduced over tp in backward, so A's gradient is the full one on every rank) and applies
its B shard; a row-parallel branch applies its A shard to its input shard, all-reduces the
rank-r partial sums (reduce-from-tp-region) and applies the whole B. With sequence
parallelism the rank-r activations are all-gathered / reduce-scattered along the sequence
instead, and the replicated factor (column A, row B) is marked ``sequence_parallel`` so that
megatron sums its gradient over tp in finalize_model_grads.

On an MoE model the adapters go on the attention of every layer and, on a Qwen2-MoE, on the
shared expert of every sparse layer (its gate/up/down projections: HF's
``mlp.shared_expert.{gate,up,down}_proj``, megatron's ``mlp.shared_experts.linear_fc1/fc2``);
config/moe_rules.py refuses the rest. A sparse layer has no ``mlp.linear_fc1`` /
``linear_fc2``; its routed experts, its router and the shared expert's sigmoid gate keep their
frozen weights.

Names in checkpoints: ``<linear>.lora.lora_A.<projection>`` / ``lora_B``, sharded in the
distributed checkpoint along the dimension above (whole factors replicated), so a checkpoint
saved at one tp loads at another. PEFT names: :func:`peft_name`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlbatch.config.lora import ALL_LINEAR, PROJECTIONS, LoraConfig, LoraInit
from rlbatch.config.schema import ModelConfig


@dataclass(frozen=True)
class Site:
    """One megatron linear of a transformer layer and the HF projections fused in it."""

    path: str
    """Module path inside a TransformerLayer."""
    column: bool
    """Column-parallel (output sharded over tp) or row-parallel (input sharded)."""
    projections: tuple[str, ...]
    """HF projections, in megatron's order inside the fused weight."""
    hf_module: str
    """The HF layer's sub-module that holds them."""
    shared_expert: bool = False
    """A Qwen2-MoE sparse layer's shared expert (its width: moe_shared_expert_intermediate_size)."""


SITES = (
    Site("self_attention.linear_qkv", True, ("q_proj", "k_proj", "v_proj"), "self_attn"),
    Site("self_attention.linear_proj", False, ("o_proj",), "self_attn"),
    Site("mlp.linear_fc1", True, ("gate_proj", "up_proj"), "mlp"),
    Site("mlp.linear_fc2", False, ("down_proj",), "mlp"),
    Site(
        "mlp.shared_experts.linear_fc1", True, ("gate_proj", "up_proj"), "mlp.shared_expert", True
    ),
    Site("mlp.shared_experts.linear_fc2", False, ("down_proj",), "mlp.shared_expert", True),
)
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the HF module path in adapter_model.safetensors."""


def targeted(lora: LoraConfig) -> tuple[str, ...]:
    """The HF projections ``lora`` adapts, in PROJECTIONS order (none when rank is 0)."""
    if lora.rank <= 0:
        return ()
    if ALL_LINEAR in lora.target_modules:
        return PROJECTIONS
    return tuple(p for p in PROJECTIONS if p in lora.target_modules)


def lora_scale(lora: LoraConfig) -> float:
    """alpha / rank (1.0 when alpha is null)."""
    alpha = float(lora.rank) if lora.alpha is None else lora.alpha
    return alpha / lora.rank


def peft_name(layer_number: int, projection: str, factor: str, site: Optional[Site] = None) -> str:
    """PEFT's tensor name of one factor ("A" or "B") of a projection's adapter in HF layer
    ``layer_number`` (0-based, the HF index; megatron's ``layer_number`` is 1-based), e.g.
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]; lora_B:
    [out, r]); ``site``: where the projection sits (default: the attention or the dense MLP;
    a shared expert's is ``...layers.3.mlp.shared_expert.gate_proj...``). The full (unsharded)
    tensor is PEFT's tensor."""
    site = site or next(s for s in SITES if projection in s.projections)
    return f"{PEFT_PREFIX}model.layers.{layer_number}.{site.hf_module}.{projection}.lora_{factor}.weight"


@dataclass(frozen=True)
class Geometry:
    """Full (unsharded) sizes of one site's projections and the tp split."""

    in_features: int
    out_features: dict[str, int]
    tp_rank: int
    tp_size: int
    heads: int
    groups: int
    head_dim: int


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _geometry(site: Site, model: ModelConfig) -> Geometry:
    rank, size = _tp()
    d = model.head_dim or model.hidden_size // model.num_attention_heads
    h, g, f = model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size
    if site.shared_expert:
        f = model.moe_shared_expert_intermediate_size or 0
    outs = {
        "q_proj": h * d, "k_proj": g * d, "v_proj": g * d, "o_proj": model.hidden_size,
        "gate_proj": f, "up_proj": f, "down_proj": model.hidden_size,
    }  # fmt: skip
    ins = {
        "self_attention.linear_proj": h * d,
        "mlp.linear_fc2": f,
        "mlp.shared_experts.linear_fc2": f,
    }
    return Geometry(
        in_features=ins.get(site.path, model.hidden_size),
        out_features={p: outs[p] for p in site.projections},
        tp_rank=rank,
        tp_size=size,
        heads=h,
        groups=g,
        head_dim=d,
    )


def initial_a(
    lora: LoraConfig, seed: int, layer_number: int, projection: str, in_features: int
) -> torch.Tensor:
    """The full A [rank, in] of one projection: drawn from its own generator seeded by (seed,
    layer, projection), so every parallel layout starts from the same adapters. kaiming: PEFT's
    kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); gaussian: N(0, 1/rank)."""
    key = (seed * 1_000_003 + layer_number * 1009 + PROJECTIONS.index(projection)) % (2**62)
    gen = torch.Generator().manual_seed(key)
    a = torch.empty(lora.rank, in_features, dtype=torch.float64)
    if LoraInit(lora.init) == LoraInit.gaussian:
        a.normal_(0.0, 1.0 / lora.rank, generator=gen)
    else:
        bound = 1.0 / math.sqrt(in_features)
        a.uniform_(-bound, bound, generator=gen)
    return a


class LoraBranch(torch.nn.Module):
    """The adapters of one megatron linear: ``lora_A[p]`` / ``lora_B[p]`` per targeted HF
    projection p (this rank's tp shards), the scale alpha / rank, dropout on the branch input,
    and ``enabled`` (False: the branch adds nothing, the linear is the base one)."""

    def __init__(
        self,
        site: Site,
        geometry: Geometry,
        projections: Sequence[str],
        lora: LoraConfig,
        *,
        sequence_parallel: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.site, self.geometry, self.rank = site, geometry, lora.rank
        self.scale = lora_scale(lora)
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else None
        self.enabled = True
        g, tp = geometry, geometry.tp_size
        a_in = g.in_features if site.column else g.in_features // tp
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for p in projections:
            b_out = g.out_features[p] // tp if site.column else g.out_features[p]
            a = torch.nn.Parameter(torch.zeros(lora.rank, a_in, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(b_out, lora.rank, dtype=dtype, device=device))
            sharded, whole = (b, a) if site.column else (a, b)
            set_tensor_model_parallel_attributes(sharded, True, 0 if site.column else 1, 1)
            if sequence_parallel:  # its gradient comes from this rank's sequence shard only
                whole.sequence_parallel = True  # type: ignore[attr-defined]
            self.lora_A[p], self.lora_B[p] = a, b

    def init_from_full(self, projection: str, full_a: torch.Tensor) -> None:
        """Set A (this rank's shard of the full [rank, in] tensor) and B = 0."""
        a = (
            full_a
            if self.site.column
            else full_a.chunk(self.geometry.tp_size, 1)[self.geometry.tp_rank]
        )
        with torch.no_grad():
            self.lora_A[projection].copy_(a)
            self.lora_B[projection].zero_()

    # ---------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """The branch's output in the linear's local output layout ([s, b, out_local])."""
        from megatron.core.tensor_parallel import mappings

        h = x
        if self.dropout is not None and self.training and torch.is_grad_enabled():
            h = self.dropout(h)
        names = list(self.lora_A.keys())
        a = torch.cat([h @ self.lora_A[p].to(h.dtype).t() for p in names], dim=-1)  # [s, b, k*r]
        if self.site.column:
            if sequence_parallel:
                a = mappings.gather_from_sequence_parallel_region(a)
            else:
                a = mappings.copy_to_tensor_model_parallel_region(a)
        elif sequence_parallel:
            a = mappings.reduce_scatter_to_sequence_parallel_region(a)
        else:
            a = mappings.reduce_from_tensor_model_parallel_region(a)
        deltas = {
            p: (ap @ self.lora_B[p].to(ap.dtype).t()) * self.scale
            for p, ap in zip(names, a.split(self.rank, dim=-1), strict=True)
        }
        return self._fuse(deltas, a.shape[:-1], a.dtype, a.device)

    def _fuse(
        self, deltas: dict[str, torch.Tensor], lead: Any, dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        """Per-projection outputs (local shards) in the fused weight's local row order; a
        projection without adapter contributes zeros."""
        g, tp = self.geometry, self.geometry.tp_size
        parts = []
        for p in self.site.projections:
            if p in deltas:
                parts.append(deltas[p])
            else:
                width = g.out_features[p] // tp if self.site.column else g.out_features[p]
                parts.append(torch.zeros(*lead, width, dtype=dtype, device=device))
        if self.site.projections[0] != "q_proj":
            return torch.cat(parts, dim=-1)
        groups = g.groups // tp
        q, k, v = (t.reshape(*lead, groups, -1) for t in parts)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    # ------------------------------------------------------------------------------ merge
    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A for every projection, in the linear's local weight layout (the same
        shape as this rank's base weight; zero rows for projections without adapter)."""
        deltas = {
            p: (self.lora_B[p].detach().double() @ self.lora_A[p].detach().double()) * self.scale
            for p in self.lora_A.keys()
        }
        in_local = self.lora_A[next(iter(self.lora_A.keys()))].shape[1]
        # rows of a weight are outputs: the same fusion as the activations, on [out, in]
        fused = self._fuse(
            {p: d.t() for p, d in deltas.items()}, (in_local,), torch.float64, deltas_device(deltas)
        )
        return fused.t()


def deltas_device(deltas: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(deltas.values())).device


def _add_branch(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of an adapted linear: (out, bias) -> (out + branch(x), bias)."""
    branch: LoraBranch = module.lora
    if not branch.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    delta = branch(x, bool(getattr(module, "sequence_parallel", False)))
    return out + delta.to(out.dtype), bias


def _sharded_state_dict(linear: Any, original: Any) -> Any:
    """The linear's sharded_state_dict with its adapters sharded along their tp dimension
    (megatron's own would save this rank's B / A shard as a replicated tensor: the 'adapter
    saved from one tp shard' bug)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded(prefix: str = "", sharded_offsets: Any = (), metadata: Any = None) -> Any:
        state = original(prefix, sharded_offsets, metadata)
        branch: LoraBranch = linear.lora
        column = branch.site.column
        axes = {
            f"lora.lora_{'B' if column else 'A'}.{p}": 0 if column else 1 for p in branch.lora_A
        }
        local = {f"lora.{k}": v for k, v in branch.state_dict(keep_vars=True).items()}
        state.update(
            make_sharded_tensors_for_checkpoint(
                local,
                prefix,
                axes,
                sharded_offsets,
                tp_group=linear.tp_group,
                dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )
        )
        return state

    return sharded


# ------------------------------------------------------------------------------- attach
def attach_adapters(chunks: Sequence[Any], model: ModelConfig, seed: int) -> int:
    """Freeze every parameter of ``chunks`` (GPTModels, before DDP wraps them) and add the
    adapters of ``model.lora`` to the targeted linears of every transformer layer. Returns the
    number of trainable parameters on this rank (0 when model.lora.rank is 0: nothing done)."""
    wanted = targeted(model.lora)
    if not wanted:
        return 0
    from rlbatch.config.schema import Dtype
    from rlbatch.engine.adapter import torch_dtype

    dtype = torch_dtype(Dtype(model.params_dtype))
    trainable = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        if chunk.config.recompute_granularity == "full" and getattr(chunk, "embedding", None):
            chunk.embedding.register_forward_hook(_input_requires_grad)
        sp = bool(chunk.config.sequence_parallel)
        for layer in chunk.decoder.layers:
            for site in SITES:
                projections = [p for p in site.projections if p in wanted]
                # a sparse layer has no dense MLP (a shared expert at most): its routed experts
                # and router are not adapted
                if projections and _has_submodule(layer, site.path):
                    linear = layer.get_submodule(site.path)
                    trainable += _attach(linear, site, projections, model, seed, layer, sp, dtype)
    return trainable


def _input_requires_grad(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on a frozen embedding under full activation recompute: its output (the
    first layer's input) requires grad. megatron recomputes each layer through a checkpoint
    function whose outputs carry a gradient only when an input does; with every base weight
    frozen no input would, and the adapters inside the layers would get no gradient at all (a
    LoRA run with model.recompute=full trained nothing, and at pp > 1 nothing on the first
    stage). Under no_grad (the log-prob passes) nothing is changed."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


def _attach(
    linear: Any,
    site: Site,
    projections: list[str],
    model: ModelConfig,
    seed: int,
    layer: Any,
    sp: bool,
    dtype: torch.dtype,
) -> int:
    geometry = _geometry(site, model)
    branch = LoraBranch(
        site, geometry, projections, model.lora, sequence_parallel=sp, dtype=dtype,
        device=linear.weight.device,
    )  # fmt: skip
    for p in projections:
        full = initial_a(model.lora, seed, layer.layer_number, p, geometry.in_features)
        branch.init_from_full(p, full)
    linear.lora = branch
    linear.register_forward_hook(_add_branch, with_kwargs=True)
    linear.sharded_state_dict = _sharded_state_dict(linear, linear.sharded_state_dict)
    return sum(t.numel() for t in branch.parameters())


def branches(chunks: Sequence[Any]) -> Iterator[tuple[int, Site, Any]]:
    """(megatron layer_number (1-based, global), site, linear) of every adapted linear."""
    from rlbatch.engine.adapter import unwrap

    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            for site in SITES:
                if not _has_submodule(layer, site.path):  # no dense MLP / shared expert here
                    continue
                linear = layer.get_submodule(site.path)
                if isinstance(getattr(linear, "lora", None), LoraBranch):
                    yield layer.layer_number, site, linear


def _has_submodule(module: Any, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def has_adapters(chunks: Sequence[Any]) -> bool:
    return next(branches(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[Any]) -> Iterator[None]:
    """Run ``chunks`` as the base model (every adapter switched off) for the duration."""
    found = [linear.lora for _, _, linear in branches(chunks)]
    states = [b.enabled for b in found]
    for b in found:
        b.enabled = False
    try:
        yield
    finally:
        for b, state in zip(found, states, strict=True):
            b.enabled = state


def merged_weight(linear: Any) -> torch.Tensor:
    """This rank's shard of the linear's weight with its adapters merged in: W + scale * B @ A
    in megatron's local layout (fused q/k/v per query group, [gate_t; up_t]), the weight itself
    when the linear has no adapters. No communication: the merge of a tp shard needs only that
    shard's factors.

    The sum is taken in float64 and rounded once, to float32 when the weight is bf16 / fp16:
    rounded to bf16, every entry whose update is under half the weight's bf16 step (most of
    them, for updates of 1e-5 on weights of 0.02) would keep its base value, and an engine fed
    that merge would sample a policy behind the trained one. A bf16 consumer casts it (one
    rounding, as before); an fp32 engine gets the adapted weight exactly."""
    weight = linear.weight.detach()
    branch: Optional[LoraBranch] = getattr(linear, "lora", None)
    if branch is None:
        return weight.clone()
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return (weight.double() + branch.delta_weight()).to(dtype)


def active_branch(linear: Any) -> Optional[LoraBranch]:
    """The linear's adapters when a forward of it applies them (present and enabled), else
    None: for code that reads weights instead of calling the module (the KV-cached decoder),
    which then adds ``branch(x)`` to ``W x`` as the forward hook does, never a merged weight."""
    branch: Optional[LoraBranch] = getattr(linear, "lora", None)
    return branch if branch is not None and branch.enabled else None


def adapter_parameters(chunks: Sequence[Any]) -> list[torch.nn.Parameter]:
    """Every adapter factor of this rank (the trainable parameters of a LoRA run)."""
    return [p for _, _, linear in branches(chunks) for p in linear.lora.parameters()]


def _tp_dim(site: Site, factor: str) -> Optional[int]:
    """The dimension a factor is split along over tp (None: whole on every rank)."""
    if site.column:
        return 0 if factor == "B" else None
    return 1 if factor == "A" else None


def _value(param: torch.nn.Parameter, grads: bool) -> torch.Tensor:
    if not grads:
        return param.detach().clone()
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    return torch.zeros_like(param) if grad is None else grad.detach().to(param.dtype, copy=True)


def full_adapters(chunks: Sequence[Any], grads: bool = False) -> dict[str, torch.Tensor]:
    """{PEFT tensor name (:func:`peft_name`): full tensor} of this rank's layers, or their
    gradients (``grads``: main_grad / grad). The tp shards are gathered (a collective over the
    tensor-parallel group: every tp rank calls); each pipeline stage returns its own layers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if size > 1 else None
    out: dict[str, torch.Tensor] = {}
    for number, site, linear in branches(chunks):
        for p in linear.lora.lora_A:
            for factor in ("A", "B"):
                t = _value(getattr(linear.lora, f"lora_{factor}")[p], grads)
                dim = _tp_dim(site, factor)
                if dim is not None and size > 1:
                    parts = [torch.empty_like(t) for _ in range(size)]
                    dist.all_gather(parts, t.contiguous(), group=group)
                    t = torch.cat(parts, dim=dim)
                out[peft_name(number - 1, p, factor, site)] = t
    return out


def load_full_adapters(chunks: Sequence[Any], tensors: dict[str, torch.Tensor]) -> int:
    """Copy full adapters ({PEFT name: tensor}, e.g. a PEFT adapter_model.safetensors) into
    this rank's shards; returns the number of tensors copied. Every adapter of the model must
    be in ``tensors``."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    copied = 0
    with torch.no_grad():
        for number, site, linear in branches(chunks):
            for p in linear.lora.lora_A:
                for factor in ("A", "B"):
                    param = getattr(linear.lora, f"lora_{factor}")[p]
                    full = tensors[peft_name(number - 1, p, factor, site)]
                    dim = _tp_dim(site, factor)
                    shard = full if dim is None else full.chunk(size, dim=dim)[rank]
                    param.copy_(shard.to(param.dtype))
                    copied += 1
    return copied


# --------------------------------------------------------------------------- checkpoints
def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key names an adapter factor."""
    return ".lora.lora_A." in name or ".lora.lora_B." in name


def mark_base_loaded(chunks: Sequence[Any], source: str) -> None:
    """Record that the frozen base weights of ``chunks`` came from ``source`` (model.hf_path):
    checkpoints then hold the adapters only, and a resume rebuilds the base from there."""
    from rlbatch.engine.adapter import unwrap

    for chunk in chunks:
        unwrap(chunk).lora_base_source = source


def saves_adapters_only(chunks: Sequence[Any]) -> bool:
    """A LoRA model whose base weights were loaded from a file: its checkpoint holds the
    adapters only (a randomly initialised base is saved whole: nothing else could restore it
    under another parallel layout)."""
    from rlbatch.engine.adapter import unwrap

    return has_adapters(chunks) and all(
        getattr(unwrap(c), "lora_base_source", None) for c in chunks
    )
