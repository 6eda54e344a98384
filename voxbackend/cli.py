"""The `voxbackend` command.

    voxbackend serve                       # tritonserver on the model repository (tiny default checkpoint)
    voxbackend serve --models orpheus --checkpoint /ckpt/orpheus-3b --codec /ckpt/snac_24khz --set max_batch=64
    voxbackend serve --models csm --checkpoint /ckpt/csm-1b     # Mimi weights inside; or --codec /ckpt/mimi
    voxbackend serve --api-port 9000                 # plus the OpenAI-compatible speech API and player on :9000
    voxbackend api --triton-url host:8001 --port 9000   # the speech API alone, in front of a running server
    voxbackend demo --text "Hello." --out hello.wav   # serve, stream one sentence to a WAV, stop
    voxbackend make-checkpoint [--root DIR]            # build (or find) the tiny default checkpoint
    voxbackend configs [--check]                       # regenerate / verify model_repository/*/config.pbtxt
    voxbackend perf-analyzer -m orpheus --streaming ...  # tritonclient's perf_analyzer with its libraries found
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from voxbackend.deploy import configs
from voxbackend.triton.loading import import_object
from voxbackend.deploy.server import TritonServer

_PARAM = re.compile(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}')


def default_repository() -> Path:
    local = Path.cwd() / "model_repository"
    return local if any(local.glob("*/config.pbtxt")) else configs.DEFAULT_REPOSITORY


def ensure_default_checkpoints(repository: Path) -> None:
    """Build the default checkpoint up front for every engine that has none configured (not inside a stub)."""
    makers = set()
    for config in Path(repository).glob("*/config.pbtxt"):
        params = dict(_PARAM.findall(config.read_text()))
        if "default_checkpoint" in params and not params.get("checkpoint"):
            makers.add(params["default_checkpoint"])
    for spec in sorted(makers):
        model_dir, codec_dir = import_object(spec)()
        print(f"default checkpoint: {model_dir} (codec {codec_dir})", flush=True)


def repository_for(args: argparse.Namespace, work_dir: Path) -> Path:
    """The repository as given, or a copy rendered into work_dir when engine parameters are overridden or models
    chosen."""
    overrides = dict(kv.split("=", 1) for kv in args.set)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    if args.checkpoint:
        overrides["checkpoint"] = str(Path(args.checkpoint).resolve())
    if args.codec:
        overrides["codec"] = str(Path(args.codec).resolve())
    if not overrides and not models:
        return Path(args.model_repository)
    dest = work_dir / "model_repository"
    try:
        configs.write_repository(dest, overrides, source=Path(args.model_repository), models=models)
    except ValueError as e:  # e.g. --checkpoint without saying which model it is
        raise SystemExit(f"voxbackend: {e} (--models NAME serves only that model)") from None
    print(f"rendered {dest} ({', '.join(models) if models else 'every model'}) with {overrides}", flush=True)
    return dest


def progress_printer() -> Callable[[str], None] | None:
    """print, where progress lines are wanted: stdout is a terminal, or VOXBACKEND_PROGRESS=1 (0: never). Nowhere
    else: scripts and tests parse what serve and demo print."""
    wanted = os.environ.get("VOXBACKEND_PROGRESS", "")
    if wanted == "1" or (not wanted and sys.stdout.isatty()):
        return lambda line: print(line, flush=True)
    return None


def make_server(args: argparse.Namespace) -> TritonServer:
    """The server for serve and demo; without --work-dir its rendered repository, backend folder and log live in
    a temporary folder that close() removes."""
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="voxbackend-"))
    repository = repository_for(args, work_dir)
    ensure_default_checkpoints(repository)
    return TritonServer(repository, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                        metrics_port=args.metrics_port, log_verbose=args.log_verbose,
                        log_file=Path(args.log_file) if args.log_file else None,
                        work_dir=work_dir, remove_work_dir=not args.work_dir, progress=progress_printer())


def cmd_serve(args: argparse.Namespace) -> int:
    server = make_server(args)
    stop = threading.Event()
    drain = []  # SIGTERM (docker stop, Kubernetes): let open streams finish; Ctrl-C: end them now
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: (drain.append(True), stop.set()))
    server.start(timeout=args.timeout)
    api = start_api(args, server)
    print(f"ready: grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}\n"
          f"log: {server.log_file}  (Ctrl-C stops; SIGTERM drains)", flush=True)
    try:
        while not stop.wait(1.0):
            if server.proc.poll() is not None:
                print(f"tritonserver exited with {server.proc.returncode}:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        if api is not None:
            api.stop()
        if drain:
            print("SIGTERM: draining (open streams may finish within drain_grace_s)", flush=True)
        code = server.close(drain=bool(drain))
    print(f"stopped (exit {code})", flush=True)
    sys.stderr.flush()
    # Nothing is left to release: skip the interpreter's teardown of torch (imported through the model
    # registry), which took 2-3 s on a loaded 2-core machine, after the server had already stopped.
    os._exit(0 if code == 0 else 1)


def start_api(args: argparse.Namespace, server: TritonServer):
    """The speech API (voxbackend.api) on --api-port, next to the running server; None without --api-port."""
    if getattr(args, "api_port", None) is None:
        return None
    from voxbackend.api.server import ApiServer

    try:
        api = ApiServer(server.grpc_url, server.metrics_url, host=args.host, port=args.api_port).start(args.timeout)
    except BaseException:
        server.close()
        raise
    print(f"api: {api.url}  (OpenAI /v1/audio/speech, player at /)", flush=True)
    return api


def cmd_api(args: argparse.Namespace) -> int:
    """The speech API alone, in front of a tritonserver that runs elsewhere."""
    import uvicorn

    from voxbackend.api.app import create_app

    uvicorn.run(create_app(args.triton_url, args.metrics_url or None), host=args.host, port=args.port,
                ws="websockets-sansio", log_level=args.log_level)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    client = configs.REPO_ROOT / "clients" / "tts_stream.py"
    if not client.is_file():
        print("demo needs a source checkout (clients/tts_stream.py)", file=sys.stderr)
        return 2
    # only the model it speaks (--models widens it): loading every model took 110 s against 35 s, and their
    # engines' start-up work stalled the one stream
    args.models = args.models or args.model.removesuffix("_engine")
    with make_server(args) as server:
        if args.api:
            return demo_through_api(args, server)
        print(f"server ready on {server.grpc_url}; streaming...", flush=True)
        return subprocess.call([sys.executable, "-m", "clients.tts_stream", "--url", server.grpc_url,
                                "--model", args.model, "--text", args.text, "--out", str(Path(args.out).resolve()),
                                "--seed", str(args.seed),
                                *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])],
                               cwd=configs.REPO_ROOT)


def demo_through_api(args: argparse.Namespace, server: TritonServer) -> int:
    """The demo's sentence through the speech API (POST /v1/audio/speech) instead of Triton's gRPC."""
    from voxbackend.api.server import ApiServer

    with ApiServer(server.grpc_url, server.metrics_url, prefetch_voices=False).start(args.timeout) as api:
        print(f"server ready, api on {api.url}; streaming...", flush=True)
        return subprocess.call([sys.executable, "-m", "voxbackend.api.speak", "--url", api.url, "--model", args.model,
                                "--text", args.text, "--out", str(Path(args.out).resolve()), "--seed", str(args.seed),
                                *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])])


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from voxbackend.models.registry import get_kind

    model_dir, codec_dir = import_object(get_kind(args.model).tiny_checkpoint)(args.root)
    print(f"model: {model_dir}\ncodec: {codec_dir}")
    return 0


def perf_analyzer_command() -> tuple[str, dict[str, str]]:
    """perf_analyzer (tritonclient's wheel puts it next to this interpreter) and an environment in which it
    runs: it links libcudart.so.12 even on CPU, which the nvidia-cuda-runtime-cu12 wheel provides."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    found = str(binary) if binary.is_file() else shutil.which("perf_analyzer")
    if found is None:
        raise FileNotFoundError("no perf_analyzer: pip install 'tritonclient[all]==2.51.0' (its wheel ships it)")
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime as cudart

        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(Path(list(cudart.__path__)[0]) / "lib"), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    except ImportError:
        pass  # a machine with CUDA installed has libcudart already
    return found, env


def run_perf_analyzer(args: list[str]) -> int:
    try:
        binary, env = perf_analyzer_command()
    except FileNotFoundError as e:
        print(f"voxbackend: {e}", file=sys.stderr)
        return 2
    return subprocess.call([binary, *args], env=env)


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=str(default_repository()))
    p.add_argument("--models", help="comma-separated served models, e.g. orpheus or csm (default: all); "
                   "--checkpoint and --codec need exactly one")
    p.add_argument("--checkpoint", help="SpeechLM folder (Hugging Face layout); default: the tiny default checkpoint")
    p.add_argument("--codec", help="codec folder (e.g. snac_24khz)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="engine parameter override, e.g. max_batch=64, kv_pages=4096, device=cuda, policy=fcfs, "
                   "instances=2 (engines per model), gpus=0,1 (that many on each GPU), codec_instances=1 "
                   "(the codec as its own model), codec_gpus=1 (its GPUs); "
                   "csm.max_batch=16 for one model only")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP, gRPC and metrics ports bind; 0.0.0.0 for every interface")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--work-dir", help="where the backend folder, rendered repository and log go (default: a "
                   "temporary folder, removed when the server stops)")
    p.add_argument("--log-file")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="voxbackend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run tritonserver on the model repository until Ctrl-C")
    _server_args(serve)
    serve.add_argument("--api-port", type=int, default=None,
                       help="also serve the OpenAI-compatible speech API and the player on this port (0: a free one)")
    serve.set_defaults(func=cmd_serve)
    demo = sub.add_parser("demo", help="serve on free ports, stream one sentence to a WAV file, stop")
    _server_args(demo)
    demo.add_argument("--model", default="orpheus")
    demo.add_argument("--text", default="Hello there, this is a streaming speech server.")
    demo.add_argument("--max-tokens", type=int, default=None)
    demo.add_argument("--seed", type=int, default=7, help="sampling seed: the same text and seed give the same audio")
    demo.add_argument("--out", default="hello.wav")
    demo.add_argument("--api", action="store_true",
                      help="stream through the OpenAI-compatible speech API (voxbackend.api) instead of gRPC")
    demo.set_defaults(func=cmd_demo, host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0)
    api = sub.add_parser("api", help="the OpenAI-compatible speech API alone, in front of a running tritonserver")
    api.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC address")
    api.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="Triton's metrics; '' for none")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=9000)
    api.add_argument("--log-level", default="info")
    api.set_defaults(func=cmd_api)
    mk = sub.add_parser("make-checkpoint", help="build or reuse the tiny default checkpoint")
    mk.add_argument("--model", default="orpheus", choices=[m.name for m in configs.SERVED_MODELS])
    mk.add_argument("--root", default=None, help="default: under $VOXBACKEND_CACHE or ~/.cache/voxbackend")
    mk.set_defaults(func=cmd_make_checkpoint)
    cfg = sub.add_parser("configs", help="regenerate (or --check) model_repository/*/config.pbtxt")
    cfg.add_argument("--check", action="store_true")
    cfg.set_defaults(func=lambda a: configs.main(["--check"] if a.check else []))
    sub.add_parser("perf-analyzer", help="run perf_analyzer with libcudart on LD_LIBRARY_PATH; every argument "
                   "after it goes to perf_analyzer (--help included)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["perf-analyzer"]:
        return run_perf_analyzer(argv[1:])
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
