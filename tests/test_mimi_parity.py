"""Our streaming Mimi decoder against `moshi`'s streaming Mimi and transformers' MimiModel, on a tiny random
checkpoint with the real timing (24 kHz, 1920 samples per frame, 32 codebooks) and a 10-step attention window,
so every stream here runs well past the window."""
import re

import pytest
import torch

from voxbackend.components.mimi.decoder import MimiDecoder
from voxbackend.components.mimi.tiny import write_tiny_mimi

TOL = 1e-4
FRAMES = 24


@pytest.fixture(scope="module")
def tiny_mimi(tmp_path_factory):
    return write_tiny_mimi(tmp_path_factory.mktemp("tiny_mimi"), seed=0)


@pytest.fixture(scope="module")
def ours(tiny_mimi):
    return MimiDecoder.from_pretrained(tiny_mimi)


@pytest.fixture(scope="module")
def ours_moshi(tiny_mimi):
    return MimiDecoder.from_pretrained(tiny_mimi, window_mode="moshi")


def _codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, 32, frames), generator=torch.Generator().manual_seed(seed))


def _stream(dec: MimiDecoder, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    states = [dec.new_state() for _ in range(codes.shape[0])]
    out, t = [], 0
    for n in sizes:
        out.append(dec.decode_chunk(codes[:, :, t:t + n], states))
        t += n
    assert t == codes.shape[-1] and all(s.frames == t for s in states)
    return torch.cat(out, dim=-1)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_attributes(ours):
    assert (ours.sample_rate, ours.frame_size, ours.num_codebooks, ours.latent_stride) == (24000, 1920, 32, 2)
    assert ours.frame_rate == 12.5 and not ours.training


# ---- moshi oracle ----

def _moshi_mimi(path):
    """moshi's MimiModel built like `moshi.models.loaders.get_mimi`, with the tiny config, HF weights mapped in."""
    import json

    from safetensors.torch import load_file

    import moshi.models.compression as moshi_compression
    from moshi.modules import SEANetDecoder, SEANetEncoder, transformer
    from moshi.quantization import SplitResidualVectorQuantizer

    cfg = json.loads((path / "config.json").read_text())
    d = cfg["hidden_size"]
    seanet = dict(channels=1, dimension=d, causal=True, n_filters=cfg["num_filters"],
                  n_residual_layers=cfg["num_residual_layers"], activation="ELU", compress=cfg["compress"],
                  dilation_base=cfg["dilation_growth_rate"], disable_norm_outer_blocks=0,
                  kernel_size=cfg["kernel_size"], residual_kernel_size=cfg["residual_kernel_size"],
                  last_kernel_size=cfg["last_kernel_size"], norm="none", pad_mode="constant",
                  ratios=cfg["upsampling_ratios"], true_skip=True)
    tr = dict(d_model=d, num_heads=cfg["num_attention_heads"], num_layers=cfg["num_hidden_layers"], causal=True,
              layer_scale=0.01, context=cfg["sliding_window"], conv_layout=True,
              max_period=cfg["rope_parameters"]["rope_theta"], gating="none", norm="layer_norm",
              positional_embedding="rope", dim_feedforward=cfg["intermediate_size"], input_dimension=d,
              output_dimensions=[d])
    encoder = SEANetEncoder(**seanet)
    model = moshi_compression.MimiModel(
        encoder, SEANetDecoder(**seanet),
        SplitResidualVectorQuantizer(dimension=cfg["vector_quantization_hidden_dimension"], n_q=cfg["num_quantizers"],
                                     bins=cfg["codebook_size"], input_dimension=d, output_dimension=d),
        channels=1, sample_rate=cfg["sampling_rate"], frame_rate=12.5,
        encoder_frame_rate=cfg["sampling_rate"] / encoder.hop_length, causal=True, resample_method="conv",
        encoder_transformer=transformer.ProjectedTransformer(**tr),
        decoder_transformer=transformer.ProjectedTransformer(**tr))
    hf = load_file(path / "model.safetensors")
    heads, head_dim = cfg["num_attention_heads"], d // cfg["num_attention_heads"]

    def unpermute(w):  # HF's half-split RoPE rows -> moshi's interleaved rows (inverse of HF's conversion)
        return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)

    state = {}
    for name in model.state_dict():
        h = re.sub(r"^(encoder|decoder)\.model\.", r"\1.layers.", name)
        h = re.sub(r"(\.conv)+\.(weight|bias)$", r".conv.\2", h)
        h = re.sub(r"(\.convtr)+\.(weight|bias)$", r".conv.\2", h)
        h = h.replace("_transformer.transformer.", "_transformer.")
        h = h.replace("rvq_first.", "semantic_residual_vector_quantizer.")
        h = h.replace("rvq_rest.", "acoustic_residual_vector_quantizer.")
        h = re.sub(r"vq\.layers\.(\d+)\._codebook\.", r"layers.\1.codebook.", h)
        h = h.replace("._initialized", ".initialized").replace(".embedding_sum", ".embed_sum")
        for a, b in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"), ("linear1", "mlp.fc1"),
                     ("linear2", "mlp.fc2"), ("layer_scale_1", "self_attn_layer_scale"),
                     ("layer_scale_2", "mlp_layer_scale"), ("self_attn.out_projs.0", "self_attn.o_proj")):
            h = h.replace(f".{a}.", f".{b}.")
        if h.endswith("self_attn.in_projs.0.weight"):
            p = h[: -len("in_projs.0.weight")]
            state[name] = torch.cat([unpermute(hf[p + "q_proj.weight"]), unpermute(hf[p + "k_proj.weight"]),
                                     hf[p + "v_proj.weight"]])
        else:
            state[name] = hf[h]
    model.load_state_dict(state, strict=True)
    model.set_num_codebooks(cfg["num_quantizers"])
    return model.eval()


