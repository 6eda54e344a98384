"""The shell commands of the README and docs/*.md, and how the docs tests run them.

Every command in a ```bash block gets a plan (PLANS, first match wins): it runs as written in a scratch folder (a
one-shot with a time budget, or a client against a server), starts a server the later commands of its block use
(a service), stands for the committed repository's server (a `voxbackend serve` of the default checkpoints: the
shared test server takes its place), or is skipped with the reason shown. A command no plan matches fails
tests/test_docs_commands.py, so a new command in the docs is either run or skipped on purpose.

Before a command runs, the scratch folder's paths and the servers' addresses replace the docs' own (`point_at`):
/tmp/X becomes scratch/tmp/X, localhost:8001 the gRPC address of the server in use, and so on."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Command:
    doc: str  # relative to the repository root
    line: int
    text: str  # continuation lines joined, trailing comment removed

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    commands: tuple[Command, ...]

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _without_comment(line: str) -> str:
    """The line up to an unquoted ` #` (a shell comment)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_blocks(docs: list[Path] = DOCS) -> list[Block]:
    blocks = []
    for path in docs:
        doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = lines[i].strip()
            if not fence.startswith("```") or fence == "```":
                i += 1
                continue
            shell, start = fence[3:].strip() in SHELL_FENCES, i + 1
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append((i + 1, lines[i]))
                i += 1
            i += 1
            if shell:
                blocks.append(Block(doc, start, tuple(_commands(doc, body))))
    return blocks


def _commands(doc: str, body: list[tuple[int, str]]) -> list[Command]:
    commands, pending, first = [], "", 0
    for number, raw in body:
        text = _without_comment(raw) if not pending else raw.rstrip()
        if not pending:
            first = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        text = _without_comment(pending + text.strip()).strip()
        pending = ""
        if text:  # a comment-only line (e.g. a sample of the output) is no command
            commands.append(Command(doc, first, text))
    return commands


@dataclass(frozen=True)
class Plan:
    kind: str  # run | client | service | stand-in | skip
    reason: str = ""
    budget_s: float = 60.0
    needs: str | None = None  # a program the command runs; skipped, saying so, on a machine without it


SKIP, RUN, CLIENT, SERVICE, STAND_IN = "skip", "run", "client", "service", "stand-in"

PLANS: list[tuple[str, Plan]] = [
    (r"^bash scripts/test\.sh", Plan(SKIP, "the test command itself: this test runs inside it")),
    (r"^python -m pytest ", Plan(SKIP, "tests of the suite this test runs in")),
    (r"/ckpt/", Plan(SKIP, "real weights (and a GPU where it sets device=cuda), which the test machine lacks")),
    (r"^docker ", Plan(SKIP, "no docker on the test machine")),
    (r"^python3 -m venv|^pip install", Plan(SKIP, "the manual install: scripts/setup_env.sh, which CI runs on a "
                                                   "fresh machine, installs the same")),
    (r"^voxbackend demo", Plan(SKIP, "what scripts/demo.sh runs (README), which runs here")),
    (r"perf/reliability\.py( --quick)?$", Plan(SKIP, "about 10 minutes (--quick: about 1); "
                                                      "tests/test_reliability_suite.py runs the quick probes")),
    (r"perf/reliability\.py --only", Plan(SKIP, "starts its own server; tests/test_reliability_suite.py runs probes")),
    (r"perf/engine_bench\.py", Plan(SKIP, "minutes at full size; tests/test_engine_bench.py runs each model's "
                                           "--quick")),
    (r"clients\.loadgen", Plan(SKIP, "a one-minute load run; tests/test_loadgen.py runs the client")),
    (r"^ssh ", Plan(SKIP, "a second machine")),
    (r"^kubectl apply ", Plan(SKIP, "a Kubernetes cluster")),
    (r"^kubectl kustomize ", Plan(RUN, budget_s=60, needs="kubectl")),
    (r"--set gpus=", Plan(SKIP, "GPUs, which the test machine lacks")),
    (r"^voxbackend serve .*--set codec_instances=", Plan(SKIP, "tests/test_triton_codec_stage.py serves two orpheus "
                                                               "engines sharing one codec stage")),
    (r"^voxbackend serve .*--set instances=", Plan(SKIP, "tests/test_triton_text_stream.py serves two instances of "
                                                         "each engine-hosting model")),
    (r"^voxbackend serve .*--checkpoint", Plan(SERVICE, budget_s=180)),  # a checkpoint an earlier command built
    (r"^voxbackend serve", Plan(STAND_IN, "the default checkpoints: the shared test server serves them")),
    (r"^voxbackend api ", Plan(SERVICE, budget_s=60)),
    (r"^bash scripts/demo\.sh .* --api$", Plan(SKIP, "the demo runs here as the README gives it and the API's "
                                                     "streams in tests/test_api.py; this one's 25 s were past the "
                                                     "suite's 10-minute budget")),
    (r"^bash scripts/demo\.sh", Plan(RUN, budget_s=300)),
    (r"^voxbackend (configs|make-checkpoint)|^python -m voxbackend\.models\.\w+\.tiny |perf/reliability\.py --list",
     Plan(RUN, budget_s=120)),
    (r"clients\.(tts_stream|voice_chat)|voxbackend\.api\.speak|perf/text_stream_ttfa\.py|^voxbackend perf-analyzer",
     Plan(CLIENT, budget_s=120)),
    (r"^chromium ", Plan(CLIENT, budget_s=60)),  # 1-10 s; a hang (it was seen with --virtual-time-budget) fails sooner
]

