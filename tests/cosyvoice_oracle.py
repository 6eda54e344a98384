"""Import the CosyVoice2 reference decoders (test oracles) without their heavy, unneeded dependencies.

scripts/setup_env.sh installs `cosyvoice-minicpmo` (upstream CosyVoice code), `step-audio2` (flashcosyvoice, an
independent reimplementation) and scipy `--no-deps --target` into folders under the venv, so none of their
top-level modules (`cosyvoice`, `matcha`, `utils`, `token2wav`...) are importable by the server itself. Only the
tests put those folders on sys.path, and only here. The stand-ins cover modules the tested path (flow inference,
HiFT inference, CosyVoice2Model streaming) imports but never calls: torchaudio (no build for our torch), matcha's
lightning-based utils package, and the ONNX/TensorRT/vLLM export helpers.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import sys
import types
from pathlib import Path

import pytest

ORACLES = Path(sys.prefix) / "oracles"


def _stand_in(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _on_path(*folders: str):
    """The oracle folders are importable only while their modules load (they stay cached in sys.modules)."""
    paths = [ORACLES / f for f in folders]
    for path in paths:
        if not path.is_dir():
            pytest.fail(f"oracle not installed at {path} (run scripts/setup_env.sh)")
    sys.path.extend(str(p) for p in paths)
    try:
        yield
    finally:
        for p in paths:
            sys.path.remove(str(p))


def load_cosyvoice():
    """Returns the upstream modules the tests drive: (flow, flow_matching, decoder, encoder, hift, f0, cli.model)."""
    with _on_path("scipy", "cosyvoice"):
        return _import_cosyvoice()


def _import_cosyvoice():
    if "torchaudio" not in sys.modules:
        _stand_in("torchaudio")
    if "matcha.utils" not in sys.modules:
        import matcha  # noqa: F401  (the real package; only its utils/__init__ pulls lightning and rich)
        utils = _stand_in("matcha.utils")
        utils.__path__ = []  # a package, so `matcha.utils.pylogger` resolves to the stand-in below
        _stand_in("matcha.utils.pylogger", get_pylogger=lambda name=__name__: logging.getLogger(name))
    if "cosyvoice.utils.file_utils" not in sys.modules:
        import cosyvoice.utils  # noqa: F401
        _stand_in("cosyvoice.utils.file_utils", logging=logging,
                  convert_onnx_to_trt=None, export_cosyvoice2_vllm=None)
    from cosyvoice.cli import model as cli_model
    from cosyvoice.flow import decoder, flow, flow_matching
    from cosyvoice.hifigan import f0_predictor, generator
    from cosyvoice.transformer import upsample_encoder
    return types.SimpleNamespace(flow=flow, flow_matching=flow_matching, decoder=decoder,
                                 encoder=upsample_encoder, hift=generator, f0=f0_predictor, model=cli_model)


def load_cosyvoice_llm():
    """Upstream cosyvoice.llm.llm (Qwen2LM, Qwen2Encoder) on transformers' Qwen2ForCausalLM."""
    with _on_path("scipy", "cosyvoice"):
        _import_cosyvoice()
        from cosyvoice.llm import llm
    return llm


def upstream_modules(cv, cfg):
    """The upstream flow and HiFT built from our config, the way cosyvoice2.yaml builds them."""
    from omegaconf import DictConfig
    enc, est, h = cfg.flow.encoder, cfg.flow.estimator, cfg.hift
    encoder = cv.encoder.UpsampleConformerEncoder(
        input_size=enc.size, output_size=enc.size, attention_heads=enc.heads, linear_units=enc.linear_units,
        num_blocks=enc.num_blocks, dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1,
        normalize_before=True, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn", use_cnn_module=False, macaron_style=False,
        static_chunk_size=enc.chunk_size)
    estimator = cv.decoder.CausalConditionalDecoder(
        in_channels=est.in_channels, out_channels=est.out_channels, channels=list(est.channels), dropout=0.0,
        attention_head_dim=est.attention_head_dim, n_blocks=est.n_blocks, num_mid_blocks=est.num_mid_blocks,
        num_heads=est.num_heads, act_fn="gelu", static_chunk_size=est.chunk_size, num_decoding_left_chunks=-1)
    cfm = cv.flow_matching.CausalConditionalCFM(
        in_channels=240, n_spks=1, spk_emb_dim=80, estimator=estimator,
        cfm_params=DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine",
                               "training_cfg_rate": 0.2, "inference_cfg_rate": cfg.flow.cfg_rate,
                               "reg_loss_type": "l1"}))
    flow = cv.flow.CausalMaskedDiffWithXvec(
        input_size=enc.size, output_size=cfg.flow.mel_bins, spk_embed_dim=cfg.flow.spk_embed_dim, output_type="mel",
        vocab_size=cfg.flow.vocab_size, input_frame_rate=25, only_mask_loss=True, token_mel_ratio=enc.upsample,
        pre_lookahead_len=enc.pre_lookahead_len, encoder=encoder, decoder=cfm)
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
    return flow, hift


