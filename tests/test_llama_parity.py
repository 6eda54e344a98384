"""The paged Llama backbone equals transformers' LlamaForCausalLM (prefill, chunked prefill, decode)."""
import torch

import voxbackend
from tests.util_llama import write_tiny_llama
from tests.util_paged import assert_paged_forward_matches


def test_paged_forward_matches_transformers(tmp_path):
    ref = write_tiny_llama(tmp_path, seed=1)
    assert_paged_forward_matches(voxbackend.load(tmp_path, kv_pages=64, page_size=4), ref, seed=0)


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.util_llama import tiny_llama_config
    from voxbackend.models.decoder import DecoderConfig, rope_inv_freq

    cfg = tiny_llama_config()
    ours = rope_inv_freq(DecoderConfig.from_hf(cfg.to_dict()))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(ours, theirs, rtol=1e-6)
