# memory_plan FILE [planner and training flags...]: the planner's estimate of the run (tools/estimate_memory.py
# --json), written once to FILE; then PLAN_FLAGS=(--memory-plan FILE) for the run, which logs each step's peak
# beside the planned one and judges its deadline by the planned step until it has measured one. A plan that
# cannot be made (the planner's error is shown) leaves PLAN_FLAGS empty: the run goes on without it.
# Sourced by the recipes.
memory_plan() {
    local file=$1
    shift
    PLAN_FLAGS=()
    if [ ! -s "$file" ]; then
        mkdir -p "$(dirname "$file")"
        if ! python "$(dirname "${BASH_SOURCE[0]}")/../tools/estimate_memory.py" "$@" --json > "$file.tmp"; then
            echo "memory plan: the planner did not answer (above); the run goes on without --memory-plan" >&2
            rm -f "$file.tmp"
            return 0
        fi
        mv "$file.tmp" "$file"
    fi
    PLAN_FLAGS=(--memory-plan "$file")
}
