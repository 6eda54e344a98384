#!/usr/bin/env bash
# Concurrency sweep over gRPC streaming. Usage (env overrides: URL MODEL INPUT_DATA COUNT OUT):
#   RANGE=1:32:4 perf/perf_analyzer/concurrency_sweep.sh
# Runs, e.g.: perf_analyzer -m orpheus -u localhost:8001 -i grpc --streaming --input-data perf/data/pa_orpheus_max256.json
#   --concurrency-range 1:32:4 --measurement-mode count_windows --measurement-request-count 32 -s 100 -r 5
#   --verbose-csv -f $OUT/orpheus_concurrency.csv --profile-export-file $OUT/orpheus_concurrency_profile.json
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
RANGE=${RANGE:-1:16:3}
name="$OUT/${MODEL}_concurrency"
"$PA" "${pa_common[@]}" --concurrency-range "$RANGE" -f "$name.csv" --profile-export-file "$name.profile_full.json"
"$PYTHON" "$HERE/parse.py" "$name.csv" --profile "$name.profile_full.json" --slim-profile "$name.profile.json" \
    --md "$name.md" --png "$name.png" --title "$MODEL: concurrency sweep (gRPC streaming)"
rm -f "$name.profile_full.json"  # holds every audio sample as JSON; the slim copy keeps the timestamps
