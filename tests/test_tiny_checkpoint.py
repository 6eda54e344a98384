"""Tiny random checkpoints: deterministic, loadable offline, Orpheus token ids where the real ones are."""
import json
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from voxbackend.models.orpheus import tiny as tc


def test_orpheus_deterministic(tmp_path, tiny_orpheus):
    model_dir = tiny_orpheus[0]
    again = tc.write_tiny_orpheus(tmp_path / "a", seed=0)
    other = tc.write_tiny_orpheus(tmp_path / "b", seed=1)
    a, b, c = (load_file(str(d / "model.safetensors")) for d in (model_dir, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_snac_deterministic(tmp_path, tiny_orpheus):
    codec_dir = tiny_orpheus[1]
    again = tc.write_tiny_snac(tmp_path / "s", seed=0)
    a = torch.load(codec_dir / "pytorch_model.bin", weights_only=True)
    b = torch.load(again / "pytorch_model.bin", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith(".weight_g") for k in a) and any(k.endswith(".weight_v") for k in a)
    cfg = json.loads((codec_dir / "config.json").read_text())
    assert cfg == dict(tc.SNAC_24KHZ_CONFIG, decoder_dim=64)


def test_snac_package_loads_strict(tiny_orpheus):
    import snac

    codec_dir = tiny_orpheus[1]
    model = snac.SNAC.from_config(str(codec_dir / "config.json"))
    model.load_state_dict(torch.load(codec_dir / "pytorch_model.bin", weights_only=True), strict=True)


def test_transformers_loads_model(tiny_orpheus):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(tiny_orpheus[0]), local_files_only=True)
    cfg = model.config
    assert cfg.vocab_size == 156940 and cfg.hidden_size == 128 and cfg.num_hidden_layers == 4
    assert cfg.num_key_value_heads == 2 and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        logits = model(torch.tensor([[128000, 10, 20]])).logits
    assert logits.shape == (1, 3, 156940) and torch.isfinite(logits).all()
    raw = json.loads((tiny_orpheus[0] / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_theta"] == 500000.0
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["head_dim"] == 32


def test_tokenizer_ids(tiny_orpheus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_orpheus[0]), local_files_only=True)
    ids = tok("tara: Hello world.").input_ids
    assert ids[0] == 128000 and len(ids) > 2 and all(i < 128000 for i in ids[1:])
    assert tok.decode(ids[1:]) == "tara: Hello world."
    assert tok("<custom_token_4>", add_special_tokens=False).input_ids == [128260]
    assert len(tok) == 156940
    assert tok.bos_token_id == 128000 and tok.eos_token_id == 128009
    expect = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>",
              128002: "<|reserved_special_token_0|>", 128255: "<|reserved_special_token_250|>",
              128006: "<|start_header_id|>", 128256: "<custom_token_0>", 156939: "<custom_token_28683>"}
    for i, s in expect.items():
        assert tok.convert_ids_to_tokens(i) == s and tok.convert_tokens_to_ids(s) == i


def test_naive_baseline_streams(tiny_orpheus):
    sys.path.insert(0, str(tc.Path(__file__).resolve().parents[1] / "perf"))
    from naive_orpheus import NaiveOrpheus

    naive = NaiveOrpheus(*tiny_orpheus)
    chunks = list(naive.stream("Hello world.", seed=0, max_tokens=49))  # 7 frames -> windows at 28..49
    assert len(chunks) == 4 and all(c.shape == (2048,) and c.dtype.name == "float32" for c in chunks)
    audio, sr = naive.synthesize("Hello world.", seed=0, max_tokens=49)
    assert sr == 24000 and (audio == torch.from_numpy(__import__("numpy").concatenate(chunks)).numpy()).all()


def test_ensure_default_checkpoint_race_and_reuse(tmp_path):
    root = tmp_path / "cache" / "default"
    code = f"from voxbackend.models.orpheus.tiny import ensure_default_checkpoint as e; print(e({str(root)!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    model_dir, codec_dir = root / "orpheus", root / "snac_24khz"
    assert (model_dir / "model.safetensors").exists() and (codec_dir / "pytorch_model.bin").exists()
    assert [p.name for p in root.parent.iterdir()] == ["default"]  # the loser's tmp dir is gone
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    t = time.perf_counter()
    assert tc.ensure_default_checkpoint(root) == (model_dir, codec_dir)
    assert time.perf_counter() - t < 0.5 and (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
