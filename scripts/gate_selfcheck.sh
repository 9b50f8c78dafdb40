#!/usr/bin/env bash
# The regression gate must not flap, and must still catch a regression.
#
#   bash scripts/gate_selfcheck.sh [N]          # N defaults to 10
#
# 1. Runs a small benchmark once as the baseline: flash_crowd at quick scale on the reference
#    engine and reference:preemption_mode=swap, 3 repeats (about 60-70 s on a loaded 2-core machine).
# 2. Runs it N more times, each gated against the baseline with the default thresholds through
#    pytest's --baseline (exact step-clock counts; the swap engine's times as per-repeat ratios to
#    the reference engine's, beyond the noise floor). Every run of the same commit must pass:
#    prints "self-gate: P/N passed".
# 3. Two deliberate regressions of the swap engine, each of which must fail the session and be named:
#    - schedule: max_num_seqs halved (half the most requests the baseline ran at once, running_max);
#    - time: reference:step_delay_ms=5, a 5 ms sleep after every engine step (the adapter's testing aid).
#    The regressed engine's spec (hence its name) differs from the baseline's, so a copy of the
#    baseline with that engine renamed is the --baseline: the gate sees "the same engine got worse".
#
# Environment: SELFCHECK_K (pytest -k expression, default "flash_crowd"), SELFCHECK_REPEATS (3),
# SELFCHECK_DELAY_MS (5), SELFCHECK_DIR (work folder; default a new temporary one).
# Exit status 0 only if N out of N passed and both regressions failed, named.
set -u
cd "$(dirname "$0")/.."
N="${1:-10}"
K="${SELFCHECK_K:-flash_crowd}"
REPEATS="${SELFCHECK_REPEATS:-3}"
DELAY_MS="${SELFCHECK_DELAY_MS:-5}"
DIR="${SELFCHECK_DIR:-$(mktemp -d -t kvbench-selfcheck-XXXX)}"
mkdir -p "$DIR"
REF="reference"
SWAP="reference:preemption_mode=swap"

bench() {  # bench REPORT_DIR SECOND_ENGINE [extra pytest args...]
    local dir="$1" second="$2"; shift 2
    python3 -m pytest -p no:cacheprovider -q suites/benchmarks/test_storms.py --benchmark -k "$K" \
        --benchmark-repeats "$REPEATS" --engine "$REF" --engine "$second" --report-dir "$dir" "$@"
}
results_of() { ls -d "$1"/*/ 2>/dev/null | head -1 | sed 's:/*$:/results.json:'; }

echo "commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (dirty)'); work folder $DIR"
echo "baseline run -> $DIR/base"
start=$SECONDS
if ! bench "$DIR/base" "$SWAP" > "$DIR/base.log" 2>&1; then
    echo "the baseline run failed; see $DIR/base.log"; tail -5 "$DIR/base.log"; exit 2
fi
BASE=$(results_of "$DIR/base")
echo "baseline: $BASE ($((SECONDS - start)) s)"

passed=0
for i in $(seq 1 "$N"); do
    start=$SECONDS
    bench "$DIR/run$i" "$SWAP" --baseline "$BASE" > "$DIR/run$i.log" 2>&1
    rc=$?
    last=$(tail -1 "$DIR/run$i.log")
    if [ $rc -eq 0 ] && grep -q "no regression" "$DIR/run$i.log"; then
        passed=$((passed + 1)); echo "run $i: PASS ($((SECONDS - start)) s)  $last"
    else
        echo "run $i: FAIL rc=$rc ($((SECONDS - start)) s)  $last"
        grep -E "REGRESSION|MISSING|GATE ERROR" "$DIR/run$i.log" | sort -u | head -10
    fi
done
echo "self-gate: $passed/$N passed"

# The regressed engine's name, and a baseline copy in which the swap engine carries that name.
renamed_baseline() {  # renamed_baseline SPEC OUT.json -> prints the spec's engine name
    python3 - "$BASE" "$SWAP" "$1" "$2" <<'PY'
import json, sys
from kvbench.engines.registry import parse_engine_spec
base, old, spec, out = sys.argv[1:]
new = parse_engine_spec(spec).name
text = open(base).read().replace(json.dumps(parse_engine_spec(old).name), json.dumps(new))
open(out, "w").write(text)
print(new)
PY
}
regression() {  # regression LABEL SPEC
    local label="$1" spec="$2" name rc
    name=$(renamed_baseline "$spec" "$DIR/base-as-$label.json") || { echo "could not rename the baseline"; return 1; }
    echo "deliberate regression ($label): $name"
    bench "$DIR/$label" "$spec" --baseline "$DIR/base-as-$label.json" > "$DIR/$label.log" 2>&1
    rc=$?
    grep -E "^(REGRESSION|MISSING)" "$DIR/$label.log" | sort -u | head -8
    echo "  pytest exit $rc; last line: $(tail -1 "$DIR/$label.log")"
    if [ $rc -ne 0 ] && grep -q "REGRESSION .*$name" "$DIR/$label.log"; then
        echo "  caught and named: yes"; return 0
    fi
    echo "  caught and named: NO"; return 1
}
RUNNING_MAX=$(python3 - "$BASE" "$SWAP" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
values = [r["metrics"].get("running_max") for sc in data["scenarios"] for r in sc["results"] if r["engine"] == sys.argv[2]]
print(int(max(v for v in values if v is not None)))
PY
)
HALF=$(( RUNNING_MAX / 2 > 0 ? RUNNING_MAX / 2 : 1 ))
regression "max_num_seqs" "reference:preemption_mode=swap,max_num_seqs=$HALF"; caught_seqs=$?
regression "step_delay" "reference:preemption_mode=swap,step_delay_ms=$DELAY_MS"; caught_delay=$?
echo "summary: self-gate $passed/$N passed; max_num_seqs $RUNNING_MAX -> $HALF caught: $([ $caught_seqs -eq 0 ] && echo yes || echo no);" \
     "step_delay_ms=$DELAY_MS caught: $([ $caught_delay -eq 0 ] && echo yes || echo no)"
[ "$passed" -eq "$N" ] && [ $caught_seqs -eq 0 ] && [ $caught_delay -eq 0 ]
