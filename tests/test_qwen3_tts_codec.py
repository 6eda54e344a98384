"""Our Qwen3-TTS 12 Hz codec decoder against the reference (`qwen-tts-hf`'s Qwen3TTSTokenizerV2Decoder, the same
weights loaded strictly from the tiny speech-tokenizer folder), and our streaming decode against our whole-clip
decode. The tiny folder keeps the real timing (1920 samples per frame, 16 x 2048 codes, a 72-frame attention
window), so the streams here run past the window.

Tolerance: 1e-5 absolute on float32 audio in [-1, 1] peaking near 0.9 (the tiny writer calibrates the level).
Measured here: 3e-6 to 6e-6 against the reference and 3e-6 to 4e-6 between streaming and whole-clip decodes, the
rounding of ~35 stacked convs whose kernels differ with the input length. In float64 the streaming gap is
rounding alone (1e-10 asserted), which a wrong state could not reach.
"""
import json
import sys

import pytest
import torch

from qwen_tts_oracle import reference_codec
from voxbackend.components.mimi.encoder import MimiEncoder
from voxbackend.components.mimi.weights import read_codec_tensors
from voxbackend.models.qwen3_tts.codec import Qwen3TTSCodec
from voxbackend.models.qwen3_tts.tiny_codec import write_tiny_qwen3_tts_codec

TOL = 1e-5
WINDOW = 72


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen3_tts_codec(tmp_path_factory.mktemp("qwen3_tts_codec"), seed=0)


@pytest.fixture(scope="module")
def codec(folder):
    return Qwen3TTSCodec.from_pretrained(folder)


@pytest.fixture(scope="module")
def reference(folder):
    """The reference decoder with the folder's `decoder.*` weights (strict), and the official decode entry point
    `Qwen3TTSTokenizerV2Model.decode` bound to it. The whole reference model does not construct on transformers
    5.23 (its Mimi encoder assigns MimiModel properties), and decoding never touches the encoder."""
    decoder, decode = reference_codec(folder)
    return decoder, lambda codes: torch.stack(decode(codes))


def _codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, frames, 16), generator=torch.Generator().manual_seed(seed))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_reference_leaves_no_trace(reference):
    """Other tests in the session still see the real environment: no stand-in modules, no foreign RoPE entry."""
    from transformers import MimiConfig, MimiModel
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "default" not in ROPE_INIT_FUNCTIONS
    assert not any(vars(m).get("_voxbackend_stand_in") for m in list(sys.modules.values()) if m is not None)
    MimiModel(MimiConfig(hidden_size=16, num_filters=2, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=16, upsample_groups=16, codebook_dim=8,
                         vector_quantization_hidden_dimension=8, num_quantizers=2))


def test_attributes_and_layout(codec, folder, tmp_path):
    assert (codec.sample_rate, codec.frame_size, codec.num_codebooks, codec.codebook_size) == (24000, 1920, 16, 2048)
    assert codec.frame_rate == 12.5 and codec.pre_transformer.window == WINDOW and not codec.training
    # the Mimi encoder half (Base checkpoints encode reference audio with it) loads strictly in our MimiEncoder
    cfg = json.loads((folder / "config.json").read_text())
    encoder = MimiEncoder(cfg["encoder_config"])
    encoder.load_hf_weights(read_codec_tensors(folder, "encoder."))
    assert encoder.encode(torch.randn(1, 1, 3 * 1920), cfg["encoder_valid_num_quantizers"]).shape == (1, 16, 3)
    # a Qwen3-TTS checkpoint folder (the talker's config.json, the tokenizer as speech_tokenizer/) loads too
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_tts"}')
    (tmp_path / "speech_tokenizer").symlink_to(folder)
    assert torch.equal(Qwen3TTSCodec.from_pretrained(tmp_path).codebooks, codec.codebooks)


def test_whole_clip_matches_reference(codec, reference):
    _, official_decode = reference
    codes = _codes(2, 100, seed=1)  # past the 72-frame window, under the official 300-frame chunk
    ref = official_decode(codes)
    ours = codec.decode(codes)
    assert ours.shape == (2, 100 * 1920)
    assert ref.std() > 0.05 and (ours[0] - ours[1]).abs().max() > 0.1  # real audio, rows differ
    assert _err(ours, ref) < TOL


def test_long_clip_matches_reference_forward_not_its_chunks(codec, reference):
    decoder, official_decode = reference
    codes = _codes(1, 320, seed=2)
    with torch.no_grad():
        whole = decoder(codes.transpose(1, 2))[:, 0]
    ours = codec.decode(codes)
    assert _err(ours, whole) < TOL
    # the official decode cuts 300-frame chunks with 25 frames of left context: approximate past frame 300
    chunked = official_decode(codes)
    assert _err(chunked[:, :300 * 1920], whole[:, :300 * 1920]) < TOL
    assert _err(chunked, whole) > 1e-3


def test_every_codebook_changes_the_audio(codec):
    codes = _codes(1, 6, seed=3).repeat(17, 1, 1)
    for k in range(16):  # row k + 1 changes codebook k only
        codes[k + 1, :, k] = (codes[k + 1, :, k] + 1 + k) % 2048
    audio = codec.decode(codes)
    for k in range(16):
        assert (audio[k + 1] - audio[0]).abs().max() > 1e-3, k


