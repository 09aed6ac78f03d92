"""The decode runner's view of a model's weights (`decoder/runner.py`): a loaded HF model
(`lm.model`, LlamaForCausalLM-like: Llama 2/3.x, SmolLM2, Qwen2 with q/k/v biases), used in place.

q/k/v and gate/up are concatenated once into fused matrices and, on a GPU, the model's own
parameters are re-pointed to views of them (`fuse_weights`; on the CPU a fused copy is kept
instead, so the reference path's numerics never change): the model keeps working, and on a GPU no
memory is doubled. RMSNorm eps, the rotary module's `inv_freq` and `attention_scaling` (default,
linear, llama3 and yarn rope) and the attention scale come from the model; `unsupported(model)`
says what the runner cannot run (dynamic/longrope rope, q/k norms, sliding-window layers,
activations other than SiLU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [C]
    wqkv: torch.Tensor  # [(H + 2 KVH) D, C] fused q/k/v (the model's q/k/v_proj are views of it)
    bqkv: torch.Tensor | None  # [(H + 2 KVH) D] (Qwen2) or None
    wo: torch.Tensor  # [C, H D]
    bo: torch.Tensor | None
    ln2: torch.Tensor  # [C]
    wgu: torch.Tensor  # [2 I, C] fused gate/up
    bgu: torch.Tensor | None
    wdown: torch.Tensor  # [C, I]
    bdown: torch.Tensor | None
    scale: float  # attention scale (the model's `self_attn.scaling`)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, C]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [C]
    lm_head: torch.Tensor  # [V, C] (tied: the embedding)
    eps: float
    inv_freq: torch.Tensor  # [D / 2] fp32, the rotary module's (rope scaling applied)
    rope_scaling: float  # the rotary module's attention_scaling (1.0 but for yarn & co)
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def read_bytes(self) -> int:
        """Bytes one step reads of the weights: every matrix and norm, the lm_head, not the
        embedding table (a step reads B rows of it) unless it is the tied lm_head."""
        seen, total = set(), 0
        mats = [self.norm, self.lm_head]
        for lw in self.layers:
            mats += [t for t in (lw.ln1, lw.wqkv, lw.bqkv, lw.wo, lw.bo, lw.ln2, lw.wgu, lw.bgu, lw.wdown, lw.bdown)
                     if t is not None]
        for t in mats:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


_FUSED_ATTR = "_ctxcache_runner_weights"


def unsupported(model) -> list[str]:
    """Reasons the runner cannot run this model (empty = fine)."""
    cfg = model.config
    reasons = []
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if rot is None or layers is None or not hasattr(model, "lm_head"):
        return [f"{type(model).__name__} is not a Llama-like causal LM (model.layers, rotary_emb, lm_head)"]
    if getattr(rot, "rope_type", "default") in ("dynamic", "longrope"):
        reasons.append(f"rope type {rot.rope_type!r} changes its frequencies with the sequence length")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        reasons.append(f"activation {cfg.hidden_act!r} (the runner's MLP is SiLU-gated)")
    attn = layers[0].self_attn
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        reasons.append("per-head q/k norms (Qwen3-style) are not implemented")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        reasons.append(f"layer types {sorted(kinds)} (only full attention)")
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        reasons.append("logit soft-capping is not implemented")
    if not hasattr(layers[0].mlp, "gate_proj"):
        reasons.append("the MLP has no gate_proj/up_proj/down_proj")
    return reasons


def _fuse(mods: list[torch.nn.Linear], repoint: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate Linear weights (and biases) along the output dim once. `repoint`: also re-point
    the modules' parameters to views of the result, so nothing is stored twice (GPU, where memory is
    what limits a batch). The model then computes the same function, but not always the same bits:
    a one-token (GEMV) matmul over a view can round differently (measured on the CPU: 6e-5 on the
    default model's logits). So on the CPU, where `decoder.generate` is the reference path and
    memory is not the limit, the runner keeps a fused copy and leaves the model untouched."""
    w = torch.cat([m.weight.data for m in mods], dim=0)
    b = None
    if any(m.bias is not None for m in mods):
        b = torch.cat([m.bias.data if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=w.dtype, device=w.device)
                       for m in mods])
    if repoint:
        o = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[o:o + n]
            if m.bias is not None:
                m.bias.data = b[o:o + n]
            o += n
    return w, b


@torch.no_grad()
def fuse_weights(model) -> ModelWeights:
    """The runner's view of a Llama-like model's weights (made once per model object, cached on it)."""
    got = getattr(model, _FUSED_ATTR, None)
    if got is not None:
        return got
    reasons = unsupported(model)
    if reasons:
        raise ValueError("the decode runner cannot run this model: " + "; ".join(reasons))
    cfg, inner = model.config, model.model
    layers = []
    for layer in inner.layers:
        a, mlp = layer.self_attn, layer.mlp
        repoint = a.q_proj.weight.device.type == "cuda"
        wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj], repoint)
        wgu, bgu = _fuse([mlp.gate_proj, mlp.up_proj], repoint)
        layers.append(LayerWeights(
            layer.input_layernorm.weight, wqkv, bqkv, a.o_proj.weight, a.o_proj.bias,
            layer.post_attention_layernorm.weight, wgu, bgu, mlp.down_proj.weight, mlp.down_proj.bias,
            float(a.scaling)))
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rot = inner.rotary_emb
    w = ModelWeights(
        embed=inner.embed_tokens.weight, layers=layers, norm=inner.norm.weight, lm_head=model.lm_head.weight,
        eps=float(inner.norm.variance_epsilon), inv_freq=rot.inv_freq.float(),
        rope_scaling=float(rot.attention_scaling), n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads, head_dim=head_dim)
    setattr(model, _FUSED_ATTR, w)
    return w