# What the docs write for the reader to fill in, and what the test puts there.
SUBSTITUTIONS = [
    ("my_llm |", "printf 'Hello there,\\nhow are you?\\n' |"),  # the reader's LLM, one line per text piece
    ("[--model csm]", "--model csm"),  # an optional argument, shown in brackets
]
# A benchmark's repetitions: one run shows the command works; its numbers are not under test here.
FEWER_REPEATS = [(r"--runs \d+", "--runs 1")]


def plan(command: Command) -> Plan:
    for pattern, p in PLANS:
        if re.search(pattern, command.text):
            return p
    raise LookupError(f"{command.where}: no plan for `{command.text}`: add one to tests/docs_commands.py PLANS "
                      f"(run it, or skip it with the reason)")


@dataclass
class Endpoints:
    grpc: str  # host:port
    metrics: str  # http://host:port/metrics
    api: str | None = None  # http://host:port


def point_at(text: str, scratch: Path, server: Endpoints | None) -> str:
    """The command as the test runs it: placeholders filled, /tmp inside the scratch folder, the docs' addresses
    replaced by the server in use (a client that names none gets --url), a benchmark's repetitions cut to one."""
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    for pattern, repl in FEWER_REPEATS:
        text = re.sub(pattern, repl, text)
    text = re.sub(r"(?<![\w/.])/tmp/", f"{scratch}/tmp/", text)
    if server is None:
        return text
    text = re.sub(r"http://(localhost|triton-host):8002/metrics", server.metrics, text)
    text = re.sub(r"\b(localhost|triton-host):8001\b", server.grpc, text)
    if server.api:
        text = re.sub(r"http://localhost:9000", server.api, text)
    if re.search(r"clients\.(tts_stream|voice_chat)|perf/text_stream_ttfa\.py", text) and "--url" not in text:
        text += f" --url {server.grpc}"
    return text


def scratch_folder(path: Path) -> Path:
    """A working folder that looks like the checkout to the docs' relative paths (clients/, scripts/, deploy/, perf/*)
    without letting their outputs into it: perf/results/ is its own, and the clips the docs name are made here."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tmp").mkdir(exist_ok=True)
    for name in ("clients", "scripts", "deploy", "docker"):
        (path / name).symlink_to(ROOT / name)
    (path / "perf").mkdir()
    for entry in (ROOT / "perf").iterdir():
        if entry.name != "results":
            (path / "perf" / entry.name).symlink_to(entry)
    (path / "perf" / "results").mkdir()
    rng = np.random.default_rng(0)
    for name, seconds, rate in [("me.wav", 3.0, 16000), ("turn1.wav", 1.0, 24000), ("turn2.wav", 1.0, 24000),
                                ("question.wav", 1.5, 16000)]:
        t = np.arange(int(seconds * rate)) / rate  # a voiced hum: cloning front ends need a clip, not a voice
        hum = 0.3 * np.sin(2 * np.pi * 140 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
        sf.write(path / name, (hum + 0.02 * rng.standard_normal(t.size)).astype(np.float32), rate)
    return path


def command_env() -> dict[str, str]:
    """This interpreter's environment first on PATH (`python`, `voxbackend`), and its venv for scripts/*.sh."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["VOXBACKEND_VENV"] = sys.prefix
    env.pop("PYTHONPATH", None)
    return env


@dataclass
class Ran:
    command: Command
    shell: str  # what ran
    seconds: float
    output: str


@dataclass
class BlockRun:
    ran: list[Ran] = field(default_factory=list)
    skipped: list[tuple[Command, str]] = field(default_factory=list)

    def report(self) -> None:
        """What ran, in how long, and what was skipped and why (pytest -s, or a failure's captured output)."""
        for ran in self.ran:
            print(f"{ran.command.where} {ran.seconds:5.1f} s  {ran.shell}")
        for command, reason in self.skipped:
            print(f"{command.where} skipped: {command.text} ({reason})")


def needs_shared_server(block: Block) -> bool:
    """A client before any service of the block: it talks to the shared server (the default checkpoints)."""
    for command in block.commands:
        kind = plan(command).kind
        if kind == SERVICE and command.text.startswith("voxbackend serve"):
            return False
        if kind in (CLIENT, SERVICE):
            return True
    return False