def upstream_cosyvoice2_model(folder: Path, cfg):
    """Upstream CosyVoice2Model (flow + HiFT; `tts(source_speech_token=...)`) on folder's flow.pt and hift.pt,
    loaded strictly; cfg: our Token2WavConfig, which gives the sizes cosyvoice2.yaml would."""
    import torch

    cv = load_cosyvoice()
    with torch.random.fork_rng():
        flow, hift = upstream_modules(cv, cfg)
    model = cv.model.CosyVoice2Model(None, flow, hift, fp16=False)
    model.load(None, str(Path(folder) / "flow.pt"), str(Path(folder) / "hift.pt"))  # strict: our names are theirs
    return model


def upstream_qwen2lm(folder: Path, sampling=None):
    """Upstream Qwen2LM on transformers' Qwen2ForCausalLM, folder's llm.pt loaded strictly. sampling: upstream's
    `sampling(scores, decoded, top_k)` callable (cosyvoice2.yaml: ras_sampling), None for tests that replace
    `sampling_ids`."""
    import json

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    llm = load_cosyvoice_llm()
    folder = Path(folder)
    config = Qwen2Config(**json.loads((folder / "CosyVoice-BlankEN" / "config.json").read_text()))
    encoder = llm.Qwen2Encoder.__new__(llm.Qwen2Encoder)  # its __init__ reads a pretrained folder
    torch.nn.Module.__init__(encoder)
    with torch.random.fork_rng():
        encoder.model = Qwen2ForCausalLM(config)
    state = torch.load(folder / "llm.pt", weights_only=True)
    speech_tokens = state["speech_embedding.weight"].shape[0] - 3
    model = llm.Qwen2LM(config.hidden_size, config.hidden_size, speech_tokens, encoder, sampling=sampling)
    model.load_state_dict(state, strict=True)
    step = encoder.forward_one_step

    def forward_one_step(xs, masks, cache=None):
        # Upstream passes a causal mask only as long as the new positions. transformers 4.x, which upstream
        # targets, drops an all-ones mask under SDPA (attend to the whole cache); transformers 5 reads it as
        # covering the last positions only. Its last row is all ones: give it as long as cache + new positions.
        past = cache.get_seq_length() if cache is not None else 0
        return step(xs, torch.ones(1, 1, past + xs.shape[1], dtype=torch.bool), cache)

    encoder.forward_one_step = forward_one_step
    return model.eval()


@contextlib.contextmanager
def legacy_cache_indexing():
    """Upstream inference_bistream reads the KV length as `cache[0][0].size(2)` (transformers 4's tuple form);
    transformers 5's DynamicCache has no indexing. This gives it (keys, values) of a layer while the oracle runs."""
    from transformers.cache_utils import DynamicCache

    assert not hasattr(DynamicCache, "__getitem__")
    DynamicCache.__getitem__ = lambda self, i: (self.layers[i].keys, self.layers[i].values)
    try:
        yield
    finally:
        del DynamicCache.__getitem__


def upstream_ras_sampling():
    """cosyvoice2.yaml's sampling: ras_sampling with top_p 0.8, top_k 25, win_size 10, tau_r 0.1."""
    import functools

    load_cosyvoice()
    from cosyvoice.utils.common import ras_sampling

    return functools.partial(ras_sampling, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def load_flashcosyvoice():
    """step-audio2's flashcosyvoice flow and HiFT (batched, independent of the upstream code)."""
    with _on_path("scipy", "step_audio2"):
        from flashcosyvoice.modules import flow, hifigan
        from flashcosyvoice.modules.flow_components import estimator, upsample_encoder
    return types.SimpleNamespace(flow=flow, hift=hifigan, estimator=estimator, encoder=upsample_encoder)
