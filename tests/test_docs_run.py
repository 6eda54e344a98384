"""The docs' shell blocks that need no shared server, run as written (tests/docs_commands.py): the README's first
command (the demo, through scripts/demo.sh), the Base Qwen3-TTS cloning example (it builds its checkpoint and serves
it), and the one-shot commands."""
import re
from pathlib import Path

import pytest

from tests.docs_commands import needs_shared_server, run_block, runs_something, scratch_folder, shell_blocks

BLOCKS = [b for b in shell_blocks() if runs_something(b) and not needs_shared_server(b)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_the_block_runs_as_written(block, tmp_path):
    result = run_block(block, scratch_folder(tmp_path / "scratch"))
    result.report()
    if block.where == "README.md:13":  # the demo: one model served, its rendered repository removed at exit
        [demo] = result.ran
        rendered = re.search(r"^rendered (\S+) \((.*)\) with", demo.output, re.M)
        assert rendered and rendered.group(2) == "orpheus", demo.output  # not every model of the repository
        assert not Path(rendered.group(1)).parent.exists(), "the rendered repository was left behind"
