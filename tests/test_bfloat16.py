"""bfloat16 end to end on CPU (a GPU runs the same code in bfloat16): every served model synthesizes, and the parts
that must stay float32 do.

With random tiny weights the LM logits are near ties, so a bfloat16 greedy run leaves the float32 one within a few
steps (measured on this machine: Orpheus 14 of 40 tokens equal, CSM 2, Qwen3-TTS 3, CosyVoice2 30 of 30, Chatterbox
10, Chatterbox-Turbo 1 of 6); the test holds the first token, which every model must get right, and the codec is
compared on the same tokens, where the numbers mean something."""
import threading

import numpy as np
import pytest
import torch

import voxbackend
from voxbackend import SamplingParams
from voxbackend.events import EventKind
from voxbackend.models.registry import KINDS
from voxbackend.triton.loading import import_object

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

SERVED = [name for name, kind in KINDS.items() if kind.served]


def _greedy(model_dir, codec_dir, name: str, dtype: str) -> tuple[list[int], np.ndarray]:
    engine = voxbackend.load(model_dir, codec_dir, model=name, dtype=dtype)
    done, out = threading.Event(), {"audio": [], "ids": None, "error": None}

    def on_event(e) -> None:
        if e.kind is EventKind.AUDIO:
            out["audio"].append(e.audio)
        elif e.kind is EventKind.ERROR:
            out["error"] = e.error
        if e.final:
            out["ids"] = e.token_ids or []
            done.set()

    engine.submit(engine.model.prepare("Hello there.", None), SamplingParams(temperature=0, max_tokens=40, seed=0),
                  on_event)
    engine._wait(done)
    assert out["error"] is None, f"{name} {dtype}: {out['error']}"
    return out["ids"], np.concatenate(out["audio"]) if out["audio"] else np.zeros(0, np.float32)


@pytest.mark.parametrize("name", SERVED)
def test_every_served_model_synthesizes_in_bfloat16(name):
    model_dir, codec_dir = import_object(KINDS[name].tiny_checkpoint)()
    ids32, audio32 = _greedy(model_dir, codec_dir, name, "float32")
    ids16, audio16 = _greedy(model_dir, codec_dir, name, "bfloat16")
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
