"""The codec as a stage of its own (voxbackend/codec_stage, engine/remote_codec.py), without Triton: engines that
send their windows over the stage's socket give the audio of an engine that decodes its own, whichever engine
shares the stage; the stage decodes the most urgent windows first; a request that ends while its windows are out
leaves nothing behind; a failing stage fails only the requests whose windows it had; the wire refuses what is
not ours."""
from __future__ import annotations

import dataclasses
import io
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tests.util_engine_drive import SERVED, tiny_engine
from voxbackend.models.registry import KINDS, load_model
from voxbackend.triton.loading import import_object
from voxbackend.codec_stage.local_socket import CodecServer, CodecStageError, SocketCodecClient
from voxbackend.codec_stage.urgent_queue import UrgentWindows
from voxbackend.codec_stage.wire import _decode, _placement, pack, unpack
from voxbackend.events import EventKind
from voxbackend.models.base import WindowJob
from voxbackend.sampling_params import SamplingParams

TEXTS = ["hello there world", "a second voice speaks now"]  # one on each engine
PARITY = [("cosyvoice2", 50)]  # Orpheus through the stage: tests/test_triton_codec_stage.py


# flow caches and a generator, windows the state schedules (the other models' windows go over the wire in the next
# test, and Orpheus' through a real tritonserver in tests/test_triton_codec_stage.py)
@pytest.mark.parametrize("name,max_tokens", PARITY)
def test_two_engines_sharing_a_two_instance_stage_play_the_colocated_audio(name, max_tokens, tmp_path):
    colocated = tiny_engine(name).start()
    voice = colocated.model.voices[0] if colocated.model.voices else None
    sampling = [SamplingParams(seed=3 + i, max_tokens=max_tokens) for i in range(len(TEXTS))]
    want = [colocated.synthesize(text, voice, s)[0] for text, s in zip(TEXTS, sampling)]
    colocated.shutdown()

    # two stage instances, each with its own model (the second as the Triton stage loads it, without the LM): a
    # request's windows go to either, its state with them
    stages = [UrgentWindows(model, max_windows=16).start() for model in (colocated.model, codec_only(name))]
    servers = [CodecServer(tmp_path / "stage" / f"{k}.sock", stage).start() for k, stage in enumerate(stages)]
    engines = [tiny_engine(name) for _ in range(2)]
    clients = [SocketCodecClient(tmp_path / "stage") for _ in engines]
    for engine, client in zip(engines, clients):
        engine.use_codec_stage(client)
        engine.start()
    got: list = [None] * len(TEXTS)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, engines[i % 2].synthesize(TEXTS[i], voice, sampling[i])[0])) for i in range(len(TEXTS))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for engine, client in zip(engines, clients):
            engine.shutdown()
            client.close()
        left = [server.wait_for_engines(5.0) for server in servers]  # the engines' links closed with them
        for server, stage in zip(servers, stages):
            server.close()
            stage.stop()
    for i, audio in enumerate(got):
        assert audio is not None, f"stream {i} failed (its exception is above)"
        assert audio.shape == want[i].shape, (i, audio.shape, want[i].shape)
        np.testing.assert_allclose(audio, want[i], atol=2e-4, err_msg=f"{name} stream {i}")
    assert all(stage.stats.windows > 0 for stage in stages)
    assert all(left)
    for engine in engines:
        assert engine.pool.used_pages == 0 and not engine.running and not engine.remote_codec.out


def codec_only(name: str):
    model_dir, codec_dir = import_object(KINDS[name].tiny_checkpoint)()
    return load_model(model_dir, codec_dir, "cpu", torch.float32, kind=name, lm=False)


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable through obj's attributes (modules, lists, dicts, plain objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type)) or obj is None:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(t, seen) for t in [*obj.parameters(), *obj.buffers()]) + tensor_bytes(vars(obj), seen)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return tensor_bytes(vars(obj), seen) if hasattr(obj, "__dict__") else 0


def test_a_model_whose_codec_state_holds_its_decoder_gets_no_codec_stage():
    """Step-Audio 2's per-request state is its streaming flow (modules and caches): refused where it is configured."""
    from voxbackend.deploy import configs

    assert [n for n in SERVED if not KINDS[n].model.codec_stage] == ["step_audio2", "glm4_voice"]
    with pytest.raises(ValueError, match="step_audio2 cannot have a codec stage"):
        configs.render_all({"codec_instances": "1"}, ["step_audio2"])


