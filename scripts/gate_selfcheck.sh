#!/usr/bin/env bash
# The regression gate must not flap: run a small benchmark once as the baseline, then N more times,
# each gated against the baseline with the default thresholds (exact step-clock counts, same-run
# ratios of times with a noise floor). Every run of the same commit must pass. Then one deliberate
# regression must fail, naming what regressed.
#
#   bash scripts/gate_selfcheck.sh [N]          # N defaults to 10
#
# Environment: SELFCHECK_K (pytest -k expression, default "flash_crowd or preemption_storm"),
# SELFCHECK_ENGINES (default: reference and reference:preemption_mode=swap, so the default gate
# compares the swap engine's times as ratios to the reference engine's), SELFCHECK_DIR (work folder).
# Prints one line per run and the tally; exits 1 unless N out of N passed and the regression failed.
set -u
cd "$(dirname "$0")/.."
N="${1:-10}"
K="${SELFCHECK_K:-flash_crowd or preemption_storm}"
DIR="${SELFCHECK_DIR:-$(mktemp -d -t kvbench-selfcheck-XXXX)}"
mkdir -p "$DIR"
read -r -a ENGINES <<< "${SELFCHECK_ENGINES:---engine reference --engine reference:preemption_mode=swap}"
bench() {  # bench REPORT_DIR [extra pytest args...]
    local dir="$1"; shift
    python3 -m pytest -p no:cacheprovider -q suites/benchmarks/test_storms.py --benchmark -k "$K" \
        "${ENGINES[@]}" --report-dir "$dir" "$@"
}

echo "baseline run -> $DIR/base"
if ! bench "$DIR/base" > "$DIR/base.log" 2>&1; then
    echo "the baseline run failed; see $DIR/base.log"; tail -5 "$DIR/base.log"; exit 2
fi
BASE=$(ls -d "$DIR"/base/*/ | head -1)results.json

passed=0
for i in $(seq 1 "$N"); do
    bench "$DIR/run$i" --baseline "$BASE" > "$DIR/run$i.log" 2>&1
    rc=$?
    last=$(tail -1 "$DIR/run$i.log")
    if [ $rc -eq 0 ]; then passed=$((passed + 1)); echo "run $i: PASS  $last"
    else echo "run $i: FAIL  $last"; grep -E "REGRESSION|MISSING|GATE ERROR" "$DIR/run$i.log" | head -10; fi
done
echo "same commit gated against itself: $passed/$N passed"

# A deliberate regression: the second engine (the swap one) capped at max_num_seqs=4. Its spec,
# hence its name, changes with the option, so its results are renamed back to the baseline's engine
# name before gating: the gate sees "the same engine got slower", and must name it (its times are
# gated as ratios to the unchanged reference engine).
echo "deliberate regression: reference:preemption_mode=swap run with max_num_seqs=4"
read -r -a ENGINES <<< "--engine reference --engine reference:max_num_seqs=4,preemption_mode=swap"
bench "$DIR/regressed" > "$DIR/regressed.log" 2>&1
REG=$(ls -d "$DIR"/regressed/*/ | head -1)results.json
python3 - "$REG" <<'PY'
import json, sys
path = sys.argv[1]
data = json.load(open(path))
old, new = "reference:max_num_seqs=4,preemption_mode=swap", "reference:preemption_mode=swap"
text = json.dumps(data).replace(json.dumps(old), json.dumps(new))
open(path, "w").write(text)
PY
python3 -m kvbench compare "$BASE" "$REG" > "$DIR/regressed.compare" 2>&1
rc=$?
grep -E "REGRESSION|MISSING" "$DIR/regressed.compare" | head -8
echo "deliberate regression: kvbench compare exit $rc (1 = caught)"
[ "$passed" -eq "$N" ] && [ $rc -eq 1 ]
