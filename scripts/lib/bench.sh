# Helpers the benchmark scripts share (sourced, not run): free loopback ports, valgrind, and
# instruction counts of a process running under callgrind. Each takes the calling script's
# name ($BENCH, set before sourcing) for its messages.

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A port nothing listens on, below the usual ephemeral range (32768+), where clients' own
# connections live.
free_port() {
    local port
    for _ in $(seq 200); do
        port=$(( 20000 + RANDOM % 12000 ))
        if ! port_open "$port"; then echo "$port"; return 0; fi
    done
    echo "$BENCH: no free port" >&2
    return 1
}

# Installs valgrind with apt-get when it is missing (as root).
need_valgrind() {
    command -v callgrind_control >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ]; then
        echo "$BENCH: installing valgrind" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
    else
        echo "$BENCH: valgrind is missing; install it (apt-get install valgrind) or run as root" >&2
        return 1
    fi
}

# callgrind_measure PID DUMP OUT CMD...: runs CMD (its output to file OUT) with the callgrind
# process PID instrumented (started with --instr-atstart=no --callgrind-out-file=DUMP), then
# prints the process's instructions meanwhile. Each dump holds what ran since the one before.
callgrind_measure() {
    local pid="$1" dump="$2" out="$3" before after
    shift 3
    callgrind_control -i on "$pid" >/dev/null 2>&1 || return 1
    "$@" > "$out" || return 1
    callgrind_control -i off "$pid" >/dev/null 2>&1 || return 1
    before=$(ls "$dump".* 2>/dev/null | wc -l)
    callgrind_control -d "$pid" >/dev/null 2>&1 || return 1
    after=$(ls "$dump".* 2>/dev/null | wc -l)
    if [ "$after" -le "$before" ]; then
        echo "$BENCH: callgrind wrote no dump" >&2
        return 1
    fi
    sed -n 's/^totals: *//p' "$(ls "$dump".* | sort -V | tail -n 1)"
}