@pytest.mark.parametrize("name", [n for n in SERVED if KINDS[n].model.codec_stage])  # the others: test above
def test_the_stage_loads_the_codec_without_the_lm_and_decodes_the_same_windows(name):
    """What `<model>_codec` loads (load_model(lm=False)) holds no LM weights and decodes a stream's windows, as
    they went over the wire, into the full model's audio (the models of the test above decode there)."""
    engine = tiny_engine(name)
    stage = codec_only(name)
    full, codec, held = tensor_bytes(engine.model), tensor_bytes(stage.codec), tensor_bytes(stage)
    assert held - codec < 2**20 and full - held > 2**19, (full, codec, held)  # the codec (and small tables) only
    assert stage.spec == engine.model.spec
    if name in dict(PARITY):
        return
    sent: list = []
    decode = engine.model.detokenize

    def recording(jobs):
        sent.append(pack(jobs))  # as the stage would get them, before this decode moves their states on
        return decode(jobs)

    engine.model.detokenize = recording
    voice = engine.model.voices[0] if engine.model.voices else None
    audio = engine.start().synthesize("hello there world", voice, SamplingParams(seed=5, max_tokens=40))[0]
    engine.shutdown()
    assert sent
    replayed = np.concatenate([a for data in sent for a in stage.detokenize(unpack(data))])
    np.testing.assert_allclose(replayed, audio, atol=1e-5)


class CountingModel:
    """detokenize records each batch's window ids; audio is the window's index."""

    def __init__(self):
        self.batches: list[list[str]] = []

    def detokenize(self, jobs):
        self.batches.append([j.request_id for j in jobs])
        return [np.full(4, j.index, np.float32) for j in jobs]


def job(rid: str, k: int = 0) -> WindowJob:
    return WindowJob(rid, k, np.zeros((4, 7), np.int64), k, False, None)


def test_the_stage_takes_the_most_urgent_windows_first_within_its_batch_size():
    model = CountingModel()
    stage = UrgentWindows(model, max_windows=4)
    replies = []
    reply = lambda audio, state, error: replies.append((audio, error))  # noqa: E731
    for i in range(3):  # bulk: listeners with 5-9 s of audio queued, from engine 1
        stage.put([job(f"bulk{i}", k) for k in range(2)], 5.0 + 2 * i, reply, source=1)
    stage.put([job("first")], -0.2, reply, source=2)  # a stream waiting for its first audio, from engine 2
    stage.put([job("huge", k) for k in range(6)], -1.0, reply, source=1)  # most urgent, over max_windows alone
    stage.decode(stage.take())
    stage.decode(stage.take())
    stage.decode(stage.take())
    assert model.batches == [["huge"] * 6, ["first", "bulk0", "bulk0"], ["bulk1", "bulk1", "bulk2", "bulk2"]]
    assert stage.stats.mixed_batches == 1 and stage.stats.windows == 13 and stage.stats.queued == 0
    assert [len(a) for a, e in replies] == [6, 1, 2, 2, 2] and all(e is None for _, e in replies)


class HeldClient:
    """A codec client whose replies the test releases (decodes with the request's own model when released)."""

    def __init__(self, model):
        self.model = model
        self.groups: list[tuple[list, Future]] = []

    def decode(self, jobs, slack_s):
        future: Future = Future()
        self.groups.append((jobs, future))
        return future

    def release(self, error: str | None = None):
        groups, self.groups = self.groups, []
        for jobs, future in groups:
            if error:
                future.set_exception(CodecStageError(error))
            else:
                future.set_result((self.model.detokenize(jobs), jobs[-1].state))

    def close(self):
        pass


def test_a_request_cancelled_while_its_windows_are_out_drops_the_reply_and_frees_everything():
    engine = tiny_engine("cosyvoice2")
    client = HeldClient(engine.model)
    engine.use_codec_stage(client)
    events = []
    voice = engine.model.voices[0]
    rid = engine.submit(engine.model.prepare("hello there world", voice), SamplingParams(seed=1, max_tokens=60),
                        events.append)
    while not client.groups:
        engine.step()
    request = engine.running[0]
    assert request.codec.in_flight and engine.detokenizer.ready(request) == 0
    engine.cancel(rid)
    engine.step()
    assert [e.finish_reason for e in events if e.final] == ["cancelled"]
    client.release()
    engine.step()
    assert not engine.remote_codec.out and not engine.running and engine.pool.used_pages == 0
    assert sum(e.final for e in events) == 1


