"""Every shell command in the README and docs/*.md has a plan (tests/docs_commands.py): run, or skipped with its
reason. The runs are tests/test_docs_run.py and tests/test_triton_docs_run.py; this file is the quick check that a
new or changed command is not silently left out, and that the plans say what they do."""
from tests.docs_commands import ROOT, SERVICE, SKIP, STAND_IN, Command, Endpoints, plan, point_at, \
    shell_blocks


def test_every_shell_command_in_the_docs_has_a_plan():
    blocks = shell_blocks()
    commands = [c for b in blocks for c in b.commands]
    assert len(blocks) >= 15 and len(commands) >= 40, "the docs' shell blocks were not found"
    unplanned = []
    for command in commands:
        try:
            plan(command)
        except LookupError as e:
            unplanned.append(str(e))
    assert not unplanned, "\n".join(unplanned)
    kinds = [plan(c).kind for c in commands]
    assert kinds.count(SKIP) < len(kinds) / 2  # most run, or are served by the shared server (stand-ins)
    assert all(plan(c).reason for c in commands if plan(c).kind in (SKIP, STAND_IN)), "a skip without its reason"


def test_commands_are_read_as_the_shell_reads_them(tmp_path):
    doc = "\n".join(["```bash", "voxbackend serve --models csm \\", "    --set max_batch=4   # a comment",
                     "# TTFA 120 ms | a sample of the output", "python -m clients.tts_stream --text \"a # b\" "
                     "--out x.wav", "```", "```python", "print('not shell')", "```"])
    (tmp_path / "doc.md").write_text(doc)
    [block] = shell_blocks([tmp_path / "doc.md"])
    assert [(c.line, c.text) for c in block.commands] == [
        (2, "voxbackend serve --models csm --set max_batch=4"),
        (5, 'python -m clients.tts_stream --text "a # b" --out x.wav')]


def test_commands_are_pointed_at_the_scratch_folder_and_the_server_in_use(tmp_path):
    server = Endpoints("127.0.0.1:5001", "http://127.0.0.1:5002/metrics", "http://127.0.0.1:5009")

    def pointed(text: str) -> str:
        return point_at(text, tmp_path, server)

    assert pointed("python -m clients.tts_stream --model csm --out /tmp/a.wav") == \
        f"python -m clients.tts_stream --model csm --out {tmp_path}/tmp/a.wav --url 127.0.0.1:5001"
    assert pointed("voxbackend perf-analyzer -m orpheus -u localhost:8001") == \
        "voxbackend perf-analyzer -m orpheus -u 127.0.0.1:5001"
    assert pointed("voxbackend api --triton-url triton-host:8001 --metrics-url http://triton-host:8002/metrics") == \
        "voxbackend api --triton-url 127.0.0.1:5001 --metrics-url http://127.0.0.1:5002/metrics"
    assert pointed("python -m voxbackend.api.speak --url http://localhost:9000 --text Hi") == \
        "python -m voxbackend.api.speak --url http://127.0.0.1:5009 --text Hi"
    assert pointed("my_llm | python -m clients.tts_stream --stdin").startswith("printf 'Hello there,\\nhow are you?")
    assert plan(Command("x.md", 1, "voxbackend serve --models csm --checkpoint /ckpt/csm-1b")).kind == SKIP
    assert plan(Command("x.md", 1, "voxbackend serve --models qwen3_tts --checkpoint /tmp/base")).kind == SERVICE
    assert plan(Command("x.md", 1, "voxbackend serve --models qwen3_tts")).kind == STAND_IN


def test_every_voxbackend_command_in_the_docs_parses_and_names_served_models():
    """The ones skipped or stood in for too (real weights, a GPU, the default server): a renamed flag or model
    fails here though the command never runs."""
    import shlex

    from voxbackend import cli
    from voxbackend.deploy import configs

    checked = 0
    for command in (c for b in shell_blocks() for c in b.commands):
        words = shlex.split(point_at(command.text, ROOT, None))
        if words[:1] != ["voxbackend"] or words[1:2] == ["perf-analyzer"]:  # perf_analyzer's own flags
            continue
        try:
            args = cli.parser().parse_args(words[1:])
        except SystemExit:
            raise AssertionError(f"{command.where}: `{command.text}` does not parse (voxbackend {words[1]} --help)")
        if getattr(args, "models", None):
            configs.select(args.models.split(","))  # raises naming an unknown model
        checked += 1
    assert checked >= 10