def runs_something(block: Block) -> bool:
    return any(plan(c).kind in (RUN, CLIENT, SERVICE) for c in block.commands)


def run_block(block: Block, scratch: Path, shared: Endpoints | None = None) -> BlockRun:
    """Run the block's commands in order in scratch; each must exit 0 within its budget and leave every file it
    names that was not there before (its outputs)."""
    result, services, server = BlockRun(), [], shared
    try:
        for i, command in enumerate(block.commands):
            p = plan(command)
            if p.kind in (SKIP, STAND_IN):
                result.skipped.append((command, p.reason))
                if p.kind == STAND_IN:
                    server = shared
                    if _api_used_later(command, block.commands[i + 1:]):  # the API it would serve, on the shared server
                        api = Command(command.doc, command.line, f"voxbackend api --triton-url {server.grpc} "
                                      f"--metrics-url {server.metrics} --port 9000")
                        service, server = _start_service(api, api.text, scratch, server, 60)
                        services.append(service)
                continue
            if p.needs and shutil.which(p.needs) is None:
                result.skipped.append((command, f"no {p.needs} on this machine"))
                continue
            shell = point_at(command.text, scratch, server)
            if p.kind == SERVICE:
                service, server = _start_service(command, shell, scratch, server, p.budget_s)
                services.append(service)
                continue
            result.ran.append(_run(command, shell, scratch, p.budget_s))
    finally:
        for service in reversed(services):
            _stop(service)
    return result


def _api_used_later(serve: Command, later: tuple[Command, ...]) -> bool:
    return "--api-port" in serve.text and any("localhost:9000" in c.text for c in later) and \
        not any(c.text.startswith("voxbackend api ") for c in later)


def _named_files(shell: str, scratch: Path) -> list[Path]:
    words = re.findall(r"[\w./-]+\.(?:wav|csv|json|md|png)\b", shell)
    return [scratch / w for w in words]


def _run(command: Command, shell: str, scratch: Path, budget_s: float) -> Ran:
    before = {p for p in _named_files(shell, scratch) if p.exists()}
    t0 = time.monotonic()
    try:
        done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=scratch, env=command_env(),
                              capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{command.where}: `{shell}` ran past its {budget_s:.0f} s budget:\n"
                             f"{_text(e.stdout)[-2000:]}{_text(e.stderr)[-2000:]}") from None
    seconds = time.monotonic() - t0
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command.where}: `{shell}` exited {done.returncode}:\n{output[-4000:]}"
    for path in _named_files(shell, scratch):
        if path not in before:
            assert path.exists(), f"{command.where}: `{shell}` did not write {path.name}:\n{output[-2000:]}"
            if path.suffix == ".wav":
                assert sf.info(str(path)).frames > 0, f"{command.where}: {path.name} holds no audio"
    return Ran(command, shell, seconds, output)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


@dataclass
class _Service:
    command: Command
    proc: subprocess.Popen
    log: Path


def _start_service(command: Command, shell: str, scratch: Path, server: Endpoints | None, budget_s: float
                   ) -> tuple[_Service, Endpoints]:
    """`voxbackend serve` on free ports (ready when it prints `ready:`), or `voxbackend api` in front of the
    server in use (ready when its /health answers)."""
    from voxbackend.deploy.server import free_port

    if shell.startswith("voxbackend serve"):
        http, grpc, metrics = free_port(), free_port(), free_port()
        shell += f" --http-port {http} --grpc-port {grpc} --metrics-port {metrics}"
        endpoints = Endpoints(f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    else:
        assert server is not None, f"{command.where}: `voxbackend api` needs a server before it"
        port = free_port()
        shell = re.sub(r"--port \d+", f"--port {port}", shell) + " --host 127.0.0.1"
        endpoints = Endpoints(server.grpc, server.metrics, f"http://127.0.0.1:{port}")
    log = scratch / f"service-{command.line}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {shell}"], cwd=scratch, env=command_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    service = _Service(command, proc, log)
    deadline = time.monotonic() + budget_s
    while not _ready(service, endpoints):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(service)
            raise AssertionError(f"{command.where}: `{shell}` did not become ready within {budget_s:.0f} s:\n"
                                 f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    return service, endpoints


def _ready(service: _Service, endpoints: Endpoints) -> bool:
    if endpoints.api is None:
        return re.search(r"^ready: ", service.log.read_text(errors="replace"), re.M) is not None
    try:
        with urllib.request.urlopen(f"{endpoints.api}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(service: _Service) -> None:
    if service.proc.poll() is None:
        os.killpg(service.proc.pid, signal.SIGINT)  # Ctrl-C: what a reader at the terminal does
        try:
            service.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()
