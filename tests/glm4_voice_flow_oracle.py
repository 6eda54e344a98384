"""GLM-4-Voice's speech decoder as a test oracle: upstream CosyVoice's modules (the `cosyvoice-minicpmo` oracle,
tests/cosyvoice_oracle.py) built as THUDM/GLM-4-Voice's glm-4-voice-decoder/config.yaml builds them, at tiny
sizes, and driven the way GLM-4-Voice drives them. GLM-4-Voice vendors an older CosyVoice; where the two differ,
the GLM side is reproduced here on the upstream modules:

- encoder: GLM's `BlockConformerEncoder` + `block_rel_selfattn` masks a token's attention to every earlier token
  and its own block (block_mask_util.create_grid_mask, fill_triangle=True): upstream's `ConformerEncoder` with
  static_chunk_size=block_size builds that mask. GLM's conformer layer norms have eps 1e-5 (upstream's 1e-12).
- `glm_flow_inference` is GLM's `MaskedDiffWithXvec.inference`: one nearest-neighbour interpolation of all tokens
  to int(N / 12.5 * 22050 / 256) frames (GLM's InterpolateRegulator.forward; upstream's `inference` interpolates
  prompt and tokens apart, linearly), the prompt mel as `cond`, the frames after it returned. GLM's CFM reseeds
  torch with 42 and draws z = randn_like(mu); its Euler solver is upstream's `solve_euler`.
- `GlmAudioDecoder` is flow_inference.py's AudioDecoder.token2wav (mel overlap fade, HiFT cache) for one request,
  `glm_serving_blocks` web_demo.py's cut of a reply's tokens into blocks, `glm_stream` the two together.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from cosyvoice_oracle import _on_path, load_cosyvoice

from voxbackend.components.flow_hift.hift import weight_norm_names
from voxbackend.models.glm4_voice.codec import CodecConfig

END = -1  # the reply's end token (web_demo: <|user|>)


def load_modules():
    cv = load_cosyvoice()
    with _on_path("scipy", "cosyvoice"):
        from cosyvoice.flow import length_regulator
        from cosyvoice.transformer import encoder
    cv.encoder_v1, cv.length_regulator = encoder, length_regulator
    return cv


def upstream_decoder(cfg: CodecConfig, flow_state: dict, hift_state: dict):
    """(flow, hift): upstream's MaskedDiffWithXvec and HiFTGenerator at cfg's sizes, the state dicts loaded
    strictly (so our names are upstream's), eval mode."""
    from omegaconf import DictConfig
    cv = load_modules()
    f, enc, dec, h = cfg.flow, cfg.flow.encoder, cfg.flow.decoder, cfg.hift
    with torch.random.fork_rng():
        encoder = cv.encoder_v1.ConformerEncoder(
            input_size=enc.size, output_size=enc.size, attention_heads=enc.heads, linear_units=enc.linear_units,
            num_blocks=enc.num_blocks, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn", use_cnn_module=False, macaron_style=False,
            static_chunk_size=enc.block_size)
        for layer in encoder.encoders:
            layer.norm_mha.eps = layer.norm_ff.eps = enc.norm_eps
        estimator = cv.decoder.ConditionalDecoder(
            in_channels=dec.in_channels, out_channels=dec.out_channels, channels=list(dec.channels), dropout=0.0,
            attention_head_dim=dec.attention_head_dim, n_blocks=dec.n_blocks, num_mid_blocks=dec.num_mid_blocks,
            num_heads=dec.num_heads, act_fn="gelu")
        cfm = cv.flow_matching.ConditionalCFM(
            in_channels=240, n_spks=1, spk_emb_dim=80, estimator=estimator,
            cfm_params=DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine",
                                   "training_cfg_rate": 0.2, "inference_cfg_rate": f.cfg_rate, "reg_loss_type": "l1"}))
        flow = cv.flow.MaskedDiffWithXvec(
            input_size=enc.size, output_size=f.mel_bins, spk_embed_dim=f.spk_embed_dim, output_type="mel",
            vocab_size=f.vocab_size, input_frame_rate=f.token_rate, only_mask_loss=True, encoder=encoder,
            length_regulator=cv.length_regulator.InterpolateRegulator(
                channels=f.mel_bins, sampling_ratios=[1] * f.regulator_stages),
            decoder=cfm)
        hift = cv.hift.HiFTGenerator(
            in_channels=h.mel_bins, base_channels=h.base_channels, nb_harmonics=h.nb_harmonics,
            sampling_rate=h.sampling_rate, nsf_alpha=h.nsf_alpha, nsf_sigma=h.nsf_sigma,
            nsf_voiced_threshold=h.nsf_voiced_threshold, upsample_rates=list(h.upsample_rates),
            upsample_kernel_sizes=list(h.upsample_kernel_sizes), istft_params={"n_fft": h.n_fft, "hop_len": h.hop_len},
            resblock_kernel_sizes=list(h.resblock_kernel_sizes),
            resblock_dilation_sizes=[list(d) for d in h.resblock_dilation_sizes],
            source_resblock_kernel_sizes=list(h.source_resblock_kernel_sizes),
            source_resblock_dilation_sizes=[list(d) for d in h.source_resblock_dilation_sizes],
            lrelu_slope=h.lrelu_slope, audio_limit=h.audio_limit,
            f0_predictor=cv.f0.ConvRNNF0Predictor(num_class=1, in_channels=h.mel_bins, cond_channels=h.f0_channels))
    flow.load_state_dict(flow_state, strict=True)
    hift.load_state_dict(hift_state, strict=True)
    return flow.eval(), hift.eval()


