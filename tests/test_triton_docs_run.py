"""The docs' shell blocks whose clients talk to a server of the default checkpoints, run as written
(tests/docs_commands.py) against the shared committed-repository server: the streaming, cloning, API and
perf_analyzer examples of the README and docs."""
import pytest

from tests.docs_commands import Endpoints, needs_shared_server, run_block, scratch_folder, shell_blocks
from tests.triton_util import COMMITTED

pytestmark = pytest.mark.xdist_group(COMMITTED)

BLOCKS = [b for b in shell_blocks() if needs_shared_server(b)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_the_block_runs_as_written_against_the_default_checkpoints(block, committed_server, tmp_path):
    shared = Endpoints(committed_server.grpc_url, committed_server.metrics_url)
    result = run_block(block, scratch_folder(tmp_path / "scratch"), shared)
    result.report()
