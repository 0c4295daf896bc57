# Sourced by the gpu_*.sh runners: `step SECONDS NAME command...` runs a command under a time limit, logs it to
# $out/NAME.log, appends its exit status and time to $out/suite.log, and prints the log's tail.
step() {
    local limit=$1 name=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: rc=$? after $((SECONDS - t0)) s (limit $limit)" | tee -a "$out/suite.log"
    tail -n 12 "$out/$name.log" | cut -c1-600
}
