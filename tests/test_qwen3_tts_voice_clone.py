"""Qwen3-TTS Base (voice cloning) against the reference (qwen-tts-hf): the tiny Base checkpoint that voxbackend
writes (without the reference) loads into the reference classes strictly: `Qwen3TTSForConditionalGeneration`
(which builds the ECAPA-TDNN speaker encoder for a Base config) and the whole 12 Hz tokenizer
`Qwen3TTSTokenizerV2Model`, Mimi encoder included.
"""
from __future__ import annotations

import json

import pytest
import torch

from qwen_tts_oracle import reference_model, reference_tokenizer
from voxbackend.tools.tiny_qwen3_tts import write_tiny_qwen3_tts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_base"), variant="base", seed=5)


@pytest.fixture(scope="module")
def ref_model(base):
    return reference_model(base)


@pytest.fixture(scope="module")
def ref_tokenizer(base):
    return reference_tokenizer(base / "speech_tokenizer")


def test_base_checkpoint_loads_into_the_reference_model_strictly(base, ref_model):
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["tts_model_type"] == "base" and cfg["talker_config"]["spk_id"] == {}
    se = cfg["speaker_encoder_config"]
    assert se["enc_dim"] == cfg["talker_config"]["hidden_size"] and se["sample_rate"] == 24000
    assert ref_model.speaker_encoder is not None and ref_model.speaker_encoder_sample_rate == 24000
    # load_state_dict(strict=True) passed in reference_model: every speaker-encoder tensor came from the file
    mels = torch.randn(2, 50, se["mel_dim"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb = ref_model.speaker_encoder(mels)
    assert emb.shape == (2, se["enc_dim"]) and emb.std() > 0.1  # random weights: not a constant embedding
    assert (emb[0] - emb[1]).abs().max() > 0.1


def test_speech_tokenizer_loads_into_the_reference_tokenizer_strictly(base, ref_tokenizer):
    wrapper, info = ref_tokenizer
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    cfg = json.loads((base / "speech_tokenizer" / "config.json").read_text())
    assert cfg["encoder_valid_num_quantizers"] == 16 and cfg["encoder_config"]["codebook_size"] == 2048
    assert wrapper.feature_extractor.sampling_rate == 24000
    audio = torch.randn(8 * 1920, generator=torch.Generator().manual_seed(0)).clamp(-1, 1).numpy() * 0.5
    codes = wrapper.encode(audio, sr=24000).audio_codes[0]
    assert codes.shape == (8, 16) and int(codes.max()) < 2048 and len(set(codes[:, 0].tolist())) > 1
    # the loading adaptations are undone: later tests see transformers as it is
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Encoder
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "default" not in ROPE_INIT_FUNCTIONS and "upsample" not in vars(Qwen3TTSTokenizerV2Encoder)


def test_other_variants_are_unchanged_by_base(tmp_path):
    """Base draws its speaker encoder after the talker from the same stream: the talker tensors are the same."""
    from safetensors.torch import load_file

    cv = load_file(str(write_tiny_qwen3_tts(tmp_path / "cv", variant="custom_voice", seed=1) / "model.safetensors"))
    b = load_file(str(write_tiny_qwen3_tts(tmp_path / "b", variant="base", seed=1) / "model.safetensors"))
    assert set(b) - set(cv) == {k for k in b if k.startswith("speaker_encoder.")}
    assert all(torch.equal(cv[k], b[k]) for k in cv)
    with pytest.raises(ValueError, match="variant"):
        write_tiny_qwen3_tts(tmp_path / "x", variant="clone")
