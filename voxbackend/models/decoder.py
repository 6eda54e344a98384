"""The decoder backbone of the Llama / Qwen2 / Qwen3 family over the paged KV pool.

GQA, RMSNorm, SwiGLU and rotary positions (plain, linear or Llama-3 scaled), plus what tells the family apart:
q/k/v bias (Qwen2; any member with `attention_bias`), per-head q/k RMSNorm before RoPE (Qwen3), a tied or
untied head and head_dim from the config. Loads the weight names of Hugging Face `LlamaForCausalLM`,
`Qwen2ForCausalLM` and `Qwen3ForCausalLM`; q/k/v and gate/up are fused at load time so one matmul serves each;
attention goes through a pluggable backend (voxbackend.attention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.models.base import LMGeometry

# What each member of the family adds to the Llama layer, by config.json model_type (Llama's rules otherwise).
FAMILIES = {
    "llama": dict(qkv_bias=None, o_bias=None, qk_norm=False),  # None: config.json's attention_bias
    "qwen2": dict(qkv_bias=True, o_bias=False, qk_norm=False),
    "qwen3": dict(qkv_bias=None, o_bias=None, qk_norm=True),
}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass
class DecoderConfig:
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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE

    @classmethod
    def from_hf(cls, cfg: dict, family: str | None = None) -> "DecoderConfig":
        """A config.json dict; `family` (llama, qwen2, qwen3) defaults to the one its model_type names."""
        family = family or cfg.get("model_type")
        rules = FAMILIES.get(family, FAMILIES["llama"])
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
            raise ValueError("sliding-window attention layers are not supported (use_sliding_window / layer_types)")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        attention_bias = bool(cfg.get("attention_bias", False))
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
            qkv_bias=attention_bias if rules["qkv_bias"] is None else rules["qkv_bias"],
            o_bias=attention_bias if rules["o_bias"] is None else rules["o_bias"],
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=rules["qk_norm"],
        )

    def geometry(self) -> LMGeometry:
        return LMGeometry(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_context=self.max_position_embeddings,
        )


def decoder_family(hf_config: dict) -> str | None:
    """llama, qwen2 or qwen3 for a plain causal-LM checkpoint of the family, else None. `architectures` may be
    null (a config written from a `to_dict()`): model_type decides then."""
    for arch in hf_config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not hf_config.get("architectures"):
        family = hf_config.get("model_type") or "llama"
        return family if family in FAMILIES else None
    return None


def eos_ids(hf_config: dict) -> tuple[int, ...]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        self.index = index
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(t, cfg.num_heads, cfg.head_dim), k.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = attention.attend(self.index, q, k, v).reshape(t, q_size)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    """embed/head False: a model that builds its own input embeddings or heads (CSM's backbone and depth decoder)."""

    def __init__(self, cfg: DecoderConfig, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
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
        """Copy HF *ForCausalLM tensors in, fusing q/k/v and gate/up. `prefix` names the decoder stack
        ("backbone_model." and "depth_decoder.model." in a CSM checkpoint); the head is always "lm_head.weight"."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return weights[name]

        cfg = self.cfg
        sd = {"norm.weight": take(prefix + "norm.weight")}
        if self.embed is not None:
            sd["embed.weight"] = take(prefix + "embed_tokens.weight")
        if self.lm_head is not None:
            head = weights.get("lm_head.weight")
            if head is None:
                if not cfg.tie_word_embeddings or self.embed is None:
                    raise KeyError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
                head = sd["embed.weight"]
            sd["lm_head.weight"] = head
        projections = {  # ours -> the checkpoint's, concatenated in this order; whether it has a bias
            "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), cfg.qkv_bias),
            "o_proj": (("self_attn.o_proj",), cfg.o_bias),
            "gate_up": (("mlp.gate_proj", "mlp.up_proj"), cfg.mlp_bias),
            "down": (("mlp.down_proj",), cfg.mlp_bias),
        }
        for i in range(cfg.num_layers):
            p, ours = f"{prefix}layers.{i}.", f"layers.{i}."
            for name, (parts, bias) in projections.items():
                for param in ("weight", "bias") if bias else ("weight",):
                    tensors = [take(f"{p}{part}.{param}") for part in parts]
                    sd[f"{ours}{name}.{param}"] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            sd[ours + "input_norm.weight"] = take(p + "input_layernorm.weight")
            sd[ours + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
            if cfg.qk_norm:
                sd[ours + "q_norm.weight"] = take(p + "self_attn.q_norm.weight")
                sd[ours + "k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        tied = self.lm_head is not None and self.embed is not None and sd["lm_head.weight"] is sd["embed.weight"]
        if tied:
            del sd["lm_head.weight"]
        self.load_state_dict(sd, strict=False, assign=True)
        if tied:
            self.lm_head.weight = self.embed.weight  # tied: one tensor, not two copies
        missing = {n for n, _ in self.named_parameters()} - set(sd) - {"lm_head.weight"}
        if missing:
            raise KeyError(f"weights not loaded: {sorted(missing)}")


def build_decoder(cfg: DecoderConfig, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype,
                  prefix: str = "model.", embed: bool = True, head: bool = True) -> Decoder:
    """Build on the meta device (no random init), then take the checkpoint's tensors."""
    with torch.device("meta"):
        model = Decoder(cfg, embed, head)
    model.load_hf_weights(weights, prefix)
    model.inv_freq = rope_inv_freq(cfg)  # the meta-device buffer has no data
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = model.inv_freq.float()  # RoPE frequencies stay float32 whatever the weights' dtype
    return model
