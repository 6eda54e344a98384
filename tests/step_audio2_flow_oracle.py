"""Step-Audio 2's token2wav flow (step-audio2==1.0.0's `cosyvoice2` package: CausalMaskedDiffWithXvec with a DiT
estimator and UpsampleConformerEncoderV2) as a test oracle, built at tiny sizes from its own classes.

The package folder is on sys.path only while its modules import (they stay cached in sys.modules). Stand-ins:
onnxruntime, which flow_matching imports at the top but the flow never calls. The encoder module sets two
torch._dynamo options on import; they are put back so other tests in the process see torch's defaults. Its
`forward_chunk` is wrapped in torch.compile(backend="eager"), the same math as the plain function, which runs
instead (tracing would cost seconds per chunk shape).
"""
from __future__ import annotations

import importlib.util
import math
import sys
import types

import torch
from cosyvoice_oracle import _on_path, _stand_in

from voxbackend.components.flow_hift.dit_estimator import DiTConfig
from voxbackend.components.flow_hift.dit_flow import DiTFlowConfig
from voxbackend.components.flow_hift.flow_encoder import EncoderConfig
from voxbackend.models.tiny_weights import perturb_default_inits


def tiny_config() -> DiTFlowConfig:
    return DiTFlowConfig(
        encoder=EncoderConfig(size=64, heads=4, linear_units=128, num_blocks=2, num_up_blocks=2),
        estimator=DiTConfig(hidden_size=64, depth=2, num_heads=2, head_dim=32, mlp_ratio=2.0))


def load_step_flow() -> types.SimpleNamespace:
    """The upstream modules: flow, flow_matching, dit (decoder_dit), encoder (upsample_encoder_v2)."""
    if "onnxruntime" not in sys.modules and importlib.util.find_spec("onnxruntime") is None:
        _stand_in("onnxruntime")
    dynamo = torch._dynamo.config
    saved = dynamo.suppress_errors, dynamo.cache_size_limit
    try:
        with _on_path("step_audio2"):
            from cosyvoice2.flow import decoder_dit, flow, flow_matching
            from cosyvoice2.transformer import upsample_encoder_v2
    finally:
        dynamo.suppress_errors, dynamo.cache_size_limit = saved
    encoder_class = upsample_encoder_v2.UpsampleConformerEncoderV2
    encoder_class.forward_chunk = getattr(encoder_class.forward_chunk, "_torchdynamo_orig_callable",
                                          encoder_class.forward_chunk)
    return types.SimpleNamespace(flow=flow, flow_matching=flow_matching, dit=decoder_dit, encoder=upsample_encoder_v2)


def upstream_flow(cfg: DiTFlowConfig, seed: int = 0, stream_frames: int = 64) -> torch.nn.Module:
    """CausalMaskedDiffWithXvec at cfg's sizes (as flow.yaml would build it), random weights, eval mode, streaming
    caches for up to stream_frames mel frames. Its noise buffer is empty: the test sets `decoder.rand_noise`
    (1, mel, frames)."""
    m = load_step_flow()
    enc, est = cfg.encoder, cfg.estimator
    encoder = m.encoder.UpsampleConformerEncoderV2(
        input_size=enc.size, output_size=enc.size, pre_lookahead_len=enc.pre_lookahead_len,
        num_blocks=enc.num_blocks, num_up_blocks=enc.num_up_blocks, up_stride=enc.upsample,
        up_scale_factor=enc.upsample, attention_heads=enc.heads, linear_units=enc.linear_units)
    # on the meta device: the constructors allocate streaming caches sized for the full model (2 GB in the CFM)
    with torch.device("meta"):
        estimator = m.dit.DiT(in_channels=est.in_channels, out_channels=est.out_channels, mlp_ratio=est.mlp_ratio,
                              depth=est.depth, num_heads=est.num_heads, head_dim=est.head_dim,
                              hidden_size=est.hidden_size)
        decoder = m.flow_matching.CausalConditionalCFM(estimator, inference_cfg_rate=cfg.cfg_rate)
        decoder.rand_noise = torch.empty(1, cfg.mel_bins, 0)
        for holder in (decoder, estimator):
            holder.att_cache_buffer, holder.cnn_cache_buffer = torch.empty(0), torch.empty(0)
    decoder.to_empty(device="cpu")
    # the same caches for cfg's sizes: (steps,) blocks, cond + uncond rows, heads, frames, keys | values
    att_cache = (est.depth, 2, est.num_heads, stream_frames, 2 * est.head_dim)
    cnn_cache = (est.depth, 2, 2 * est.hidden_size, 2)    # both convs' inputs, 2 frames each
    estimator.att_cache_buffer, estimator.cnn_cache_buffer = torch.zeros(att_cache), torch.zeros(cnn_cache)
    decoder.att_cache_buffer = torch.zeros(cfg.n_timesteps, *att_cache)
    decoder.cnn_cache_buffer = torch.zeros(cfg.n_timesteps, *cnn_cache)
    flow = m.flow.CausalMaskedDiffWithXvec(input_size=enc.size, output_size=cfg.mel_bins,
                                           spk_embed_dim=cfg.spk_embed_dim, vocab_size=cfg.vocab_size,
                                           encoder=encoder, decoder=decoder)
    randomize(flow, seed)
    return flow.eval()


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every matrix N(0, 1/fan_in) (the DiT's zero-initialised adaLN and output layers included, which would
    otherwise make the vector field zero), then norms and biases drawn away from 1/0."""
    generator = torch.Generator().manual_seed(seed)
    for t in module.state_dict().values():
        if t.ndim >= 2:
            t.copy_(torch.randn(t.shape, generator=generator) / math.sqrt(t[0].numel()))
    perturb_default_inits(module, generator)
