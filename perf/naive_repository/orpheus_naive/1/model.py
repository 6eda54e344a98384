"""orpheus_naive: the naive baseline (perf/naive_triton.py), one request at a time."""
import json
import sys
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        # perf/ is not part of the installed package: find it from the repo_root parameter (rendered copies)
        # or from this file's place in a checkout (perf/naive_repository/orpheus_naive/1/model.py).
        params = json.loads(args["model_config"]).get("parameters", {})
        root = params.get("repo_root", {}).get("string_value") or str(Path(__file__).resolve().parents[4])
        sys.path[:0] = [str(Path(root) / "perf"), root]
        from naive_triton import NaiveTritonModel

        self.impl = NaiveTritonModel()
        self.impl.initialize(args)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
