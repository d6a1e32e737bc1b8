# Sourced by the third-party checks. start_cllm LOG PORT [ARGS...] starts `python -m cllm.serve
# --port PORT ARGS` in the background, its output in LOG and its pid in server_pid (for the
# caller's EXIT trap to kill), and returns once /health answers: the model is loaded.
start_cllm() {
    local log=$1 port=$2
    shift 2
    python -m cllm.serve --port "$port" "$@" >"$log" 2>&1 &
    server_pid=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 "$server_pid" 2>/dev/null || { cat "$log"; return 1; }
        sleep 0.5
    done
}

# A TCP port that nothing listens on now.
free_port() {
    python -c 'import socket; print(socket.create_server(("127.0.0.1", 0)).getsockname()[1])'
}
