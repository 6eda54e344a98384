"""Orpheus' candidate logits (stop token + one codebook) equal the full head at those ids, from host positions; the
stop token only at a frame's start."""
import pytest
import torch

import voxbackend
from voxbackend.models.orpheus.model import AUDIO_BASE, CODEBOOK, END_OF_SPEECH


@pytest.mark.parametrize("codes_so_far", [[0, 1, 2, 3, 4, 5, 6, 7, 15, 100], [3] * 5, [12]])
def test_candidates_are_the_full_heads_rows(tiny_orpheus, codes_so_far):
    model = voxbackend.load(*tiny_orpheus, kv_pages=8, page_size=16).model
    hidden = torch.randn(len(codes_so_far), model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        logits, ids = model.candidate_logits(hidden, codes_so_far)
        full = model.logits(hidden)
    expected = full.gather(1, ids)
    for row, codes in enumerate(codes_so_far):
        first = AUDIO_BASE + CODEBOOK * (codes % 7)
        assert ids[row].tolist() == [END_OF_SPEECH, *range(first, first + CODEBOOK)]
        if codes % 7:  # inside a frame: no stop (it would cut the frame's codes so far)
            assert logits[row, 0] == float("-inf")
            expected[row, 0] = float("-inf")
    assert torch.allclose(logits, expected, rtol=0, atol=1e-5)
