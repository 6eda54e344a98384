"""CSM-1B on a tiny random checkpoint: the engine (batched backbone + depth loop + streaming Mimi) against
transformers' CsmForConditionalGeneration.generate, frame by frame and sample by sample."""
import shutil

import numpy as np
import pytest
import torch

import voxbackend
from voxbackend import EventKind, InvalidRequest, SamplingParams
from voxbackend.models.csm.model import ContextSegment

import transformers  # noqa: E402
TOL = 1e-4
GREEDY = dict(do_sample=False, depth_decoder_do_sample=False)


@pytest.fixture(scope="module")
def ref(tiny_csm):
    return transformers.CsmForConditionalGeneration.from_pretrained(str(tiny_csm)).eval()


@pytest.fixture(scope="module")
def engine(tiny_csm):
    return voxbackend.load(tiny_csm, max_batch=3, page_size=16, kv_pages=64)


def _context(ref, seed: int, samples: int):
    """Random reference audio and its Mimi codes from transformers' own encoder."""
    audio = torch.randn(samples, generator=torch.Generator().manual_seed(seed)) * 0.3
    with torch.inference_mode():
        codes = ref.codec_model.encode(audio[None, None]).audio_codes[0].T  # [frames, 32]
    return audio, codes


def _hf_inputs(ref, rows, audio=None):
    """transformers' input for our prompt rows: text ids, with the audio placeholder / audio eos ids on audio rows
    (what CsmProcessor's chat template produces) and the raw audio for its codec to encode."""
    cfg = ref.config
    eos_frame = [cfg.codebook_eos_token_id] * cfg.num_codebooks
    ids = [r[-1] if r[-1] >= 0 else cfg.audio_eos_token_id if r[:-1] == eos_frame else cfg.audio_token_id
           for r in rows]
    # the processor's attention mask: without it generate would take the audio placeholder (= pad id) for padding
    kw = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if audio is not None:
        kw.update(input_values=audio[None, None], input_values_cutoffs=torch.tensor([[len(audio)]]))
    return kw


def _reference(ref, rows, frames, audio=None):
    with torch.inference_mode():
        out = ref.generate(**_hf_inputs(ref, rows, audio), max_new_tokens=frames, output_audio=True,
                           return_dict_in_generate=True, **GREEDY)
    return out.sequences[0], out.audio[0].numpy()


def _drive(engine, jobs, submit_at):
    """Submit jobs[i] = (rows, sampling) at engine step submit_at[i]; step until all finish; (frames, audio, reason)."""
    events: dict[str, list] = {}
    ids: list[str] = []
    step = 0
    while len(ids) < len(jobs) or any(not events.get(i) or not events[i][-1].final for i in ids):
        while len(ids) < len(jobs) and submit_at[len(ids)] <= step:
            rows, sp = jobs[len(ids)]
            ids.append(engine.submit(rows, sp, lambda e: events.setdefault(e.request_id, []).append(e)))
        engine.step()
        step += 1
    out = []
    for i in ids:
        last = events[i][-1]
        assert last.kind is EventKind.FINISHED, last.error
        chunks = [e.audio for e in events[i] if e.kind is EventKind.AUDIO]
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        out.append((torch.tensor(last.token_ids)[:, :32], audio, last.finish_reason, len(chunks)))
    assert engine.pool.used_pages == 0 and not engine.running
    return out


def test_loads_as_csm(engine):
    spec = engine.model.spec
    assert spec.name == "csm" and spec.token_columns == 33 and spec.has_depth and spec.codes_per_frame == 32
    assert spec.window.stateful and spec.window.frames == spec.window.hop_frames and spec.sample_rate == 24000


def test_greedy_batched_equals_transformers_generate(engine, ref):
    audio, codes = _context(ref, seed=1, samples=1920 * 4 - 500)
    prompts = [
        (engine.model.prepare("Hello there, how are you doing today?", 0), None, 14),
        (engine.model.prepare("Good night.", 3), None, 9),
        (engine.model.prepare("The quick brown fox jumps over the lazy dog.", 1,
                              context=[ContextSegment("I am doing well, thank you.", 0, codes.numpy())]), audio, 12),
        (engine.model.prepare("Numbers like one, two, three.", 7), None, 11),
    ]
    jobs = [(rows, SamplingParams(temperature=0, max_tokens=n)) for rows, _, n in prompts]
    got = _drive(engine, jobs, submit_at=[0, 0, 2, 5])  # 4 requests through 3 slots, joining mid-stream
    for (rows, ref_audio, n), (frames, audio_out, reason, chunks) in zip(prompts, got):
        want_frames, want_audio = _reference(ref, rows, n, ref_audio)
        assert reason == "length" and frames.shape == (n, 32)
        assert torch.equal(frames, want_frames)
        assert chunks >= 2 and audio_out.shape == want_audio.shape == (n * 1920,)
        assert np.abs(audio_out - want_audio).max() <= TOL