def test_a_failed_codec_group_ends_only_its_own_request(tmp_path):
    engine = tiny_engine("orpheus")
    client = HeldClient(engine.model)
    engine.use_codec_stage(client)
    finals: dict[str, object] = {}
    on_event = lambda e: finals.__setitem__(e.request_id, e) if e.final else None  # noqa: E731
    a = engine.submit(engine.model.prepare("first one here", "tara"), SamplingParams(seed=1, max_tokens=42), on_event)
    while not client.groups:
        engine.step()
    client.release(error="codec stage failed: out of memory")  # only a's first window was out
    b = engine.submit(engine.model.prepare("second one", "leo"), SamplingParams(seed=2, max_tokens=42), on_event)
    for _ in range(500):
        engine.step()
        client.release()
        if b in finals:
            break
    assert finals[a].kind is EventKind.ERROR and "out of memory" in finals[a].error
    assert finals[b].kind is EventKind.FINISHED and finals[b].error is None
    assert engine.pool.used_pages == 0 and not engine.running


def test_a_stage_that_goes_away_fails_the_windows_it_had_and_an_absent_one_is_named(tmp_path):
    release = threading.Event()

    class SlowModel(CountingModel):
        def detokenize(self, jobs):
            release.wait(10)
            return super().detokenize(jobs)

    stage = UrgentWindows(SlowModel(), max_windows=4).start()
    server = CodecServer(tmp_path / "stage" / "0.sock", stage).start()
    client = SocketCodecClient(tmp_path / "stage")
    pending = client.decode([job("a")], 0.0)
    server.close()  # its links drop while the window is being decoded
    with pytest.raises(CodecStageError, match="0.sock closed the connection"):
        pending.result(timeout=10)
    release.set()
    stage.stop()
    client.RESCAN_S = 0.0
    with pytest.raises(CodecStageError, match="no codec stage instance is listening under"):
        client.decode([job("b")], 0.0).result(timeout=1)
    client.close()


def test_the_wire_carries_codec_states_and_refuses_what_is_not_ours():
    generator = torch.Generator().manual_seed(7)
    state = {"jobs": [job("r", 2)], "gen": generator, "t": (1, torch.arange(3)), "a": np.arange(4, dtype=np.int16)}
    back = unpack(pack(state))
    assert isinstance(back["jobs"][0], WindowJob) and back["jobs"][0].index == 2
    np.testing.assert_array_equal(back["jobs"][0].codes, np.zeros((4, 7)))
    assert torch.equal(back["gen"].get_state(), generator.get_state()) and back["a"].dtype == np.int16
    assert back["t"][0] == 1 and torch.equal(back["t"][1], torch.arange(3))
    # a CPU generator stays on the CPU when the rest goes to a GPU (the flow vocoders draw their noise there)
    tagged = torch.load(io.BytesIO(pack(generator)), weights_only=True)
    moved = _decode(tagged, "cuda:1")
    assert moved.device.type == "cpu" and torch.equal(moved.get_state(), generator.get_state())
    storage = torch.UntypedStorage(4)  # and so does every tensor that was on the CPU (no GPU here for the rest)
    assert _placement("cuda:1")(storage, "cpu") is storage and _placement("cpu") == "cpu"

    @dataclasses.dataclass
    class Foreign:
        x: int = 1

    with pytest.raises(TypeError, match="does not go over the codec wire"):
        pack(object())
    with pytest.raises(ValueError, match="not a voxbackend dataclass"):
        unpack(_tagged(f"{Foreign.__module__}:Foreign"))
    with pytest.raises(ValueError, match="not a voxbackend dataclass"):
        unpack(_tagged("voxbackend.codec_stage.wire:pack"))  # ours, but not a dataclass

    class Evil:  # a pickle that would run code when loaded
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    with pytest.raises(Exception, match="Weights only load failed"):
        unpack(buf.getvalue())


def _tagged(name: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"__voxbackend__": "dataclass", "type": name, "fields": {}}, buf)
    return buf.getvalue()
