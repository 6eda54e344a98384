"""How often a step waits for the device (voxbackend/testing/host_syncs.py counts the device-to-host copies and
value-shaped ops; on CPU tensors, so CI holds the numbers a GPU run would see). An LM step of every served model
waits once: its sampled ids. A codec step waits as stated in CODEC_STEP, each with its reason."""
import collections
from pathlib import Path

import pytest

import voxbackend
from voxbackend import SamplingParams
from voxbackend.testing.host_syncs import HostSyncs
from tests.util_engine_drive import SERVED, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

# every model: the audio of all the step's windows in one copy (ints.to_host); and besides
CODEC_STEP = {
    "orpheus": 1, "csm": 1,
    "qwen3_tts": 2,  # the window's codes are range-checked before they index the codec's codebooks
    # the new mel comes to the host before HiFT: the streams' mel caches and cross-fades are host tensors
    "cosyvoice2": 2, "chatterbox": 2, "chatterbox_turbo": 2,
    "step_audio2": 1,
    # the flow's mel comes to the host (each block's overlap and the next prompt mel live there), then HiFT's audio
    "glm4_voice": 2,
}


def test_host_syncs_sees_copies_and_value_shaped_ops_and_not_device_work():
    import torch

    x = torch.arange(6)
    with HostSyncs() as syncs:
        y = (x * 2).sum()  # device work
        y.item()
        x[x > 2]  # a boolean index: its shape depends on the values
        x.nonzero()
        bool(x.any())
    assert syncs.count == 4, syncs.sites


def _line_of(comment: str) -> int:
    source = Path(voxbackend.__file__).parent / "engine" / "model_runner.py"
    return next(i for i, line in enumerate(source.read_text().splitlines(), 1) if comment in line)


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("cuda_graphs", ["off", "padded"])  # padded: the static-buffer decode path graphs replay
def test_an_lm_step_waits_for_the_device_once_and_a_codec_step_as_stated(name, cuda_graphs):
    engine = tiny_engine(name, cuda_graphs=cuda_graphs)
    for i in range(3):
        engine.submit(engine.model.prepare(f"Hello there, number {i}.", None),
                      SamplingParams(temperature=0.8, max_tokens=80, seed=i), lambda event: None)
    lm_steps, codec_steps = [], []
    run_lm, run_detok = engine._run_lm, engine._run_detok

    def counted(run, steps):
        def wrapper(plan):
            with HostSyncs() as syncs:
                run(plan)
            steps.append(syncs)
        return wrapper

    engine._run_lm, engine._run_detok = counted(run_lm, lm_steps), counted(run_detok, codec_steps)
    for _ in range(120):  # until both kinds ran (Step-Audio 2's first window waits for 28 audio ids among text)
        engine.step()
        if len(lm_steps) >= 40 and codec_steps:
            break
    assert len(lm_steps) >= 20 and codec_steps, (len(lm_steps), len(codec_steps))
    sites = collections.Counter()
    for syncs in lm_steps:
        sites.update(syncs.sites)
    assert all(s.count == 1 for s in lm_steps), sites
    assert list(sites) == [f"engine/model_runner.py:{_line_of('the one host transfer of the step')} tolist"], sites
    codec_sites = collections.Counter()
    for syncs in codec_steps:
        codec_sites.update(syncs.sites)
    assert all(s.count == CODEC_STEP[name] for s in codec_steps), ([s.count for s in codec_steps], codec_sites)
