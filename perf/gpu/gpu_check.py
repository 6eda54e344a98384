"""One prepared GPU check (DESIGN section 7): parity, then timings, written to perf/results/.

Run on a CUDA machine without network, from the repository root:
    bash perf/gpu/run.sh [WHEEL_DIR]
    bash perf/gpu/run.sh --dry-run     # the same steps on CPU at tiny sizes (CI runs it: the script cannot rot)
Parity: FlashInfer paged attention vs the torch backend on random mixed prefill/decode batches; engine greedy
tokens on GPU (torch backend, float32) vs CPU; greedy tokens with the decode step's CUDA graphs vs without.
Timings: Orpheus-3B-size random weights (bf16): single-stream time to first audio; LM decode step time against
batch size, eager and replayed as a CUDA graph, next to the memory-bandwidth floor; a burst of streams with the
codec on its own stream beside the LM and without; a goodput sweep through tritonserver (p90 TTFA <= 250 ms,
>= 99% stall-free) where a tritonserver is installed, colocated and with the codec as its own model (on a second
GPU when there is one).
The dry run checks FlashInfer's plan (attention/paged_plan.py) instead of calling its kernel, compares CPU with
CPU, runs the padded decode path eagerly where a GPU captures it, and times tiny models: its numbers mean
nothing, its running does.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import voxbackend
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.paged_plan import paged_plan
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.codec_stream import CodecStream
from voxbackend.engine.decode_graphs import DecodeGraphs
from voxbackend.engine.engine import Engine
from voxbackend.events import EventKind
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
        if not device.startswith("cuda"):  # the dry run: FlashInfer's plan slots against each row's page and offset
            slots = [s.pages[i // ps] * ps + i % ps for s in seqs
                     for i in range(s.context_len, s.context_len + s.q_len)]
            same = paged_plan(seqs, ps).slot_mapping.tolist() == slots
            ok &= same
            status = "PASS" if same else "FAIL"
            lines.append(f"| FlashInfer plan slots == page and offset ({case}, dry run) | {same} | {status} |")
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


def graphs_parity(lines: list[str], device: str = "cuda") -> bool:
    """Greedy tokens of the tiny Orpheus and CSM (its depth decoder's columns graphed too) with the decode step
    replayed as CUDA graphs (the dry run: the same padded path, eager) equal those without; prompts of different
    lengths, so batches of 3 pad to the 4-row bucket."""
    from voxbackend.models.registry import KINDS
    from voxbackend.triton.loading import import_object

    mode = "graphs" if device.startswith("cuda") and _has_flashinfer() else "padded"  # capture needs FlashInfer
    sp = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ok = True
    for name in ("orpheus", "csm"):
        model_dir, codec_dir = import_object(KINDS[name].tiny_checkpoint)()
        ids, failed = {}, []
        for m in (mode, "off"):
            engine = voxbackend.load(model_dir, codec_dir, model=name, device=device, cuda_graphs=m, kv_pages=64)
            prompts = [engine.model.prepare(text, None) for text in (
                "Hi.", "A longer second prompt, with more words.", "And a third one, longer than the first.")]
            ids[m] = engine.generate_ids(prompts, sp)
            replayers = [engine.runner.graphs and engine.runner.graphs.replayer,
                         engine.model.depth_columns and engine.model.depth_columns.replayer]
            failed += [r.name for r in replayers if r is not None and r.failed]  # fell back to eager
        same = ids[mode] == ids["off"] and not failed
        ok &= same
        lines.append(f"| {name} greedy, cuda_graphs={mode} == off | "
                     f"{sum(a == b for a, b in zip(ids[mode], ids['off']))}/3 prompts"
                     f"{'; capture failed: ' + ', '.join(failed) if failed else ''} | {'PASS' if same else 'FAIL'} |")
    return ok


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


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
    overlap(lines, engine, device, *((16, 280) if device.startswith("cuda") else (4, 84)))
    engine.shutdown()
    floor_bw = next((bw for name, bw in HBM_BYTES_PER_S.items() if name in gpu_name), None)
    graph_kind = "CUDA graph" if device.startswith("cuda") else "padded, eager (dry run)"
    lines.append(f"\n| decode batch | eager step ms | {graph_kind} step ms | weight-read floor ms | tokens/s (graph) |"
                 "\n|---|---|---|---|---|")
    m, attn = engine.model, engine.attention
    graphs = DecodeGraphs(m, attn, engine.pool.scratch_page, 128, device, capture=device.startswith("cuda"))
    for batch in (1, 8, 32, 64, 128):
        seqs = [SeqSlice(i, 1, 255, list(range(i * 17, i * 17 + 17))) for i in range(batch)]
        ids = torch.randint(AUDIO_BASE, 156000, (batch,), device=device)
        pos = torch.full((batch,), 255, device=device)
        host_ids, host_pos = ids.tolist(), pos.tolist()

        def eager():
            attn.plan(seqs)
            return m.forward(ids, pos, attn)

        step, graph_step = (_time_step(lambda: m.candidate_logits(run(), [0] * batch), device)
                            for run in (eager, lambda: graphs.forward(host_ids, host_pos, seqs)))
        floor = f"{params * 2 / floor_bw * 1000:.2f}" if floor_bw else "n/a"
        lines.append(f"| {batch} | {step * 1000:.2f} | {graph_step * 1000:.2f} | {floor} | {batch / graph_step:.0f} |")
    if graphs.replayer is not None and graphs.replayer.failed:
        lines.append("\nThe decode step's capture failed (the log says why): its column above ran eagerly.")


def _time_step(run, device: str) -> float:
    with torch.inference_mode():
        for _ in range(3):  # warm-up (and, for graphs, capture)
            run()
        sync(device)
        t0, n = time.perf_counter(), 20 if device.startswith("cuda") else 2
        for _ in range(n):
            run()
        sync(device)
    return (time.perf_counter() - t0) / n


def overlap(lines: list[str], engine: Engine, device: str, streams: int, tokens: int) -> None:
    """A burst of streams with the codec on its own stream beside the LM step, and without (the same running
    engine, idle between the bursts)."""
    lines.append(f"\n| codec beside the LM ({streams} streams at once, {tokens} tokens each) | wall s | x real time | "
                 "TTFA p50 ms |\n|---|---|---|---|")
    for on in (True, False):
        engine.codec_stream = CodecStream(device) if on else None  # what overlap_codec on / off builds
        wall, audio_s, ttfas = _burst(engine, streams, tokens)
        lines.append(f"| {'on' if on else 'off'} | {wall:.2f} | {audio_s / wall:.1f} | "
                     f"{sorted(ttfas)[len(ttfas) // 2] * 1000:.0f} |")


def _burst(engine: Engine, n: int, tokens: int) -> tuple[float, float, list[float]]:
    """n streams submitted at once; (wall s, audio s, time to first audio of each)."""
    rate = engine.model.spec.sample_rate
    first: dict[str, float] = {}
    samples, done, lock, finished = [0], set(), threading.Lock(), threading.Event()
    t0 = time.perf_counter()

    def on_event(e):
        with lock:
            if e.kind is EventKind.AUDIO and e.audio is not None and len(e.audio):
                first.setdefault(e.request_id, time.perf_counter() - t0)
                samples[0] += len(e.audio)
            if e.final:
                done.add(e.request_id)
                if len(done) == n:
                    finished.set()

    sp = SamplingParams(temperature=0.6, top_p=0.8, max_tokens=tokens, min_tokens=tokens, seed=3)
    for i in range(n):
        engine.submit(engine.model.prepare(f"Stream number {i} says hello.", "tara"), sp, on_event)
    finished.wait(600)
    return time.perf_counter() - t0, samples[0] / rate, list(first.values())


def stage_settings(device: str) -> list[str]:
    """The disaggregated configuration: the codec as its own model (one instance). With two GPUs the engine runs on
    the first and the codec stage on the second (device=auto: each instance on the GPU Triton places it on); with
    one, the stage is its own process beside the engine on the same GPU."""
    settings = ["--set", "codec_instances=1"]
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        settings += ["--set", "device=auto", "--set", "gpus=0", "--set", "codec_gpus=1"]
    return settings


def goodput_sweep(lines: list[str], root: Path, device: str, sizes: dict, rates: list[float], duration: float,
                  sides: tuple[str, ...] = ("colocated", "codec stage")) -> None:
    """Open-loop Poisson rates through tritonserver (voxbackend serve, the orpheus model at these sizes, random
    weights written as a checkpoint: about 13 GB in float32 at the 3B size, served in bfloat16), colocated (each
    engine decodes its own windows) and with the codec as its own model (stage_settings); goodput = the highest rate
    with p90 TTFA <= 250 ms and >= 99% of streams stall-free. A machine without tritonserver (the nvidia-pytriton
    wheel or /opt/tritonserver) skips it, saying so."""
    root_dir = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root_dir))
    try:
        from voxbackend.deploy.server import find_tritonserver

        find_tritonserver()
        from clients.loadgen import load_prompts  # tritonclient
    except Exception as e:  # noqa: BLE001 - the machine has no server or client: say so, the other steps stand
        lines.append(f"\ngoodput sweep through tritonserver: not run ({type(e).__name__}: {e})")
        return

    ckpt = write_tiny_orpheus(root / "served-orpheus", **{k: v for k, v in sizes.items() if k != "head_dim"})
    codec = write_tiny_snac(root / "served-snac", decoder_dim=1024 if device.startswith("cuda") else 64)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    prompts = load_prompts(str(root_dir / "perf/data/prompts.txt"))
    for side, settings in (("colocated", []), ("codec stage", stage_settings(device))):
        if side not in sides:
            continue
        serve = ["serve", "--models", "orpheus", "--checkpoint", str(ckpt), "--codec", str(codec), "--set",
                 f"device={device}", "--set", f"dtype={dtype}", *settings]
        label = f"{side}: `{' '.join(settings)}`" if settings else side
        if not _served_sweep(lines, label, serve, prompts, rates, duration, dtype):
            return


def _served_sweep(lines: list[str], side: str, serve: list[str], prompts: list[str], rates: list[float],
                  duration: float, dtype: str) -> bool:
    """One configuration's sweep (`voxbackend serve` arguments); False when it failed."""
    from clients.loadgen import RequestOptions
    from clients.stream_metrics import goodput, markdown_table
    from perf.goodput import Target, sweep
    from voxbackend import cli
    from voxbackend.deploy.server import free_port

    ports = [str(free_port()) for _ in range(3)]
    server = cli.make_server(cli.parser().parse_args(
        [*serve, "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]))
    try:
        server.start(timeout=600)
        results, _ = sweep([Target("orpheus", server.grpc_url, "orpheus")], rates, prompts, duration, seed=0,
                           burstiness=1.0, opts=RequestOptions(max_tokens=280, sampling_seed=0), ttfa_p90=0.25,
                           stall_free=0.99, stop_after_failures=2, request_timeout=120.0, log=lambda *a: None)
    except Exception as e:  # noqa: BLE001 - the last step: keep what the others measured
        lines.append(f"\ngoodput sweep through tritonserver ({side}): failed ({type(e).__name__}: {str(e)[-1500:]})")
        return False
    finally:
        server.close()
    best = goodput(results["orpheus"], 0.25, 0.99)
    lines += ["", f"goodput through tritonserver (orpheus, {side}, {dtype}, p90 TTFA <= "
              f"250 ms, >= 99% stall-free, Poisson, {duration:.0f} s per rate): "
              f"{best if best is not None else 'none of the rates'} req/s", "", markdown_table(results["orpheus"])]
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on CPU at tiny sizes (no GPU needed)")
    args = ap.parse_args()
    device, sizes = ("cpu", DRY_RUN) if args.dry_run else ("cuda", ORPHEUS_3B)
    gpu = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    lines = [f"# GPU check {datetime.date.today()} on {gpu}", "", f"torch {torch.__version__}", "",
             "| check | result | status |", "|---|---|---|"]
    out = Path(args.out) / f"{datetime.date.today()}-gpu-check{'-dry-run' if args.dry_run else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def step(name: str, run):
        """One step, then the report so far on disk: a run cut off by a time limit keeps what it measured."""
        result = run()
        out.write_text("\n".join(lines) + f"\n\n({name} done at {time.monotonic() - t0:.0f} s)\n")
        return result

    with tempfile.TemporaryDirectory() as tmp:
        ok = step("attention parity", lambda: attention_parity(lines, device))
        ok &= step("greedy parity", lambda: greedy_parity(lines, Path(tmp), device))
        ok &= step("graphs parity", lambda: graphs_parity(lines, device))
        step("timings", lambda: timings(lines, Path(tmp), gpu, device, sizes))
        rates, duration = ([0.5], 4.0) if args.dry_run else ([2, 4, 8, 16], 15.0)
        # the dry run sweeps the codec stage only: the colocated sweep is the same call without its settings
        sides = ("codec stage",) if args.dry_run else ("colocated", "codec stage")
        step("goodput sweep", lambda: goodput_sweep(lines, Path(tmp), device, sizes, rates, duration, sides))
    lines.append(f"\nAll steps: {time.monotonic() - t0:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    out.write_text(text)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
