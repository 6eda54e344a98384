"""Chatterbox-Turbo's speech-token LM (upstream T3 with a GPT-2 medium backbone) on the paged decoder.

The prompt is input embeddings, not ids: the speaker projection (1 row), the voice's conditioning speech tokens
(speech_emb, up to COND_PROMPT_LEN rows), the text ids (text_emb) and the start-of-speech token (speech_emb).
Turbo has no extra position tables of its own (input_pos_emb None): GPT-2's wpe, indexed by the global position,
is the only position signal, and the decoder adds it. Generated tokens are fed back as speech_emb(token); the
logits are speech_head (with bias) over the 6563 speech ids. No perceiver, no emotion row, no CFG.
"""
from __future__ import annotations

import torch
from torch import nn

from voxbackend.models.decoder import Decoder, DecoderConfig, finish_meta_decoder

START_SPEECH = 6561
STOP_SPEECH = 6562
COND_PROMPT_LEN = 375  # the most conditioning speech tokens upstream's front end keeps (speech_cond_prompt_len)
SPEAKER_EMBED = 256  # voice-encoder embedding size
WEIGHTS_FILE = "t3_turbo_v1.safetensors"


class TurboLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, text_vocab: int, speech_vocab: int):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.backbone = Decoder(cfg, embed=False, head=False)  # T3 feeds GPT-2 embeddings; wte is unused
        self.spkr_enc = nn.Linear(SPEAKER_EMBED, hidden)
        self.text_emb = nn.Embedding(text_vocab, hidden)
        self.speech_emb = nn.Embedding(speech_vocab, hidden)
        self.speech_head = nn.Linear(hidden, speech_vocab, bias=True)

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], gpt2_config: dict, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> "TurboLM":
        """From a t3_turbo state dict (upstream T3's names: tfmr.*, cond_enc.spkr_enc.*, text_emb, speech_emb,
        speech_head) and its GPT-2 config dict; built on the meta device, then the tensors assigned."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"Chatterbox-Turbo checkpoint is missing weight {name!r}")
            return weights[name]

        cfg = DecoderConfig.from_hf({**gpt2_config, "model_type": "gpt2"})
        with torch.device("meta"):
            model = cls(cfg, take("text_emb.weight").shape[0], take("speech_emb.weight").shape[0])
        model.backbone.load_hf_weights(weights, prefix="tfmr.")
        own = {"spkr_enc.weight": "cond_enc.spkr_enc.weight", "spkr_enc.bias": "cond_enc.spkr_enc.bias",
               "text_emb.weight": "text_emb.weight", "speech_emb.weight": "speech_emb.weight",
               "speech_head.weight": "speech_head.weight", "speech_head.bias": "speech_head.bias"}
        model.load_state_dict({ours: take(theirs) for ours, theirs in own.items()}, strict=False, assign=True)
        model.backbone = finish_meta_decoder(model.backbone, device, dtype)
        return model.to(device=device, dtype=dtype).eval()

    def prompt_embeds(self, speaker_emb: torch.Tensor, cond_tokens: torch.Tensor,
                      text_ids: torch.Tensor) -> torch.Tensor:
        """speaker_emb [256], cond_tokens [N] (speech ids), text_ids [M] (GPT-2 tokenizer ids) ->
        [1 + N + M + 1, hidden], the last row the start-of-speech token's."""
        device = self.speech_emb.weight.device
        start = torch.tensor([START_SPEECH], device=device)
        speaker = self.spkr_enc(speaker_emb.reshape(1, SPEAKER_EMBED).to(device, self.spkr_enc.weight.dtype))
        return torch.cat([speaker, self.speech_emb(cond_tokens.to(device)), self.text_emb(text_ids.to(device)),
                          self.speech_emb(start)])

    def embed_speech(self, ids: torch.Tensor) -> torch.Tensor:
        """Generated speech ids [T] -> input rows [T, hidden]."""
        return self.speech_emb(ids)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Flattened batch of input rows [T, hidden] at global positions [T] -> final hidden states [T, hidden]."""
        return self.backbone.forward_embeds(x, positions, attention)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> float32 logits [B, speech vocab]."""
        return self.speech_head(hidden).float()
