"""Llama backbone (Llama 2/3/3.2: GQA, RMSNorm, SwiGLU, Llama-3 RoPE scaling) over the paged KV pool.

Loads the weight names of a Hugging Face `LlamaForCausalLM` checkpoint. q/k/v and gate/up are fused at load
time so one matmul serves each; attention goes through a pluggable backend (voxbackend.attention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int):
        super().__init__()
        self.index = index
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = attention.attend(self.index, q, k, v).reshape(t, q_size)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """embed/head False: a model that builds its own input embeddings or heads (CSM's backbone and depth decoder)."""

    def __init__(self, cfg: LlamaConfig, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleList(LlamaLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Flattened batch: input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        return self.forward_embeds(self.embed(input_ids), positions, attention)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Input embeddings [T, hidden] -> final-normed hidden states [T, hidden]."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor], prefix: str = "model.") -> None:
        """Copy HF LlamaForCausalLM tensors in, fusing q/k/v and gate/up. `prefix` names the decoder stack
        ("backbone_model." and "depth_decoder.model." in a CSM checkpoint); the head is always "lm_head.weight"."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return weights[name]

        sd = {"norm.weight": take(prefix + "norm.weight")}
        if self.embed is not None:
            sd["embed.weight"] = take(prefix + "embed_tokens.weight")
        if self.lm_head is not None:
            head = weights.get("lm_head.weight")
            if head is None:
                if not self.cfg.tie_word_embeddings or self.embed is None:
                    raise KeyError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
                head = sd["embed.weight"]
            sd["lm_head.weight"] = head
        for i in range(self.cfg.num_layers):
            p = f"{prefix}layers.{i}."
            sd[f"layers.{i}.qkv.weight"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], dim=0
            )
            sd[f"layers.{i}.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
            sd[f"layers.{i}.gate_up.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
            )
            sd[f"layers.{i}.down.weight"] = take(p + "mlp.down_proj.weight")
            sd[f"layers.{i}.input_norm.weight"] = take(p + "input_layernorm.weight")
            sd[f"layers.{i}.post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        tied = self.lm_head is not None and self.embed is not None and sd["lm_head.weight"] is sd["embed.weight"]
        if tied:
            del sd["lm_head.weight"]
        self.load_state_dict(sd, strict=False, assign=True)
        if tied:
            self.lm_head.weight = self.embed.weight  # tied: one tensor, not two copies
        missing = {n for n, _ in self.named_parameters()} - set(sd) - {"lm_head.weight"}
        if missing:
            raise KeyError(f"weights not loaded: {sorted(missing)}")


def build_llama(cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype,
                prefix: str = "model.", embed: bool = True, head: bool = True) -> LlamaModel:
    """Build on the meta device (no random init), then take the checkpoint's tensors."""
    with torch.device("meta"):
        model = LlamaModel(cfg, embed, head)
    model.load_hf_weights(weights, prefix)
    model.inv_freq = rope_inv_freq(cfg)  # the meta-device buffer has no data
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = model.inv_freq.float()  # RoPE frequencies stay float32 whatever the weights' dtype
    return model
