"""The Qwen3-TTS reference (`qwen-tts-hf`, installed --no-deps) and tiny random checkpoints in its layout.

The import goes through tests/qwen_tts_oracle.py (shared with the codec tests): empty stand-ins for sox,
onnxruntime, librosa and torchaudio during the import only, and transformers' global RoPE table left as it was."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.qwen_tts_oracle import import_qwen_tts, reference_rope
from tests.util_decoder import randomize

TALKER = dict(
    vocab_size=3072, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, rope_theta=1e6, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_scaling={"mrope_section": [4, 4, 4], "interleaved": True, "rope_type": "default"},
    num_code_groups=16, text_hidden_size=48, text_vocab_size=1000,
    codec_eos_token_id=2150, codec_pad_id=2148, codec_bos_id=2149,
    spk_id={"vivian": 3000}, spk_is_dialect={"vivian": False}, codec_language_id={"english": 2050},
    code_predictor_config=dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_code_groups=16,
                               rope_theta=1e6, max_position_embeddings=64),
)


def import_reference():
    """(modeling, configuration) modules of qwen_tts, imported through the shared oracle loader (stand-ins for
    its unused imports, no global RoPE entry left behind; tests/qwen_tts_oracle.py)."""
    import_qwen_tts()
    from qwen_tts.core.models import configuration_qwen3_tts, modeling_qwen3_tts

    return modeling_qwen3_tts, configuration_qwen3_tts


def write_tiny_qwen3_tts(out: Path, seed: int = 0):
    """A tiny random Qwen3TTSForConditionalGeneration (CustomVoice layout) saved in the Hugging Face layout.

    Every parameter is redrawn (biases and norm weights too), so a weight loaded in the wrong place changes the
    logits."""
    modeling, configuration = import_reference()
    from safetensors.torch import save_file

    config = configuration.Qwen3TTSConfig(talker_config=dict(TALKER), tts_model_type="custom_voice",
                                          tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="0b6")
    config.architectures = ["Qwen3TTSForConditionalGeneration"]
    torch.manual_seed(seed)
    with reference_rope():  # its RoPE modules look up a "default" initializer while they are built
        model = modeling.Qwen3TTSForConditionalGeneration(config).eval()
    randomize(model, seed + 1, unit_embeddings=True)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return model
