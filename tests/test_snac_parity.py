"""Our SnacDecoder against the reference `snac` package on random-weight checkpoints."""
import pytest
import torch

from voxbackend.models.orpheus.snac import SnacDecoder

import snac  # noqa: E402


def _codes(batch: int, frames: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (batch, frames * s), generator=g) for s in (1, 2, 4)]


def _reference_rows(ref, codes, seeds) -> torch.Tensor:
    rows = []
    for b, seed in enumerate(seeds):
        torch.manual_seed(seed)  # snac draws its decoder noise from the global generator
        with torch.inference_mode():
            rows.append(ref.decode([c[b:b + 1] for c in codes]))
    return torch.cat(rows)


@pytest.fixture(scope="module")
def decoders(tiny_orpheus):
    codec_dir = tiny_orpheus[1]
    return SnacDecoder.from_pretrained(codec_dir), snac.SNAC.from_pretrained(str(codec_dir)).eval()


def test_attributes(decoders):
    ours, _ = decoders
    assert ours.sample_rate == 24000 and ours.hop_length == 512 and ours.vq_strides == [4, 2, 1]
    assert not ours.training


@pytest.mark.parametrize("frames", [1, 2, 4, 7, 16])
def test_matches_reference(decoders, frames):
    ours, ref = decoders
    codes, seeds = _codes(3, frames, frames), [0, 12345, 2**40 + 7]
    out = ours.decode(codes, seeds)
    assert out.shape == (3, 1, frames * 4 * 512) and out.dtype == torch.float32
    assert (out - _reference_rows(ref, codes, seeds)).abs().max().item() <= 1e-4


def test_batch_equals_rows_alone(decoders):
    ours, _ = decoders
    codes, seeds = _codes(5, 4, 1), [3, 1, 4, 1, 5]
    batch = ours.decode(codes, seeds)
    for b in range(5):
        alone = ours.decode([c[b:b + 1] for c in codes], [seeds[b]])
        assert (batch[b:b + 1] - alone).abs().max().item() <= 1e-5
    # equal seeds and codes -> equal rows; the global RNG is not touched
    state = torch.get_rng_state()
    twice = ours.decode([torch.cat([c[:1], c[:1]]) for c in codes], [9, 9])
    assert torch.equal(torch.get_rng_state(), state)
    assert (twice[0] - twice[1]).abs().max().item() <= 1e-5
    assert not torch.allclose(ours.decode([c[:1] for c in codes], [10]), twice[:1])


def test_loads_safetensors(tiny_orpheus, tmp_path, decoders):
    from safetensors.torch import save_file
    import shutil

    codec_dir = tiny_orpheus[1]
    shutil.copy(codec_dir / "config.json", tmp_path / "config.json")
    sd = torch.load(codec_dir / "pytorch_model.bin", weights_only=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    codes = _codes(2, 4, 2)
    a = SnacDecoder.from_pretrained(tmp_path).decode(codes, [1, 2])
    b = decoders[0].decode(codes, [1, 2])
    assert torch.equal(a, b)


def test_full_size_decoder(tmp_path):
    """The published geometry (decoder_dim 1024) on one 4-frame Orpheus window."""
    from voxbackend.models.orpheus.tiny import write_tiny_snac

    d = write_tiny_snac(tmp_path / "snac", seed=1, decoder_dim=1024)
    ours, ref = SnacDecoder.from_pretrained(d), snac.SNAC.from_pretrained(str(d)).eval()
    codes, seeds = _codes(2, 4, 4), [7, 8]
    out = ours.decode(codes, seeds)
    assert out.shape == (2, 1, 8192)
    assert (out - _reference_rows(ref, codes, seeds)).abs().max().item() <= 1e-4