def weight_normed(state: dict, cfg) -> dict:
    """A plain HiFT state dict with its weight-normed convs as upstream stores them: (g, v) pairs, g jittered away
    from |v| so that folding g into v is tested."""
    generator = torch.Generator().manual_seed(0)
    normed, out = set(weight_norm_names(cfg)), {}
    for key, value in state.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and name in normed:
            g = value.flatten(1).norm(dim=1).view(-1, *[1] * (value.ndim - 1))
            g = g * (1.0 + 0.1 * torch.randn(g.shape, generator=generator))
            out[f"{name}.parametrizations.weight.original0"] = g
            out[f"{name}.parametrizations.weight.original1"] = value.clone()
        else:
            out[key] = value.clone()
    return out


@torch.inference_mode()
def glm_flow_inference(flow, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                       embedding: torch.Tensor, seed: int = 42) -> torch.Tensor:
    """GLM-4-Voice's MaskedDiffWithXvec.inference: token, prompt_token (1, N) int; prompt_feat (1, P, 80);
    embedding (1, 192). Reseeds torch's generator as GLM's ConditionalCFM.forward does. Returns (1, 80, frames)."""
    embedding = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
    token = torch.concat([prompt_token, token], dim=1)
    token_len = torch.tensor([token.shape[1]], dtype=torch.int32)
    h, _ = flow.encoder(flow.input_embedding(torch.clamp(token, min=0)), token_len)
    h = flow.encoder_proj(h)
    feat_len = (token_len / flow.input_frame_rate * 22050 / 256).int()
    h = F.interpolate(h.transpose(1, 2).contiguous(), size=int(feat_len.max()), mode="nearest")
    mu = flow.length_regulator.model(h)
    conds = torch.zeros(1, flow.output_size, int(feat_len.max()))
    conds[:, :, :prompt_feat.shape[1]] = prompt_feat.transpose(1, 2)
    torch.manual_seed(seed)
    z = torch.randn_like(mu)
    t_span = 1 - torch.cos(torch.linspace(0, 1, 11) * 0.5 * torch.pi)
    mask = torch.ones(1, 1, mu.shape[2])
    feat = flow.decoder.solve_euler(z, t_span=t_span, mu=mu, mask=mask, spks=embedding, cond=conds)
    return feat[:, :, prompt_feat.shape[1]:]


