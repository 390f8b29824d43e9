"""Hugging Face Qwen2 interop: load a local HF directory into the Megatron chunks, export back.

    fields = config_from_hf(path)          # ModelConfig fields from config.json
    load_hf_into(model, path)              # any tp / pp / vpp split; sharded index included
    export_hf(model, cfg.model, out_dir)   # config.json + model.safetensors (rank 0 writes)

Layouts (megatron-core local and TE specs):
- q/k/v -> ``linear_qkv`` fused **per query group**: for each KV head g, the rows of its
  num_heads/num_groups query heads, then k_g, then v_g (bias likewise). Column-parallel: tp
  rank t holds a contiguous block of groups.
- gate/up -> ``linear_fc1``: tp rank t holds [gate_t; up_t] (its slices of both).
- o_proj / down_proj -> row-parallel ``linear_proj`` / ``linear_fc2`` (split on dim 1).
- embed_tokens / lm_head: vocab-parallel (split on dim 0). Tied embeddings: the last stage's
  output_layer copy (pp > 1) is loaded from embed_tokens; the export writes no lm_head.
Layers are matched by megatron's global ``layer_number``, so pipeline splits need no
bookkeeping here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlbatch.config.schema import ModelConfig

# config.json <-> ModelConfig lives in the torch-free hf_config (re-exported here)
from rlbatch.engine.hf_config import (
    ARCH_FIELDS,
    HF_CONFIG,
    config_from_hf,
    head_dim_of,
    hf_config_dict,
    read_hf_config,
    resolve_model_config,
    special_ids,
)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

__all__ = [
    "ARCH_FIELDS", "HF_CONFIG", "INDEX", "SINGLE", "HFWeights", "config_from_hf", "export_hf",
    "gather_full", "gather_to_root", "hf_config_dict", "load_hf_into", "read_hf_config",
    "resolve_model_config",
]  # fmt: skip


# ------------------------------------------------------------------------- weight access
class HFWeights:
    """Lazy reader of a local safetensors checkpoint (single file or sharded index)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model.hf_path={path}: no *.safetensors files")
            weight_map = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    weight_map.update({k: file.name for k in f.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} not found")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        return self._open[file].get_tensor(name)


# ------------------------------------------------------------------------ tp slicing
def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _expert_tp() -> tuple[int, int, Any]:
    """(rank, size, group) of the experts' tensor parallelism (megatron's expert-tp group)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_group(),
    )


def _tp_of(kind: str) -> tuple[int, int, Any]:
    """Routed experts' tensors ('e' kinds) shard over the expert-tp group, the rest over tp."""
    return _expert_tp() if kind.startswith("e") else _tp()


def _first_expert(chunk_layer: Any) -> int:
    """Global index of this rank's first routed expert of an MoE layer (ep rank * local)."""
    return int(chunk_layer.mlp.local_expert_indices[0])


def is_expert_tensor(hf_name: str) -> bool:
    """An HF tensor of one routed expert (held by one expert-parallel rank)."""
    return ".mlp.experts." in hf_name


_EXPERT_INDEX = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")


def _expert_parallel() -> tuple[int, int, Any]:
    """(rank, size, group) of expert parallelism (the ranks that hold different experts)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_group(),
    )


def with_every_expert(
    tensors: Iterator[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (one chunk's HF-named full tensors, this rank's routed experts only) with
    every routed expert: each expert tensor is gathered over the expert-parallel group and
    yielded once per expert-parallel rank under that rank's global expert index (ranks hold
    equal, contiguous blocks of experts and iterate their tensors in the same order).
    Collective over the expert-parallel group: its ranks iterate to the end in step."""
    rank, size, group = _expert_parallel()
    if size == 1:
        yield from tensors
        return
    local = num_experts // size
    for name, tensor in tensors:
        if not is_expert_tensor(name):
            yield name, tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        for other, part in enumerate(parts):
            yield _expert_renumbered(name, (other - rank) * local), part


def _expert_renumbered(hf_name: str, shift: int) -> str:
    """``hf_name`` of routed expert E as the name of expert E + ``shift``."""
    return _EXPERT_INDEX.sub(lambda m: f"{m[1]}{int(m[2]) + shift}{m[3]}", hf_name, count=1)


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[nh*d, ...], [ng*d, ...], [ng*d, ...] -> per-group [q_g; k_g; v_g] rows."""
    qs, ks, vs = q.chunk(groups), k.chunk(groups), v.chunk(groups)
    return torch.cat([torch.cat([qs[g], ks[g], vs[g]]) for g in range(groups)])


def split_qkv(fused: torch.Tensor, heads: int, groups: int, head_dim: int):
    per_group = (heads // groups + 2) * head_dim
    q_rows = heads // groups * head_dim
    parts = fused.split(per_group)
    q = torch.cat([p[:q_rows] for p in parts])
    k = torch.cat([p[q_rows : q_rows + head_dim] for p in parts])
    v = torch.cat([p[q_rows + head_dim :] for p in parts])
    return q, k, v


# ------------------------------------------------------------------------ name mapping
def _chunks(model: Any) -> list[Any]:
    from rlbatch.engine.adapter import unwrap

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [unwrap(c) for c in chunks]


def _norm_names(layer_prefix: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, str]:
    """Local spec: separate RMSNorm modules; TE spec: norms fused into linear_qkv / fc1."""
    te_in = f"{layer_prefix}self_attention.linear_qkv.layer_norm_weight"
    if te_in in params:
        return te_in, f"{layer_prefix}mlp.linear_fc1.layer_norm_weight"
    return f"{layer_prefix}input_layernorm.weight", f"{layer_prefix}pre_mlp_layernorm.weight"


Full = Callable[[], torch.Tensor]


def _targets(chunk: Any, model_cfg: ModelConfig) -> Iterator[tuple[str, str, Any]]:
    """(megatron param name, kind, hf source) for every parameter of one chunk. kind says how
    a full HF tensor maps onto the tp shard: 'rep', 'row' (dim 0), 'col' (dim 1), 'qkv_w',
    'qkv_b', 'fc1'. source: an HF name or a tuple of names."""
    params = dict(chunk.named_parameters())
    if "embedding.word_embeddings.weight" in params:
        yield "embedding.word_embeddings.weight", "row", "model.embed_tokens.weight"
    for local, layer in enumerate(chunk.decoder.layers):
        n = layer.layer_number - 1
        pre, hf = f"decoder.layers.{local}.", f"model.layers.{n}."
        norm_in, norm_mlp = _norm_names(pre, params)
        yield norm_in, "rep", hf + "input_layernorm.weight"
        yield norm_mlp, "rep", hf + "post_attention_layernorm.weight"
        attn = hf + "self_attn."
        yield (
            pre + "self_attention.linear_qkv.weight",
            "qkv_w",
            tuple(attn + f"{x}_proj.weight" for x in "qkv"),
        )
        if pre + "self_attention.linear_qkv.bias" in params:
            yield (
                pre + "self_attention.linear_qkv.bias",
                "qkv_b",
                tuple(attn + f"{x}_proj.bias" for x in "qkv"),
            )
        if pre + "self_attention.q_layernorm.weight" in params:  # Qwen3 QK-norm
            yield pre + "self_attention.q_layernorm.weight", "rep", attn + "q_norm.weight"
            yield pre + "self_attention.k_layernorm.weight", "rep", attn + "k_norm.weight"
        yield pre + "self_attention.linear_proj.weight", "col", attn + "o_proj.weight"
        if hasattr(layer.mlp, "router"):
            yield from _moe_targets(layer, pre, hf)
            continue
        yield (
            pre + "mlp.linear_fc1.weight",
            "fc1",
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
        )
        yield pre + "mlp.linear_fc2.weight", "col", hf + "mlp.down_proj.weight"
    if "decoder.final_layernorm.weight" in params:
        yield "decoder.final_layernorm.weight", "rep", "model.norm.weight"
    if "output_layer.weight" in params:
        src = "model.embed_tokens.weight" if model_cfg.tie_word_embeddings else "lm_head.weight"
        yield "output_layer.weight", "row", src


def _moe_targets(layer: Any, pre: str, hf: str) -> Iterator[tuple[str, str, Any]]:
    """An MoE layer's router (replicated) and this rank's routed experts, each under its
    released per-expert name (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, E
    global: ep rank * local experts + local index)."""
    yield pre + "mlp.router.weight", "rep", hf + "mlp.gate.weight"
    if getattr(layer.mlp, "shared_experts", None) is not None:  # Qwen2-MoE: every data rank
        shared, theirs = f"{pre}mlp.shared_experts.", f"{hf}mlp.shared_expert."
        yield (
            shared + "linear_fc1.weight",
            "fc1",
            (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
        )
        yield shared + "linear_fc2.weight", "col", theirs + "down_proj.weight"
        yield shared + "gate_weight", "rep", hf + "mlp.shared_expert_gate.weight"
    first = _first_expert(layer)
    for local in range(len(layer.mlp.experts.local_experts)):
        mine = f"{pre}mlp.experts.local_experts.{local}."
        theirs = f"{hf}mlp.experts.{first + local}."
        yield (
            mine + "linear_fc1.weight",
            "efc1",
            (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
        )
        yield mine + "linear_fc2.weight", "ecol", theirs + "down_proj.weight"


def _shard_for(
    kind: str, src: Any, read: Callable[[str], torch.Tensor], cfg: ModelConfig, tp: tuple[int, int]
):
    rank, size = tp
    kind = kind.removeprefix("e")
    if kind == "rep":
        return read(src)
    if kind == "row":
        return _shard(read(src), 0, rank, size)
    if kind == "col":
        return _shard(read(src), 1, rank, size)
    if kind in ("qkv_w", "qkv_b"):
        q, k, v = (read(s) for s in src)
        fused = fuse_qkv(q, k, v, groups=cfg.num_query_groups)
        return _shard(fused, 0, rank, size)
    if kind == "fc1":
        gate, up = (read(s) for s in src)
        return torch.cat([_shard(gate, 0, rank, size), _shard(up, 0, rank, size)])
    raise AssertionError(kind)


def _model_cfg_of(chunk: Any) -> ModelConfig:
    c = chunk.config
    emb = getattr(chunk, "vocab_size", None)
    return ModelConfig(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups or c.num_attention_heads,
        head_dim=c.kv_channels,
        vocab_size=emb if emb is not None else 0,
        tie_word_embeddings=bool(chunk.share_embeddings_and_output_weights),
    )


def load_hf_into(model: Any, path: str | Path) -> int:
    """Copy a local HF Qwen2 checkpoint into this rank's chunks (its tp shard, its layers).
    Returns the number of parameters loaded. Shapes are checked; a missing tensor raises."""
    weights = HFWeights(path)
    loaded = 0
    for chunk in _chunks(model):
        cfg = _model_cfg_of(chunk)
        params = dict(chunk.named_parameters())
        with torch.no_grad():
            for name, kind, src in _targets(chunk, cfg):
                value = _shard_for(kind, src, weights.get, cfg, _tp_of(kind)[:2])
                param = params[name]
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{path}: {src} gives {tuple(value.shape)} for {name} {tuple(param.shape)} "
                        "(model config and checkpoint disagree: use config_from_hf)"
                    )
                param.copy_(value.to(param.dtype))
                loaded += 1
    return loaded


# ------------------------------------------------------------------------------ export
def _gather_tp(t: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    return torch.zeros_like(param) if grad is None else grad.detach().to(param.dtype, copy=True)


def _weight_of(chunk: Any, name: str, param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's value for export: a LoRA-adapted linear's weight with its adapters merged
    in (rlbatch.engine.lora.merged_weight; the base weight while they are disabled), any other
    parameter as it is."""
    from rlbatch.engine import lora

    owner, _, leaf = name.rpartition(".")
    module = chunk.get_submodule(owner) if owner else chunk
    branch = getattr(module, "lora", None)
    if leaf == "weight" and isinstance(branch, lora.LoraBranch) and branch.enabled:
        return lora.merged_weight(module)
    return param.detach().clone()


def iter_full_tensors(
    chunk: Any, cfg: ModelConfig, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor or gradient) of one chunk, one tensor at a time (tp shards
    gathered: collective over tp, every tp rank iterates in step). A tied model's
    ``output_layer`` is left out (the embedding is the lm head)."""
    params = dict(chunk.named_parameters())
    head_dim = head_dim_of(cfg)
    for name, tagged, src in _targets(chunk, cfg):
        _, size, group = _tp_of(tagged)
        kind = tagged.removeprefix("e")
        p = _grad_of(params[name]) if grads else _weight_of(chunk, name, params[name])
        if kind == "rep":
            yield src, p.clone()
        elif kind in ("row", "qkv_w", "qkv_b"):
            full = _gather_tp(p, 0, group, size)
            if kind == "row":
                if name == "output_layer.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the lm head
                yield src, full
            else:
                for s, t in zip(
                    src,
                    split_qkv(full, cfg.num_attention_heads, cfg.num_query_groups, head_dim),
                    strict=True,
                ):
                    yield s, t.clone()
        elif kind == "col":
            yield src, _gather_tp(p, 1, group, size)
        elif kind == "fc1":
            parts = [torch.empty_like(p) for _ in range(size)] if size > 1 else [p]
            if size > 1:
                dist.all_gather(parts, p.contiguous(), group=group)
            gates, ups = zip(*(q.chunk(2) for q in parts), strict=True)
            yield src[0], torch.cat(gates).clone()
            yield src[1], torch.cat(ups).clone()


def _full_tensors(chunk: Any, cfg: ModelConfig, grads: bool = False) -> dict[str, torch.Tensor]:
    """HF-named full tensors (or gradients) of one chunk (tp shards gathered; collective
    over tp)."""
    return dict(iter_full_tensors(chunk, cfg, grads))


def full_model_config(model: Any, model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` with the vocabulary size of the built model (megatron may pad it)."""
    chunks = _chunks(model)
    return replace(
        model_cfg, vocab_size=_model_cfg_of(chunks[0]).vocab_size or model_cfg.vocab_size
    )


def gather_full(model: Any, model_cfg: ModelConfig, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every HF-named full tensor (or its gradient: main_grad / grad) of the model on global
    rank 0 ({} elsewhere). Every rank calls (collectives over tp and the world)."""
    chunks = _chunks(model)
    cfg = full_model_config(chunks, model_cfg)
    mine: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        mine.update(_full_tensors(chunk, cfg, grads))
    return gather_to_root(mine)


def gather_to_root(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named tensors that every model-parallel rank holds for its own part of the model (full
    over tp: ``mine`` of a tp group's ranks are equal) merged on global rank 0 ({} elsewhere):
    the first tp / dp copy of each pipeline stage sends its share; a routed expert's tensors
    (held by one expert-parallel rank, on a data-parallel rank other than 0 too) come from the
    first expert-tp / expert-dp copy. Every rank calls."""
    from megatron.core import parallel_state as ps

    whole = not ps.model_parallel_is_initialized()
    first_copy = whole or (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )
    first_expert_copy = whole or (
        ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    )
    share = {
        k: v.cpu()
        for k, v in mine.items()
        if (first_expert_copy if is_expert_tensor(k) else first_copy)
    }
    shares: list[Any] = [share]
    if dist.is_initialized() and dist.get_world_size() > 1:  # to rank 0 only
        is_root = dist.get_rank() == 0
        shares = [None] * dist.get_world_size() if is_root else []
        dist.gather_object(share, shares if is_root else None, dst=0)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    tensors: dict[str, torch.Tensor] = {}
    for share in shares:
        for k, v in (share or {}).items():
            tensors.setdefault(k, v)
    return tensors


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
GENERATION_CONFIG = "generation_config.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
"""Largest safetensors shard of an export (one tensor larger than this gets its own file)."""


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names (sorted) grouped into consecutive shards of at most ``max_bytes`` each."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json (transformers' layout)."""
    from safetensors.torch import save_file

    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    shards = plan_shards(sizes, max_bytes)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in names})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_side_files(model_cfg: ModelConfig, out: Path) -> None:
    """Tokenizer files and generation_config.json copied from the source model
    (model.tokenizer_path, else model.hf_path); generation_config.json from the tokenizer's
    special tokens when the source has none; a run with the byte tokenizer writes
    rlbatch_tokenizer.json instead of tokenizer files, so the export loads with it again.
    The run's end ids (the tokenizer's ``eos_ids``, model.extra_eos_token_ids included) are the
    eos_token_id of generation_config.json and of config.json when it is there: a reader that
    falls back to the architecture's default (LlamaConfig: 2) would stop elsewhere. A source
    checkpoint without tokenizer files keeps its own generation_config.json as it is."""
    import shutil

    from rlbatch.engine.tokenizer import (
        BYTES_MARKER,
        TokenizerLoadError,
        build_tokenizer,
        tokenizer_source,
    )

    sources = [Path(p) for p in (model_cfg.tokenizer_path, model_cfg.hf_path) if p]
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
        found = next((src / name for src in sources if (src / name).is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    if tokenizer_source(model_cfg)[1] is None:  # the byte tokenizer: say so in the directory
        (out / BYTES_MARKER).write_text(json.dumps({"tokenizer": "bytes"}) + "\n")
    try:
        tok = build_tokenizer(model_cfg)
    except TokenizerLoadError:
        if (out / GENERATION_CONFIG).is_file():
            return  # a checkpoint without tokenizer files: its own generation_config's ids
        raise
    gen = {"bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id}
    if (out / GENERATION_CONFIG).is_file():
        gen = json.loads((out / GENERATION_CONFIG).read_text())
    ids = special_ids(tok.eos_ids, gen.get("bos_token_id", tok.bos_id))
    (out / GENERATION_CONFIG).write_text(json.dumps(gen | ids, indent=2) + "\n")
    if (out / HF_CONFIG).is_file():
        config = json.loads((out / HF_CONFIG).read_text())
        (out / HF_CONFIG).write_text(json.dumps(config | ids, indent=2) + "\n")


def export_hf(
    model: Any,
    model_cfg: ModelConfig,
    path: str | Path,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write a Hugging Face directory of the full model: sharded safetensors + index,
    config.json, generation_config.json and the source model's tokenizer files (every rank
    calls; global rank 0 writes). Tensors are gathered over tp (all_gather) and to rank 0
    (gather_object)."""
    tensors = gather_full(model, model_cfg)
    if not tensors:
        return
    cfg = replace(model_cfg, vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    out_dtype = dtype or next(iter(tensors.values())).dtype
    tensors = {k: v.to(out_dtype).contiguous() for k, v in sorted(tensors.items())}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out, max_shard_bytes)
    config = hf_config_dict(cfg, _DTYPE_NAMES.get(out_dtype, "float32"))
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    write_side_files(cfg, out)
