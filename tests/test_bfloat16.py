"""bfloat16 end to end on CPU (a GPU runs the same code in bfloat16): every served model synthesizes, and the parts
that must stay float32 do.

With random tiny weights the LM logits are near ties, so a bfloat16 greedy run leaves the float32 one within a few
steps (measured on this machine: Orpheus 14 of 40 tokens equal, CSM 2, Qwen3-TTS 3, CosyVoice2 30 of 30, Chatterbox
10, Chatterbox-Turbo 1 of 6); the test holds the first token, which every model must get right, and each codec is
compared on the same tokens (the LM forced onto the float32 run's), where the numbers mean something. The cloning
front ends (speaker encoders, S3 tokenizers) run in the preprocess step on the CPU in float32 whatever the engine's
dtype: once per request on a clip of seconds, not per step."""

import numpy as np
import pytest
import torch

from voxbackend import SamplingParams
from tests.util_engine_drive import SERVED, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def _greedy(name: str, dtype: str, forced: list | None = None) -> tuple[list, np.ndarray]:
    """A greedy run (its LM steps and its audio); with `forced`, each step's sampled ids are replaced by those given
    (teacher forcing: they are also the next step's input), so the codec decodes the same tokens."""
    engine = tiny_engine(name, dtype=dtype)
    steps, run = [], engine.runner.run

    def recorded(plan):
        out = run(plan)
        if forced is not None:
            out = [(r, forced[len(steps) + i]) for i, (r, _) in enumerate(out)]
        steps.extend(step for _, step in out)
        return out

    engine.runner.run = recorded
    audio = engine.synthesize("Hello there, how are you?", None,
                              SamplingParams(temperature=0, max_tokens=48, min_tokens=48, seed=0))[0]
    return steps, audio


@pytest.mark.parametrize("name", SERVED)
def test_every_served_model_synthesizes_in_bfloat16(name):
    ids32, audio32 = _greedy(name, "float32")
    ids16, audio16 = _greedy(name, "bfloat16")
    first = [ids[0][0] if isinstance(ids[0], list) else ids[0] for ids in (ids32, ids16)]  # CSM: a frame's codebook 0
    assert first[0] == first[1]
    assert audio16.dtype == np.float32 and audio16.size > 0 and np.isfinite(audio16).all()


def _spectral_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of STFT magnitudes: blind to the harmonics' phase, which a 0.1% F0 moves within a second."""
    n, window = min(a.numel(), b.numel()), torch.hann_window(512)
    mag = [torch.stft(x.flatten()[:n].float(), 512, 128, window=window, return_complex=True).abs() for x in (a, b)]
    return float((mag[0] - mag[1]).norm() / mag[0].norm())


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.numel(), b.numel())
    a, b = a.flatten()[:n].float(), b.flatten()[:n].float()
    return float((a - b).norm() / a.norm())


def test_flow_and_hift_in_bfloat16_match_float32_on_the_same_tokens():
    from voxbackend.components.flow_hift.token2wav import load_token2wav
    from voxbackend.models.cosyvoice2.tiny import ensure_default_cosyvoice2

    folder = ensure_default_cosyvoice2()[0]
    codec32, codec16 = load_token2wav(folder), load_token2wav(folder, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompt, feat, embedding = torch.randint(0, 50, (10,), generator=g), torch.randn(20, 80, generator=g) / 2, \
        torch.randn(192, generator=g)
    tokens = torch.randint(0, 50, (40,), generator=g).tolist()
    mels = {}
    for key, codec in (("32", codec32), ("16", codec16)):
        codec.flow.register_forward_hook(lambda module, args, out, key=key: mels.__setitem__(key, out[0]))
    audio32 = codec32.decode_utterance(prompt, feat, embedding, tokens)
    audio16 = codec16.decode_utterance(prompt, feat, embedding, tokens)
    assert mels["16"].dtype == torch.float32 and _relative(mels["32"], mels["16"]) < 0.02  # measured 0.5%
    assert _spectral_error(audio32, audio16) < 0.10  # measured 3.8%
    # HiFT alone on one float32 mel: the same F0, so the same phase: the waveforms themselves agree
    mel = mels["32"][None]
    speech32, _ = codec32.hift(mel, [torch.Generator().manual_seed(1)], [None])
    speech16, _ = codec16.hift(mel, [torch.Generator().manual_seed(1)], [None])
    assert speech16.dtype == torch.float32 and _relative(speech32, speech16) < 0.02  # measured 0.5%


def test_hifts_float32_parts_stay_float32_and_unrounded_in_a_bfloat16_model():
    from voxbackend.components.flow_hift.hift import HiFTConfig, HiFTGenerator

    torch.manual_seed(0)
    hift = HiFTGenerator(HiFTConfig())
    reference = {k: v.clone() for k, v in hift.state_dict().items()}
    hift.to(torch.bfloat16)
    for key, value in hift.state_dict().items():
        if key.startswith(("f0_predictor.", "conv_post.")):
            assert value.dtype == torch.float32 and torch.equal(value, reference[key]), key
        else:
            assert value.dtype == torch.bfloat16, key
    assert hift.stft_window.dtype == torch.float32


# bounds on the relative error of the waveform and of its STFT magnitudes, same tokens; measured on this machine:
# orpheus 0.96% / 0.64%, csm 1.3% / 0.81%, qwen3_tts 2.7% / 1.6%, cosyvoice2 7.4% / 1.9%, chatterbox 6.3% / 2.8%,
# chatterbox_turbo 3.2% / 1.2%, step_audio2 18.5% / 9.4%, glm4_voice 29.4% / 8.8% (the flow models' waveforms drift
# in phase with their F0, their spectra less; Step's DiT carries its attention caches, bfloat16, from chunk to chunk;
# GLM's blocks take the earlier blocks' bfloat16 mels as their prompt)
CODEC_BF16 = {
    "orpheus": (0.03, 0.02), "csm": (0.04, 0.025), "qwen3_tts": (0.07, 0.045),
    "cosyvoice2": (0.2, 0.05), "chatterbox": (0.16, 0.07), "chatterbox_turbo": (0.08, 0.035),
    "step_audio2": (0.3, 0.15), "glm4_voice": (0.45, 0.15),
}


@pytest.mark.parametrize("name", SERVED)
def test_each_codec_in_bfloat16_is_close_to_float32_on_the_same_tokens(name):
    """The whole model in bfloat16, its LM forced onto the float32 run's tokens: SNAC, Mimi, the Qwen3 codec and
    the flow + HiFT decoders each hear the same codes, and their audio stays near the float32 audio."""
    steps, audio32 = _greedy(name, "float32")
    forced, audio16 = _greedy(name, "bfloat16", forced=steps)
    assert forced == steps and audio16.size == audio32.size > 0
    a, b = torch.from_numpy(audio32), torch.from_numpy(audio16)
    waveform, spectrum = CODEC_BF16[name]
    assert _relative(a, b) < waveform and _spectral_error(a, b) < spectrum, (_relative(a, b), _spectral_error(a, b))
    assert _relative(a, b) > 0  # the codec itself ran in bfloat16 (a float32 one gives the same samples)