@pytest.fixture(scope="module")
def moshi_streamed(tiny_mimi):
    """(codes, audio): moshi's streaming decoder fed one frame per call, 3 streams batched, past the window."""
    model = _moshi_mimi(tiny_mimi)
    codes = _codes(3, FRAMES, seed=1)
    with torch.no_grad():
        with model.streaming(batch_size=3):
            streamed = torch.cat([model.decode(codes[:, :, t:t + 1]) for t in range(FRAMES)], dim=-1)
        one_shot = model.decode(codes)
    assert streamed.abs().max() > 0.1  # not a silent model
    return codes, streamed, one_shot


@pytest.mark.parametrize("sizes", [[1, 3, 10, 2, 1, 7], [5, 5, 4, 10], [FRAMES]])
def test_streaming_matches_moshi_streaming(ours_moshi, moshi_streamed, sizes):
    codes, ref, _ = moshi_streamed
    assert _err(_stream(ours_moshi, codes, sizes), ref) <= TOL


def test_exact_window_matches_moshi_one_shot_and_streaming_until_window(ours, moshi_streamed):
    """The default (exact) window equals moshi's one-shot decode everywhere and its streaming decode until the
    stream passes the window; after that moshi's streaming drops a frame's oldest key (see MimiDecoder)."""
    codes, streamed, one_shot = moshi_streamed
    got = _stream(ours, codes, [1, 3, 10, 2, 1, 7])
    assert _err(got, one_shot) <= TOL
    n = ours.config["sliding_window"] // ours.latent_stride * ours.frame_size
    assert _err(got[..., :n], streamed[..., :n]) <= TOL
    assert _err(streamed[..., n:], one_shot[..., n:]) > 100 * TOL  # if this fails, moshi changed: revisit the mode


# ---- self-consistency and transformers ----

@pytest.mark.parametrize("mode", ["exact", "moshi"])
@pytest.mark.parametrize("sizes", [[1] * FRAMES, [3] * 8, [10, 10, 4], [2, 5, 1, 9, 7]])
def test_streaming_equals_all_at_once(ours, ours_moshi, mode, sizes):
    dec = ours if mode == "exact" else ours_moshi
    codes = _codes(2, FRAMES, seed=2)
    assert _err(_stream(dec, codes, sizes), dec.decode(codes)) <= TOL


@pytest.mark.parametrize("frames", [1, 4, FRAMES])
def test_all_at_once_matches_transformers(tiny_mimi, ours, frames):
    from transformers import MimiModel

    hf = MimiModel.from_pretrained(tiny_mimi).eval()
    codes = _codes(2, frames, seed=3 + frames)
    with torch.no_grad():
        ref = hf.decode(codes).audio_values
    assert _err(ours.decode(codes), ref) <= TOL


@pytest.mark.parametrize("mode", ["exact", "moshi"])
def test_batch_of_requests_at_different_positions(ours, ours_moshi, mode):
    """Three requests at frames 0, 3 and 11 (empty, partly filled and wrapped KV windows) decoded together
    equal each decoded alone, and their states stay their own."""
    ours = ours if mode == "exact" else ours_moshi
    starts, n1, n2 = [0, 3, 11], 4, 3
    codes = [_codes(1, s + n1 + n2, seed=10 + i) for i, s in enumerate(starts)]
    alone = [ours.decode(c) for c in codes]

    states = [ours.new_state() for _ in starts]
    heads = []
    for c, s, st in zip(codes, starts, states):  # bring each request to its own position first
        heads.append(ours.decode_chunk(c[:, :, :s], [st]) if s else c.new_zeros(1, 1, 0, dtype=torch.float32))
    mid = ours.decode_chunk(torch.cat([c[:, :, s:s + n1] for c, s in zip(codes, starts)]), states)
    order = [2, 0, 1]  # rows in another order next time
    tail = ours.decode_chunk(torch.cat([codes[i][:, :, starts[i] + n1:] for i in order]), [states[i] for i in order])
    for i, s in enumerate(starts):
        got = torch.cat([heads[i][0], mid[i], tail[order.index(i)]], dim=-1)
        assert states[i].frames == s + n1 + n2
        assert _err(got, alone[i][0]) <= TOL
