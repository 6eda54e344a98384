"""Chatterbox's original speech-token LM (upstream T3 with a Llama-520M backbone) on the paged decoder.

Input rows, not ids. The conditioning prefix is COND_ROWS = 34 rows: the speaker projection (1), the Perceiver
over the voice's conditioning speech tokens (32: speech_emb + speech_pos_emb by index 0..N-1) and the
exaggeration projection (1). Text rows are text_emb(id) + text_pos_emb(index in the text); speech rows are
speech_emb(token) + speech_pos_emb(index in the speech). These learned tables are T3's own; the backbone adds
Llama-3 RoPE by the global position on top.

Upstream's prompt is cond + text + the start token TWICE, both at speech index 0 (prepare_input_embeds appends
the start token as the speech part, then inference appends it again as the bos row); the k-th generated token
(k = 1, 2, ...) is fed at speech index k. Classifier-free guidance runs two sequences per request: the
unconditioned one has blank text rows (position embedding only), everything else alike. The logits are
speech_head (no bias) over the 8194 speech ids.
"""
from __future__ import annotations

import torch
from torch import nn

from voxbackend.models.chatterbox.perceiver import QUERIES, Perceiver
from voxbackend.models.decoder import Decoder, DecoderConfig, finish_meta_decoder

START_SPEECH = 6561
STOP_SPEECH = 6562
SPEECH_VOCAB = 8194
TEXT_VOCAB = 704  # English-only checkpoint (the multilingual one has 2454)
COND_ROWS = 1 + QUERIES + 1  # speaker, perceiver, exaggeration
COND_PROMPT_LEN = 150  # the most conditioning speech tokens upstream's front end keeps (speech_cond_prompt_len)
SPEAKER_EMBED = 256  # voice-encoder embedding size
WEIGHTS_FILE = "t3_cfg.safetensors"

# upstream's Llama_520M backbone (tfmr.*); vocab_size is a placeholder: T3 feeds its own embeddings
LLAMA_520M: dict = {
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


class T3LM(nn.Module):
    def __init__(self, cfg: DecoderConfig, text_vocab: int, speech_vocab: int, text_positions: int,
                 speech_positions: int):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.backbone = Decoder(cfg, embed=False, head=False)  # tfmr.embed_tokens is unused
        self.spkr_enc = nn.Linear(SPEAKER_EMBED, hidden)
        self.perceiver = Perceiver(hidden)
        self.emotion_adv_fc = nn.Linear(1, hidden, bias=False)
        self.text_emb = nn.Embedding(text_vocab, hidden)
        self.speech_emb = nn.Embedding(speech_vocab, hidden)
        self.text_pos_emb = nn.Embedding(text_positions, hidden)
        self.speech_pos_emb = nn.Embedding(speech_positions, hidden)
        self.speech_head = nn.Linear(hidden, speech_vocab, bias=False)

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], llama_config: dict, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> "T3LM":
        """From a t3_cfg state dict (upstream T3's names) and its Llama config dict; built on the meta device,
        then the tensors assigned. text_head and tfmr.embed_tokens are not read."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"Chatterbox T3 checkpoint is missing weight {name!r}")
            return weights[name]

        cfg = DecoderConfig.from_hf(llama_config, "llama")
        with torch.device("meta"):
            model = cls(cfg, take("text_emb.weight").shape[0], take("speech_emb.weight").shape[0],
                        take("text_pos_emb.emb.weight").shape[0], take("speech_pos_emb.emb.weight").shape[0])
        model.backbone.load_hf_weights(weights, prefix="tfmr.")
        own = {"text_emb.weight": "text_emb.weight", "speech_emb.weight": "speech_emb.weight",
               "text_pos_emb.weight": "text_pos_emb.emb.weight", "speech_pos_emb.weight": "speech_pos_emb.emb.weight",
               "speech_head.weight": "speech_head.weight", "emotion_adv_fc.weight": "cond_enc.emotion_adv_fc.weight",
               "spkr_enc.weight": "cond_enc.spkr_enc.weight", "spkr_enc.bias": "cond_enc.spkr_enc.bias"}
        own.update({f"perceiver.{n}": f"cond_enc.perceiver.{n}" for n in model.perceiver.state_dict()})
        model.load_state_dict({ours: take(theirs) for ours, theirs in own.items()}, strict=False, assign=True)
        model.backbone = finish_meta_decoder(model.backbone, device, dtype)
        return model.to(device=device, dtype=dtype).eval()

    @property
    def device(self) -> torch.device:
        return self.speech_emb.weight.device

    @property
    def max_text_index(self) -> int:
        """The largest text index the position table holds (a longer text must be refused)."""
        return self.text_pos_emb.num_embeddings - 1

    @property
    def max_speech_index(self) -> int:
        """The largest speech index the position table holds: conditioning tokens and generated tokens alike."""
        return self.speech_pos_emb.num_embeddings - 1

    def cond_embeds(self, speaker_emb: torch.Tensor, cond_tokens: torch.Tensor, exaggeration: float) -> torch.Tensor:
        """speaker_emb [256], cond_tokens [N >= 1] speech ids, exaggeration -> the [34, hidden] prefix."""
        w = self.spkr_enc.weight
        speaker = self.spkr_enc(speaker_emb.reshape(1, SPEAKER_EMBED).to(w.device, w.dtype))
        cond_tokens = cond_tokens.to(w.device)
        prompt = self.embed_speech(cond_tokens, torch.arange(len(cond_tokens), device=w.device))
        emotion = self.emotion_adv_fc(torch.full((1, 1), float(exaggeration), device=w.device, dtype=w.dtype))
        return torch.cat([speaker, self.perceiver(prompt), emotion])

    def embed_text(self, ids: torch.Tensor, index: torch.Tensor, blank: torch.Tensor) -> torch.Tensor:
        """Text ids [T] at text indices [T] -> [T, hidden]; blank rows (the CFG unconditioned sequence) keep only
        the position embedding."""
        tokens = self.text_emb(ids)
        return torch.where(blank[:, None], torch.zeros_like(tokens), tokens) + self.text_pos_emb(index)

    def embed_speech(self, tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Speech ids [T] at speech indices [T] -> [T, hidden]."""
        return self.speech_emb(tokens) + self.speech_pos_emb(index)

    def prompt_embeds(self, cond: torch.Tensor, text_ids: torch.Tensor, blank: bool) -> torch.Tensor:
        """The cond_embeds rows [34, hidden] + text ids [M] (with upstream's start/stop text tokens already
        added) -> upstream's whole prompt [34 + M + 2, hidden]: the start token twice, both at speech index 0."""
        m = len(text_ids)
        text = self.embed_text(text_ids.to(self.device), torch.arange(m, device=self.device),
                               torch.full((m,), blank, device=self.device))
        start = self.embed_speech(torch.full((2,), START_SPEECH, device=self.device),
                                  torch.zeros(2, dtype=torch.long, device=self.device))
        return torch.cat([cond.to(text.dtype), text, start])

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Flattened batch of input rows [T, hidden] at global positions [T] -> final hidden states [T, hidden]."""
        return self.backbone.forward_embeds(x, positions, attention)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> float32 logits [B, 8194]."""
        return self.speech_head(hidden).float()
