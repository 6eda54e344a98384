"""One prepared GPU check (DESIGN section 7): parity, then timings, written to perf/results/.

Run on a CUDA machine without network, from the repository root:
    bash perf/gpu/run.sh [WHEEL_DIR]
    bash perf/gpu/run.sh --dry-run     # the same steps on CPU at tiny sizes (CI runs it: the script cannot rot)
Parity: FlashInfer paged attention vs the torch backend on random mixed prefill/decode batches; engine greedy
tokens on GPU (torch backend, float32) vs CPU. Timings: Orpheus-3B-size random weights (bf16): single-stream
time to first audio, and LM decode step time against batch size next to the memory-bandwidth floor.
The dry run checks FlashInfer's plan (attention/paged_plan.py) instead of calling its kernel, compares CPU with
CPU, and times a tiny backbone: its numbers mean nothing, its running does.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import tempfile
import time
from pathlib import Path

import torch

import voxbackend
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.paged_plan import paged_plan
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.engine import Engine
from voxbackend.models.base import LMGeometry
from voxbackend.models.decoder import Decoder, rope_inv_freq
from voxbackend.models.orpheus.model import AUDIO_BASE, END_OF_SPEECH
from voxbackend.sampling_params import SamplingParams
from voxbackend.models.orpheus.tiny import write_tiny_orpheus, write_tiny_snac

ORPHEUS_3B = dict(hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128)
DRY_RUN = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def attention_parity(lines: list[str], device: str = "cuda") -> bool:
    g = LMGeometry(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=128, vocab_size=1, max_context=4096)
    ps, pages = 16, 256
    cache = torch.randn(1, 2, pages + 1, ps, g.num_kv_heads, g.head_dim, device=device, dtype=torch.bfloat16)
    ok = True
    for case, shape in {"mixed": [(0, 37), (50, 1), (200, 1), (16, 48)], "decode": [(5, 1), (100, 1), (31, 1)]}.items():
        seqs, start, page = [], 0, 0
        for context, q_len in shape:
            n_pages = (context + q_len + ps - 1) // ps
            seqs.append(SeqSlice(start, q_len, context, list(range(page, page + n_pages))))
            start, page = start + q_len, page + n_pages
        if not device.startswith("cuda"):  # the dry run: FlashInfer's plan against the torch backend's slots
            torch_backend = TorchPagedAttention(cache, ps, pages, 128**-0.5)
            torch_backend.plan(seqs)
            same = bool((torch.from_numpy(paged_plan(seqs, ps).slot_mapping) == torch_backend.slot_mapping).all())
            ok &= same
            status = "PASS" if same else "FAIL"
            lines.append(f"| FlashInfer plan slots == torch ({case}, dry run) | {same} | {status} |")
            continue
        from voxbackend.attention.flashinfer_backend import FlashInferPagedAttention

        q = torch.randn(start, g.num_heads, g.head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(start, g.num_kv_heads, g.head_dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        outs = []
        for backend in (TorchPagedAttention(cache.clone(), ps, pages, 128**-0.5),
                        FlashInferPagedAttention(cache.clone(), ps, pages, 128**-0.5, g)):
            backend.plan(seqs)
            outs.append(backend.attend(0, q, k, v).float())
        err = (outs[0] - outs[1]).abs().max().item()
        ok &= err < 2e-2
        lines.append(f"| attention parity ({case}) | max abs err {err:.2e} | {'PASS' if err < 2e-2 else 'FAIL'} |")
    return ok


def greedy_parity(lines: list[str], root: Path, device: str = "cuda") -> bool:
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(root / "llama", safe_serialization=True)
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 17]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    cpu = voxbackend.load(root / "llama", kv_pages=64).generate_ids(prompts, sp)
    gpu = voxbackend.load(root / "llama", device=device, attention="torch", kv_pages=64).generate_ids(prompts, sp)
    ok = cpu == gpu
    lines.append(f"| engine greedy {device} (torch, fp32) == CPU | {sum(a == b for a, b in zip(cpu, gpu))}/3 prompts | "
                 f"{'PASS' if ok else 'FAIL'} |")
    return ok


def orpheus_3b(root: Path, attention: str, device: str = "cuda", sizes: dict = ORPHEUS_3B):
    """An Orpheus engine whose backbone is replaced by random Orpheus-3B-size weights (bf16, on the GPU)."""
    model_dir = write_tiny_orpheus(root / "orpheus")
    codec_dir = write_tiny_snac(root / "snac_24khz", decoder_dim=1024)
    engine = voxbackend.load(model_dir, codec_dir, device=device, dtype="bfloat16", attention=attention,
                             kv_pages=8192, max_batch=128, prefill_budget=4096, detok_batch=32)
    m = engine.model
    cfg = dataclasses.replace(m.cfg, **sizes)
    with torch.device(device):
        backbone = Decoder(cfg).to(torch.bfloat16)
    for p in backbone.parameters():
        torch.nn.init.normal_(p, std=0.02)
    backbone.lm_head.weight = backbone.embed.weight
    backbone.inv_freq = rope_inv_freq(cfg).to(device)
    m.backbone, m.cfg = backbone.eval(), cfg
    m._stop_head = backbone.lm_head.weight[END_OF_SPEECH]
    m._code_heads = backbone.lm_head.weight[AUDIO_BASE : AUDIO_BASE + 7 * 4096].view(7, 4096, -1)
    geometry = dataclasses.replace(m.spec.geometry, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    m.spec = dataclasses.replace(m.spec, geometry=geometry)
    return Engine(m, engine.config)  # a fresh KV pool sized for the 3B geometry


def timings(lines: list[str], root: Path, gpu_name: str, device: str = "cuda", sizes: dict = ORPHEUS_3B) -> None:
    engine = orpheus_3b(root, "auto", device, sizes)
    params = sum(p.numel() for p in engine.model.backbone.parameters())
    lines.append(f"\nOrpheus backbone, random weights: {params / 1e9:.2f} B parameters, bf16, "
                 f"attention backend {type(engine.attention).__name__}\n")
    engine.start()
    sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=80, seed=1)
    for _ in range(2):  # warm-up, then measure
        t0 = time.perf_counter()
        first = next(iter(engine.stream("Hey there, how are you doing today?", "tara", sp)))
        ttfa = time.perf_counter() - t0
    lines.append(f"| single-stream time to first audio | {ttfa * 1000:.1f} ms ({len(first)} samples) |")
    engine.shutdown()
    floor_bw = next((bw for name, bw in HBM_BYTES_PER_S.items() if name in gpu_name), None)
    lines.append("\n| decode batch | step ms | weight-read floor ms | tokens/s |\n|---|---|---|---|")
    m, attn = engine.model, engine.attention
    for batch in (1, 8, 32, 64, 128):
        seqs = [SeqSlice(i, 1, 255, list(range(i * 17, i * 17 + 17))) for i in range(batch)]
        ids = torch.randint(AUDIO_BASE, 156000, (batch,), device=device)
        pos = torch.full((batch,), 255, device=device)
        with torch.inference_mode():
            for _ in range(3):
                attn.plan(seqs)
                m.candidate_logits(m.forward(ids, pos, attn), [0] * batch)
            sync(device)
            t0, n = time.perf_counter(), 20 if device.startswith("cuda") else 2
            for _ in range(n):
                attn.plan(seqs)
                m.candidate_logits(m.forward(ids, pos, attn), [0] * batch)
            sync(device)
        step = (time.perf_counter() - t0) / n
        floor = f"{params * 2 / floor_bw * 1000:.2f}" if floor_bw else "n/a"
        lines.append(f"| {batch} | {step * 1000:.2f} | {floor} | {batch / step:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on CPU at tiny sizes (no GPU needed)")
    args = ap.parse_args()
    device, sizes = ("cpu", DRY_RUN) if args.dry_run else ("cuda", ORPHEUS_3B)
    gpu = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    lines = [f"# GPU check {datetime.date.today()} on {gpu}", "", f"torch {torch.__version__}", "",
             "| check | result | status |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        ok = attention_parity(lines, device) & greedy_parity(lines, Path(tmp), device)
        timings(lines, Path(tmp), gpu, device, sizes)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out) / f"{datetime.date.today()}-gpu-check{'-dry-run' if args.dry_run else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
