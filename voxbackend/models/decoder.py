"""The decoder backbone of the Llama / Qwen2 / Qwen3 / GLM-4 family, and GPT-2, over the paged KV pool.

GQA, RMSNorm, SwiGLU and rotary positions (plain, linear or Llama-3 scaled), plus what tells the family apart:
q/k/v bias (Qwen2, GLM-4; any member with `attention_bias`), per-head q/k RMSNorm before RoPE (Qwen3), RoPE on
part of each head in interleaved pairs (GLM-4), a tied or untied head and head_dim from the config. GPT-2 is the
same layer with other parts, chosen by config flags: LayerNorm, a plain gelu(tanh) MLP, biases everywhere and
learned absolute positions instead of RoPE. Loads the weight names of Hugging Face `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `GlmForCausalLM`, `GPT2LMHeadModel` / `GPT2Model`, and of GLM-4's own
remote code (`model_type: chatglm`, GLM-4-Voice's checkpoint); q/k/v and gate/up are fused (GPT-2's Conv1D
transposed) at load time so one matmul serves each; attention goes through a pluggable backend
(voxbackend.attention).
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
    # attention_bias defaults to true; RoPE on partial_rotary_factor of each head (default 0.5), interleaved pairs
    "glm": dict(qkv_bias=None, o_bias=False, qk_norm=False, attention_bias=True, rotary=0.5, interleaved=True),
    "gpt2": dict(qkv_bias=True, o_bias=True, qk_norm=False),  # and more: see DecoderConfig.from_gpt2
    "chatglm": dict(qkv_bias=None, o_bias=False, qk_norm=False),  # GLM-4's remote code: see from_chatglm
}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "GlmForCausalLM": "glm", "ChatGLMModel": "chatglm", "ChatGLMForConditionalGeneration": "chatglm",
                 "GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2"}
# GPT-2's activation_function -> F.gelu's approximate argument ("gelu_new" is the tanh form)
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}

# The checkpoint layouts of the Llama layer: where the stack's tensors are under the prefix, and each fused matrix
# of ours -> the checkpoint's tensors, concatenated in this order. The layer norms have the same names in all.
LLAMA_LAYOUT = dict(layers="layers.", norm="norm.weight", embed="embed_tokens.weight",
                    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), o_proj=("self_attn.o_proj",),
                    gate_up=("mlp.gate_proj", "mlp.up_proj"), down=("mlp.down_proj",))
LAYOUTS = {
    "llama": LLAMA_LAYOUT,
    "glm": {**LLAMA_LAYOUT, "gate_up": ("mlp.gate_up_proj",)},  # GlmForCausalLM: gate and up already one matrix
    # GLM-4's remote code: q/k/v and gate/up already fused; its head is the stack's output_layer
    "chatglm": dict(layers="encoder.layers.", norm="encoder.final_layernorm.weight",
                    embed="embedding.word_embeddings.weight", qkv=("self_attention.query_key_value",),
                    o_proj=("self_attention.dense",), gate_up=("mlp.dense_h_to_4h",), down=("mlp.dense_4h_to_h",)),
}


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the eps of every norm, RMSNorm or LayerNorm
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm with bias: GPT-2)
    mlp: str = "swiglu"  # "swiglu" (gate/up, silu) or "gelu" (one up projection: GPT-2)
    gelu_approximate: str = "tanh"  # F.gelu's approximate for mlp "gelu"
    positions: str = "rope"  # "rope" or "learned" (an absolute position table added to the input: GPT-2)
    partial_rotary_factor: float = 1.0  # the share of head_dim RoPE rotates, from the first dim (GLM-4: 0.5)
    rope_interleaved: bool = False  # RoPE pairs dims (2i, 2i+1) (GLM-4), not (i, i + rotary_dim/2) (Llama)

    @classmethod
    def from_hf(cls, cfg: dict, family: str | None = None) -> "DecoderConfig":
        """A config.json dict; `family` (llama, qwen2, qwen3, glm) defaults to the one its model_type names."""
        family = family or cfg.get("model_type")
        if family == "gpt2":
            return cls.from_gpt2(cfg)
        if family == "chatglm":
            return cls.from_chatglm(cfg)
        rules = FAMILIES.get(family, FAMILIES["llama"])
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
            raise ValueError("sliding-window attention layers are not supported (use_sliding_window / layer_types)")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        # GLM's partial rotary, inside rope_parameters (transformers >= 5) or beside it; the others rotate all dims
        partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor")
        attention_bias = bool(cfg.get("attention_bias", rules.get("attention_bias", False)))
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
            partial_rotary_factor=(partial or rules["rotary"]) if "rotary" in rules else 1.0,
            rope_interleaved=rules.get("interleaved", False),
        )

    @classmethod
    def from_chatglm(cls, cfg: dict) -> "DecoderConfig":
        """The config of GLM-4's own remote code (ChatGLMConfig; ChatGLM2/3 share it): the GLM layer under other
        names. RoPE covers the first half of each head (kv_channels // 2 dims, interleaved pairs; `original_rope`
        names no other layout there), base 10000 * rope_ratio."""
        if "padded_vocab_size" not in cfg:
            raise ValueError("a chatglm config without padded_vocab_size (the first ChatGLM-6B) is not supported")
        # the variants whose layer is not GLM-4's: LayerNorm, no final norm, the residual taken after the norm
        unsupported = {"rmsnorm": False, "post_layer_norm": False, "apply_residual_connection_post_layernorm": True}
        for key, value in unsupported.items():
            if cfg.get(key, not value) == value:
                raise ValueError(f"chatglm config with {key}={value} is not supported")
        heads = cfg["num_attention_heads"]
        linear_bias = bool(cfg.get("add_bias_linear", False))
        return cls(
            vocab_size=cfg["padded_vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["ffn_hidden_size"],
            num_layers=cfg["num_layers"],
            num_heads=heads,
            num_kv_heads=cfg["multi_query_group_num"] if cfg.get("multi_query_attention", True) else heads,
            head_dim=cfg.get("kv_channels") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("layernorm_epsilon", 1e-5),
            rope_theta=10000.0 * cfg.get("rope_ratio", 1),
            rope_scaling=None,
            max_position_embeddings=cfg.get("seq_length", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=bool(cfg.get("add_qkv_bias", False)),
            o_bias=linear_bias,
            mlp_bias=linear_bias,
            partial_rotary_factor=0.5,
            rope_interleaved=True,
        )

    @classmethod
    def from_gpt2(cls, cfg: dict) -> "DecoderConfig":
        """A GPT2Config dict: its own names (n_embd, n_head, ...) or the generic ones its attribute_map allows."""
        def get(name: str, alias: str, default=None):
            value = cfg.get(name, cfg.get(alias, default))
            if value is None:
                raise KeyError(f"GPT-2 config has neither {name!r} nor {alias!r}")
            return value

        if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False):
            raise ValueError("GPT-2 attention scaled other than by head_dim**-0.5 is not supported")
        if cfg.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention is not supported")
        act = cfg.get("activation_function", "gelu_new")
        if act not in GPT2_GELU:
            raise ValueError(f"unsupported GPT-2 activation_function {act!r} (supported: {', '.join(GPT2_GELU)})")
        hidden, heads = get("n_embd", "hidden_size"), get("n_head", "num_attention_heads")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            num_layers=get("n_layer", "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            rope_theta=10000.0,  # unused: no RoPE
            rope_scaling=None,
            max_position_embeddings=get("n_positions", "max_position_embeddings", 1024),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            qkv_bias=True, o_bias=True, mlp_bias=True,
            norm="layer", mlp="gelu", gelu_approximate=GPT2_GELU[act], positions="learned",
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
    """llama, qwen2, qwen3, glm, chatglm or gpt2 for a plain causal-LM checkpoint of the family, else None.
    `architectures` may be null (a config written from a `to_dict()`): model_type decides then."""
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
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def make_norm(cfg: DecoderConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=cfg.rms_norm_eps) if cfg.norm == "layer" else RMSNorm(dim, cfg.rms_norm_eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head (partial rotary: the rest pass through), pairing dim i
    with i + half (Llama) or, interleaved, 2i with 2i+1 (GLM-4)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    if interleaved:
        rotated = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-rot[..., dim // 2:], rot[..., :dim // 2]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        self.index = index
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.gated = cfg.mlp == "swiglu"
        # gate and up fused; a plain (GPT-2) MLP has the up projection alone under the same name
        self.gate_up = nn.Linear(cfg.hidden_size, (2 if self.gated else 1) * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.input_norm = make_norm(cfg, cfg.hidden_size)
        self.post_norm = make_norm(cfg, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, attention) -> torch.Tensor:
        """cos/sin None: no RoPE (learned positions were added to the input)."""
        cfg = self.cfg
        t = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(t, cfg.num_heads, cfg.head_dim), k.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rope(q, cos, sin, cfg.rope_interleaved), apply_rope(k, cos, sin, cfg.rope_interleaved)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = attention.attend(self.index, q, k, v).reshape(t, q_size)
        x = x + self.o_proj(attn)
        h = self.gate_up(self.post_norm(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)
        return x + self.down(F.gelu(h, approximate=cfg.gelu_approximate))


class Decoder(nn.Module):
    """embed/head False: a model that builds its own input embeddings or heads (CSM's backbone and depth decoder)."""

    def __init__(self, cfg: DecoderConfig, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        learned = cfg.positions == "learned"
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None
        if not learned:
            self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Flattened batch: input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        return self.forward_embeds(self.embed(input_ids), positions, attention)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Input embeddings [T, hidden] -> final-normed hidden states [T, hidden]. Learned positions (GPT-2) are
        added here, indexed by the global position, so `x` holds the token embeddings alone."""
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
            cos = sin = None
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]
            # laid out as apply_rope pairs the dims: each angle twice in a row, or the halves repeated
            emb = freqs.repeat_interleave(2, dim=-1) if self.cfg.rope_interleaved else torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor], prefix: str | None = None) -> None:
        """Copy HF *ForCausalLM tensors in, fusing q/k/v and gate/up. `prefix` names the decoder stack
        ("backbone_model." and "depth_decoder.model." in a CSM checkpoint, "tfmr." in Chatterbox's T3); None: the
        layout's own ("model.", GPT-2's "transformer." or "" for a bare GPT2Model, ChatGLM's "transformer."). The
        head is "lm_head.weight" (ChatGLM's: the stack's "output_layer.weight")."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return weights[name]

        cfg = self.cfg
        layout, prefix = self._layout(weights, prefix)
        if layout == "gpt2":
            sd, embed = self._gpt2_layers(take, prefix), "wte.weight"
        else:
            sd, embed = self._llama_layers(take, prefix, LAYOUTS[layout]), LAYOUTS[layout]["embed"]
        if self.embed is not None:
            sd["embed.weight"] = take(prefix + embed)
        if self.lm_head is not None:
            head_name = prefix + "output_layer.weight" if layout == "chatglm" else "lm_head.weight"
            head = weights.get(head_name)
            if head is None:
                if not cfg.tie_word_embeddings or self.embed is None:
                    raise KeyError(f"checkpoint has no {head_name} and tie_word_embeddings is false")
                head = sd["embed.weight"]
            sd["lm_head.weight"] = head
        tied = self.lm_head is not None and self.embed is not None and sd["lm_head.weight"] is sd["embed.weight"]
        if tied:
            del sd["lm_head.weight"]
        self.load_state_dict(sd, strict=False, assign=True)
        if tied:
            self.lm_head.weight = self.embed.weight  # tied: one tensor, not two copies
        missing = {n for n, _ in self.named_parameters()} - set(sd) - {"lm_head.weight"}
        if missing:
            raise KeyError(f"weights not loaded: {sorted(missing)}")

    def _layout(self, weights: dict[str, torch.Tensor], prefix: str | None) -> tuple[str, str]:
        """(layout, prefix) of a checkpoint: GPT-2's by the config, a LAYOUTS entry by the tensors' names."""
        if self.cfg.positions == "learned":
            return "gpt2", ("transformer." if "transformer.wpe.weight" in weights else "") if prefix is None else prefix
        chatglm = "transformer." if prefix is None else prefix
        if chatglm + LAYOUTS["chatglm"]["norm"] in weights:
            return "chatglm", chatglm
        prefix = "model." if prefix is None else prefix
        return ("glm" if f"{prefix}layers.0.mlp.gate_up_proj.weight" in weights else "llama"), prefix

    def _llama_layers(self, take, prefix: str, layout: dict) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        sd = {"norm.weight": take(prefix + layout["norm"])}
        biases = {"qkv": cfg.qkv_bias, "o_proj": cfg.o_bias, "gate_up": cfg.mlp_bias, "down": cfg.mlp_bias}
        for i in range(cfg.num_layers):
            p, ours = f"{prefix}{layout['layers']}{i}.", f"layers.{i}."
            for name, bias in biases.items():
                for param in ("weight", "bias") if bias else ("weight",):
                    tensors = [take(f"{p}{part}.{param}") for part in layout[name]]
                    sd[f"{ours}{name}.{param}"] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            sd[ours + "input_norm.weight"] = take(p + "input_layernorm.weight")
            sd[ours + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
            if cfg.qk_norm:
                sd[ours + "q_norm.weight"] = take(p + "self_attn.q_norm.weight")
                sd[ours + "k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        return sd

    def _gpt2_layers(self, take, prefix: str) -> dict[str, torch.Tensor]:
        # GPT-2's Conv1D keeps its weight [in, out]: transposed once here into nn.Linear's [out, in]
        sd = {"pos_embed.weight": take(prefix + "wpe.weight")}
        names = {"qkv": "attn.c_attn", "o_proj": "attn.c_proj", "gate_up": "mlp.c_fc", "down": "mlp.c_proj",
                 "input_norm": "ln_1", "post_norm": "ln_2"}
        for i in range(self.cfg.num_layers):
            p, ours = f"{prefix}h.{i}.", f"layers.{i}."
            for name, theirs in names.items():
                weight = take(f"{p}{theirs}.weight")
                sd[f"{ours}{name}.weight"] = weight if name.endswith("norm") else weight.t().contiguous()
                sd[f"{ours}{name}.bias"] = take(f"{p}{theirs}.bias")
        sd["norm.weight"], sd["norm.bias"] = take(prefix + "ln_f.weight"), take(prefix + "ln_f.bias")
        return sd


def build_decoder(cfg: DecoderConfig, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype,
                  prefix: str | None = None, embed: bool = True, head: bool = True) -> Decoder:
    """Build on the meta device (no random init), then take the checkpoint's tensors. `prefix` None: the family's
    own (see Decoder.load_hf_weights)."""
    with torch.device("meta"):
        model = Decoder(cfg, embed, head)
    model.load_hf_weights(weights, prefix)
    return finish_meta_decoder(model, device, dtype)


def finish_meta_decoder(model: Decoder, device: str, dtype: torch.dtype) -> Decoder:
    """A decoder built on the meta device whose weights are loaded: to the device, RoPE frequencies recomputed
    (the meta-device buffer has no data) and kept float32 whatever the weights' dtype."""
    rope = model.pos_embed is None
    if rope:
        model.inv_freq = rope_inv_freq(model.cfg)
    model = model.to(device=device, dtype=dtype).eval()
    if rope:
        model.inv_freq = model.inv_freq.float()
    return model