def test_stop_frame_ends_request_like_transformers(tiny_csm, tmp_path):
    """Depth heads zeroed (codebooks 1-31 are then always 0) and codebook 0's id 0 made to win where a chosen
    id would: a frame of zeros then stops generation, at a different frame per prompt."""
    model = transformers.CsmForConditionalGeneration.from_pretrained(str(tiny_csm)).eval()
    with torch.no_grad():
        model.depth_decoder.codebooks_head.weight.zero_()
        rows = voxbackend.load(tiny_csm).model.prepare("Hello world.", 0)
        frames, _ = _reference(model, rows, 8)
        model.lm_head.weight[0] = model.lm_head.weight[int(frames[4, 0])] * 1.05
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_csm / f, tmp_path / f)
    engine = voxbackend.load(tmp_path, max_batch=3, page_size=16, kv_pages=64)
    texts = ["Hello world.", "See you tomorrow, my friend.", "The weather this morning was cold."]
    jobs = [(engine.model.prepare(t, i), SamplingParams(temperature=0, max_tokens=20)) for i, t in enumerate(texts)]
    got = _drive(engine, jobs, submit_at=[0, 1, 2])
    assert got[0][2] == "stop" and len(got[0][0]) <= 5
    for (rows, _), (frames, audio, reason, _) in zip(jobs, got):
        want_frames, want_audio = _reference(model, rows, 20)
        assert torch.equal(frames, want_frames)
        assert reason == ("stop" if len(frames) < 20 else "length")
        assert audio.shape == want_audio.shape and np.abs(audio - want_audio).max(initial=0) <= TOL


def test_seeded_sampling_batched_equals_alone(engine):
    texts = ["Hello there.", "Please read this sentence slowly.", "Good morning!"]
    params = [SamplingParams(temperature=0.9, top_k=50, max_tokens=6, seed=5),
              SamplingParams(temperature=1.2, top_p=0.9, repetition_penalty=1.3, max_tokens=5, seed=6),
              SamplingParams(temperature=0.7, min_p=0.05, max_tokens=7, seed=7)]
    jobs = [(engine.model.prepare(t, i), p) for i, (t, p) in enumerate(zip(texts, params))]
    together = _drive(engine, jobs, submit_at=[0, 1, 3])
    for job, (frames, audio, *_) in zip(jobs, together):
        [(alone, alone_audio, *_)] = _drive(engine, [job], submit_at=[0])
        assert torch.equal(frames, alone) and np.array_equal(audio, alone_audio)
    assert len({f[0].tolist().__repr__() for f, *_ in together}) == 3


@pytest.mark.parametrize("call, match", [
    (lambda m: m.prepare("Hello.", 10), "speaker must be in"),
    (lambda m: m.prepare("Hello.", -1), "speaker must be in"),
    (lambda m: m.prepare("Hello.", "narrator"), "speaker must be an integer"),
    (lambda m: m.prepare("", 0), "text is empty"),
    (lambda m: m.prepare("   ", 0), "text is empty"),
    (lambda m: m.prepare(b"hi", 0), "text must be a string"),
    (lambda m: m.prepare("Hi.", 0, context=[ContextSegment("Before.", 12, np.zeros((3, 32), int))]),
     r"context\[0\].speaker"),
    (lambda m: m.prepare("Hi.", 0, context=[ContextSegment("", 0, np.zeros((3, 32), int))]),
     r"context\[0\].text is empty"),
    (lambda m: m.prepare("Hi.", 0, context=[ContextSegment("Before.", 0, np.zeros(24000, np.float32))]),
     r"context\[0\].codes: raw audio"),
    (lambda m: m.prepare("Hi.", 0, context=[ContextSegment("Before.", 0, np.zeros((3, 8), int))]),
     r"context\[0\].codes must be integer Mimi codes"),
    (lambda m: m.prepare("Hi.", 0, context=[ContextSegment("Before.", 0, np.full((3, 32), 4096))]),
     r"context\[0\].codes must be in"),
])
def test_bad_input(engine, call, match):
    with pytest.raises(InvalidRequest, match=match):
        call(engine.model)


def test_bad_rows_refused_by_engine(engine):
    rows = engine.model.prepare("Hello.", 0)
    for bad, match in [([r[:32] for r in rows], "rows of 33"), ([[5000] + r[1:] for r in rows], "column j"),
                       ([1, 2, 3], "rows of 33")]:
        with pytest.raises(InvalidRequest, match=match):
            engine.submit(bad)
    assert engine.pool.used_pages == 0 and not engine.waiting


def test_frontend_needs_no_weights(engine, tiny_csm, tmp_path):
    """The preprocess front end works from a copy whose model.safetensors holds only the codec (codec_model.*):
    no backbone/depth weights, no decoder; the Mimi encoder loads only for waveform context."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from voxbackend.models.csm.model import CsmFrontend
    from voxbackend.models.registry import load_frontend

    model_dir = tmp_path / "csm"
    shutil.copytree(tiny_csm, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    with safe_open(str(tiny_csm / "model.safetensors"), framework="pt") as st:
        save_file({k: st.get_tensor(k) for k in st.keys() if k.startswith("codec_model.")},
                  str(model_dir / "model.safetensors"))
    front = load_frontend(model_dir)
    assert type(front) is CsmFrontend
    assert not any(hasattr(front, a) for a in ("backbone", "depth", "codec", "audio_embed", "depth_heads"))
    assert front.spec == engine.model.spec and front.default_sampling() == engine.model.default_sampling()

    text = "The quick brown fox jumps over the lazy dog."
    assert front.prepare(text, 3) == engine.model.prepare(text, 3)
    assert front._encoder is None  # text and Mimi-code context need no encoder
    codes = np.random.default_rng(0).integers(0, 2048, (4, 32))
    coded = [ContextSegment("Before.", 1, codes)]
    assert front.prepare(text, 0, context=coded) == engine.model.prepare(text, 0, context=coded)
    assert front._encoder is None

    audio = np.random.default_rng(1).standard_normal(1920 * 3 + 700).astype(np.float32) * 0.3
    waves = [ContextSegment("I am doing well.", 2, audio=audio), {"text": "Fine.", "speaker": 0, "audio": audio[:4000],
                                                                   "sample_rate": 16000}]
    rows = front.prepare(text, 1, context=waves)
    assert front._encoder is not None
    assert rows == engine.model.prepare(text, 1, context=waves)
