#!/usr/bin/env bash
# Poisson request-rate sweep over gRPC streaming. Usage (env overrides: URL MODEL INPUT_DATA COUNT OUT):
#   RANGE=0.5:4:0.5 perf/perf_analyzer/request_rate_sweep.sh
# Runs, e.g.: perf_analyzer -m orpheus -u localhost:8001 -i grpc --streaming --input-data perf/data/pa_orpheus_max256.json
#   --request-rate-range 0.5:4:0.5 --request-distribution poisson --measurement-mode count_windows
#   --measurement-request-count 32 -s 100 -r 5 --verbose-csv -f $OUT/orpheus_request_rate.csv --profile-export-file ...
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
RANGE=${RANGE:-1:4:1}
name="$OUT/${MODEL}_request_rate"
"$PA" "${pa_common[@]}" --request-rate-range "$RANGE" --request-distribution poisson \
    -f "$name.csv" --profile-export-file "$name.profile_full.json"
"$PYTHON" "$HERE/parse.py" "$name.csv" --profile "$name.profile_full.json" --slim-profile "$name.profile.json" \
    --md "$name.md" --png "$name.png" --title "$MODEL: Poisson request-rate sweep (gRPC streaming)"
rm -f "$name.profile_full.json"