class GlmAudioDecoder:
    """flow_inference.py's AudioDecoder.token2wav for one request (upstream keys its caches by uuid)."""

    def __init__(self, flow, hift, cfg: CodecConfig):
        self.flow, self.hift = flow, hift
        self.mel_overlap_len = int(cfg.token_overlap / cfg.flow.token_rate * 22050 / 256)
        self.mel_window = np.hamming(2 * self.mel_overlap_len)
        self.mel_cache_len = cfg.mel_cache_frames
        self.source_cache_len = self.mel_cache_len * 256
        self.mel_overlap, self.hift_cache = None, None

    @torch.inference_mode()
    def token2wav(self, token, prompt_token, prompt_feat, embedding, finalize: bool):
        tts_mel = glm_flow_inference(self.flow, token, prompt_token, prompt_feat, embedding)
        if self.mel_overlap is not None:
            n = self.mel_overlap_len
            tts_mel[..., :n] = tts_mel[..., :n] * self.mel_window[:n] + self.mel_overlap[..., -n:] * self.mel_window[n:]
        if self.hift_cache is not None:
            tts_mel = torch.concat([self.hift_cache["mel"], tts_mel], dim=2)
            cache_source = self.hift_cache["source"]
        else:
            cache_source = torch.zeros(1, 1, 0)
        if not finalize:
            self.mel_overlap = tts_mel[:, :, -self.mel_overlap_len:]
            tts_mel = tts_mel[:, :, :-self.mel_overlap_len]
            tts_speech, tts_source = self.hift.inference(tts_mel, cache_source=cache_source)
            self.hift_cache = {"mel": tts_mel[:, :, -self.mel_cache_len:],
                               "source": tts_source[:, :, -self.source_cache_len:]}
            tts_speech = tts_speech[:, :-self.source_cache_len]
        else:
            tts_speech, _ = self.hift.inference(tts_mel, cache_source=cache_source)
            self.mel_overlap, self.hift_cache = None, None
        return tts_speech, tts_mel


def glm_serving_blocks(stream: list[int], block_sizes) -> list[tuple[list[int], bool]]:
    """web_demo.py's cut: stream is the LM's tokens (audio ids, END last); returns (block tokens, finalize)."""
    blocks, audio_tokens, index, finalize = [], [], 0, False
    for token_id in stream:
        if token_id == END:
            finalize = True
        if len(audio_tokens) >= block_sizes[index] or (finalize and audio_tokens):
            index = min(index + 1, len(block_sizes) - 1)
            blocks.append((audio_tokens, finalize))
            audio_tokens = []
        if not finalize:
            audio_tokens.append(token_id)
    return blocks


def glm_stream(flow, hift, cfg: CodecConfig, tokens: list[int]) -> list[torch.Tensor]:
    """A reply of `tokens` then the end token, decoded block by block as web_demo.py does; each block's speech."""
    decoder = GlmAudioDecoder(flow, hift, cfg)
    prompt_token, prompt_feat, mels, speeches = torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, 80), [], []
    embedding = torch.zeros(1, cfg.flow.spk_embed_dim)
    with torch.random.fork_rng():
        for block, finalize in glm_serving_blocks(tokens + [END], cfg.block_sizes):
            token = torch.tensor(block)[None]
            if mels:
                prompt_feat = torch.cat(mels, dim=-1).transpose(1, 2)
            speech, mel = decoder.token2wav(token, prompt_token, prompt_feat, embedding, finalize)
            speeches.append(speech[0])
            mels.append(mel)
            prompt_token = torch.cat((prompt_token, token), dim=-1)
    return speeches


def upstream_frames(n: int) -> int:
    """GLM's feat_len for n tokens (12.5 Hz tokens, 22050 / 256 Hz mel), on an int32 tensor as upstream has it."""
    return int((torch.tensor([n], dtype=torch.int32) / 12.5 * 22050 / 256).int())