def _stream(codec: Qwen3TTSCodec, clips: list[torch.Tensor], schedules: list[list[int]]) -> list[torch.Tensor]:
    """Decode clips[i] ([T_i, 16]) as windows of sizes schedules[i], all streams that still have frames batched
    into one decode_window call per round (so rows of different ages and window sizes share every call)."""
    states = [codec.new_state() for _ in clips]
    pos = [0] * len(clips)
    pieces: list[list[torch.Tensor]] = [[] for _ in clips]
    for rnd in range(max(len(s) for s in schedules)):
        live = [i for i, s in enumerate(schedules) if rnd < len(s)]
        windows = [clips[i][pos[i]:pos[i] + schedules[i][rnd]] for i in live]
        outs = codec.decode_window([states[i] for i in live], windows)
        for i, w, out in zip(live, windows, outs):
            assert out.shape == (w.shape[0] * 1920,)
            pieces[i].append(out)
            pos[i] += w.shape[0]
    assert pos == [c.shape[0] for c in clips] and [s.frames for s in states] == pos
    return [torch.cat(p) for p in pieces]


def test_streaming_equals_whole_clip(codec):
    # a round costs (live streams) x (its longest window): long windows are kept few, so the test stays cheap
    schedules = [
        [1] * 76,                                        # one frame at a time, past the window
        [2, 3] * 16,                                     # 80 frames, done after 32 rounds
        [0] * 32 + [3, 1, 2] * 14 + [7, 1],              # joins late (empty windows first): 92 frames
        [7] * 5,                                         # short stream, gone after five rounds
    ]
    clips = [_codes(1, sum(s), seed=10 + i)[0] for i, s in enumerate(schedules)]
    streamed = _stream(codec, clips, schedules)
    for clip, audio in zip(clips, streamed):
        whole = codec.decode(clip[None])[0]
        assert _err(audio, whole) < TOL


def test_streaming_equals_whole_clip_in_float64(tmp_path):
    # an 8-frame attention window, so that short (cheap in float64) streams run well past it
    codec = Qwen3TTSCodec.from_pretrained(write_tiny_qwen3_tts_codec(tmp_path, seed=1, encoder=False,
                                                                     sliding_window=8), dtype=torch.float64)
    assert codec.pre_transformer.window == 8
    schedules = [[1, 2, 3] + [7] * 3, [0, 5] + [1] * 3 + [9, 4]]  # 27 and 21 frames, batched at different ages
    clips = [_codes(1, sum(s), seed=40 + i)[0] for i, s in enumerate(schedules)]
    for clip, audio in zip(clips, _stream(codec, clips, schedules)):
        assert audio.dtype == torch.float64 and _err(audio, codec.decode(clip[None])[0]) < 1e-10


def test_streams_are_independent(codec):
    a, b = _codes(1, 40, seed=20)[0], _codes(1, 36, seed=21)[0]
    alone_a = _stream(codec, [a], [[5] * 8])[0]
    alone_b = _stream(codec, [b], [[9] * 4])[0]
    sa, sb = codec.new_state(), codec.new_state()
    out_a, out_b = [], []
    for i in range(8):  # the two streams interleaved call by call
        out_a += codec.decode_window([sa], [a[5 * i:5 * i + 5]])
        if i < 4:
            out_b += codec.decode_window([sb], [b[9 * i:9 * i + 9]])
    assert torch.equal(torch.cat(out_a), alone_a) and torch.equal(torch.cat(out_b), alone_b)
    # and batched together, at different ages and window sizes
    together = _stream(codec, [a, b], [[5] * 8, [0, 0, 0] + [9] * 4])
    assert _err(together[0], alone_a) < TOL and _err(together[1], alone_b) < TOL


def test_bad_codes_are_refused_and_leave_the_state(codec):
    state = codec.new_state()
    codec.decode_window([state], [_codes(1, 3, seed=30)[0]])
    before = state.buf.clone()
    bad = [_codes(1, 2, seed=31)[0][:, :15],                   # 15 codebooks
           torch.full((2, 16), 2048),                          # out of range
           torch.full((2, 16), -1),
           torch.zeros(2, 16)]                                 # float
    for codes in bad:
        with pytest.raises(ValueError, match="codes"):
            codec.decode_window([state], [codes])
    with pytest.raises(ValueError, match="one window per stream"):
        codec.decode_window([state, state], [_codes(1, 1, seed=32)[0]] * 2)
    assert state.frames == 3 and torch.equal(state.buf, before)
    assert codec.decode_window([state], [torch.zeros(0, 16, dtype=torch.long)])[0].numel() == 0


def test_writer_is_deterministic(tmp_path, folder):
    from safetensors.torch import load_file

    again = load_file(str(write_tiny_qwen3_tts_codec(tmp_path / "again", seed=0) / "model.safetensors"))
    first = load_file(str(folder / "model.safetensors"))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert (tmp_path / "again" / "config.json").read_text() == (folder / "config.json").read_text()
