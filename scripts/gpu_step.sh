# Sourced by the GPU scripts: `gpu_step DIR SECONDS TAIL NAME COMMAND...` runs COMMAND under
# `timeout -s INT SECONDS` with its output in DIR/NAME.log, prints its exit status, time and
# last TAIL lines, and keeps a failure in the caller's `status`.
gpu_step() {
    local dir=$1 limit=$2 tail=$3 name=$4; shift 4
    local start=$SECONDS
    timeout -s INT "$limit" "$@" > "$dir/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n "$tail" "$dir/$name.log"
    [ "$rc" = 0 ] || status=$rc
}
