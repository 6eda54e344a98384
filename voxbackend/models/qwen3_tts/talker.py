"""Qwen3-TTS-12Hz: the talker, a Qwen3 decoder over rows of 16 codec codebooks plus a text column.

Checkpoint layout of the official Hugging Face release (`Qwen3TTSForConditionalGeneration`, config.json with a
`talker_config`): the decoder stack is `talker.model.*`, its output head `talker.codec_head` (codec vocabulary:
codes 0-2047 of codebook 0 and the specials above them). One talker input position is the sum of
  * codebook 0's id through `talker.model.codec_embedding` (which also embeds the specials: pad, bos, speaker
    and language ids of the prompt),
  * codebooks 1-15 through the code predictor's tables `talker.code_predictor.model.codec_embedding.{0..14}`,
  * the text id through `talker.model.text_embedding` and the `talker.text_projection` MLP (the dual track: the
    next text token rides along with the codes of the previous frame),
each where the row has one (-1 marks an absent entry). The talker's 3-axis multimodal RoPE gets three equal
position ids for speech, so every frequency rotates by the same position: it is plain 1-D RoPE, which the
generic decoder provides.

The code predictor (`talker.code_predictor.*`, a small Qwen3 decoder) makes codebooks 1-15 of each frame: its
position 0 is the talker's hidden state, position 1 codebook 0's embedding, position k + 1 codebook k's embedding
(the same tables as the talker input), all through `small_to_mtp_projection` to its width; head k - 1 at position k
gives codebook k. It runs for the whole batch at once on a dense cache, with no host round trip per codebook.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.depth_columns import DepthColumns

TEXT_COLUMN = -1  # the last column of a row holds the text id


def talker_decoder_config(talker: dict) -> DecoderConfig:
    """The talker's config.json section as a Qwen3 decoder config, its multimodal RoPE reduced to 1-D."""
    rope = dict(talker.get("rope_parameters") or talker.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    rope.pop("interleaved", None)
    rope.pop("mrope_interleaved", None)
    heads = talker["num_attention_heads"]
    head_dim = talker.get("head_dim") or talker["hidden_size"] // heads
    if section is not None and 2 * sum(section) != head_dim:
        raise ValueError(f"talker mrope_section {section} does not cover head_dim {head_dim}")
    return DecoderConfig.from_hf({**talker, "rope_parameters": rope or None, "rope_scaling": None}, family="qwen3")


class Qwen3TTSTalker:
    """Rows [T, num_code_groups + 1] (codebook ids, then the text id; -1 = none) -> hidden states -> codec logits,
    through the paged KV pool like every backbone."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
        hf = read_config(model_dir)
        talker = hf["talker_config"]
        predictor = talker["code_predictor_config"]
        if talker.get("hidden_act", "silu") != "silu" or predictor.get("hidden_act", "silu") != "silu":
            raise ValueError("unsupported hidden_act in talker_config or code_predictor_config (expected silu)")
        self.cfg = talker_decoder_config(talker)
        self.num_code_groups: int = talker["num_code_groups"]
        w = load_safetensors(model_dir)

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return w[name].to(device=device, dtype=dtype)

        self.backbone = build_decoder(self.cfg, w, device, dtype, prefix="talker.model.", embed=False, head=False)
        self.codec_head = take("talker.codec_head.weight")  # [codec vocab, hidden]
        self.codec_embedding = take("talker.model.codec_embedding.weight")  # codebook 0 and the specials
        # codebooks 1.. in one table: codebook j's id c sits at row (j - 1) * size + c
        tables = [take(f"talker.code_predictor.model.codec_embedding.{j}.weight")
                  for j in range(self.num_code_groups - 1)]
        self.code_size = tables[0].shape[0]
        self.code_embedding = torch.cat(tables)
        self.code_offsets = torch.arange(self.num_code_groups - 1, device=device) * self.code_size
        self.text_embedding = take("talker.model.text_embedding.weight")
        self.text_fc1 = (take("talker.text_projection.linear_fc1.weight"),
                         take("talker.text_projection.linear_fc1.bias"))
        self.text_fc2 = (take("talker.text_projection.linear_fc2.weight"),
                         take("talker.text_projection.linear_fc2.bias"))
        self.predictor = build_decoder(DecoderConfig.from_hf(predictor, family="qwen3"), w, device, dtype,
                                       prefix="talker.code_predictor.model.", embed=False, head=False)
        self.predictor_heads = torch.stack([take(f"talker.code_predictor.lm_head.{j}.weight")
                                            for j in range(self.num_code_groups - 1)])  # [groups - 1, codes, width]
        projection = "talker.code_predictor.small_to_mtp_projection."
        self.predictor_projection = (
            (take(projection + "weight"), take(projection + "bias")) if projection + "weight" in w else None
        )  # absent when the predictor is as wide as the talker (an identity)
        proj, size = self.predictor_projection, self.code_size
        self.depth_columns = DepthColumns(  # codebook k enters at position k + 1 through its own table
            self.predictor, self.num_code_groups, project=(lambda x: F.linear(x, *proj)) if proj else (lambda x: x),
            head=lambda h, k: (h @ self.predictor_heads[k - 1].T).float(),
            embed_first=lambda ids: F.embedding(ids, self.codec_embedding),
            embed_next=lambda ids, k: F.embedding(ids + (k - 1) * size, self.code_embedding))

    def project_text(self, text_ids: torch.Tensor) -> torch.Tensor:
        """Text ids [N] -> talker-width embeddings [N, hidden] (text_embedding, then the projection MLP)."""
        x = F.embedding(text_ids, self.text_embedding)
        return F.linear(F.silu(F.linear(x, *self.text_fc1)), *self.text_fc2)

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [T, num_code_groups + 1] -> talker input embeddings [T, hidden]: the sum of what each row holds."""
        first, rest, text = rows[:, 0], rows[:, 1 : self.num_code_groups], rows[:, TEXT_COLUMN]
        # every row takes every part, masked where it holds none: no data-dependent shapes, so no wait for the
        # device (a decode row holds codes and, until the text runs out, a text token anyway)
        x = F.embedding(first.clamp(min=0), self.codec_embedding) * (first >= 0)[:, None]
        has_code = rest >= 0
        codes = F.embedding(rest.clamp(min=0) + self.code_offsets, self.code_embedding)
        x = x + (codes * has_code[..., None]).sum(1)
        return x + self.project_text(text.clamp(min=0)) * (text >= 0)[:, None]

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, attention, features=None) -> torch.Tensor:
        """Flattened batch: rows [T, num_code_groups + 1], positions [T] -> final-normed hidden states [T, hidden].
        `features` (PromptFeatures): vectors added at FEATURE rows (Base: the x-vector, where CustomVoice embeds
        the speaker id; their column 0 embeds nothing)."""
        x = self.embed(rows)
        if features is not None:
            x = x.index_add(0, features.rows, features.vectors.to(x.dtype))
        return self.backbone.forward_embeds(x, positions, attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.codec_head.T).float()

    def predict_codes(
        self, hidden: torch.Tensor, first: torch.Tensor, sample_column: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """Talker hidden states [B, hidden] and their sampled codebook-0 ids [B] -> the frame's codes [B, groups].

        `sample_column(logits [B, codes], k) -> ids [B]` samples codebook k with each row's own parameters."""
        return self.depth_columns.run(hidden, first, sample_column)
