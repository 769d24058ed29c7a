# A private MPS control daemon for the GPU scripts, which source this file: rank processes that
# outnumber the GPUs share them through it. mps_init NAME makes its directory and stops the daemon
# (keeping its log in $LOGDIR/mps-log) when the script exits; mps_start NGPU starts it when there
# are fewer than 8 GPUs. The sourcing script defines LOGDIR and log.
MPS_DIR=
MPS_STARTED=0

mps_stop() {
    if [ "$MPS_STARTED" = 1 ]; then
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe nvidia-cuda-mps-control >/dev/null 2>&1
        for _ in $(seq 50); do pgrep -f "nvidia-cuda-mps-server" >/dev/null || break; sleep 0.2; done
        MPS_STARTED=0
    fi
    [ -n "$MPS_DIR" ] || return 0
    cp -r "$MPS_DIR/log" "$LOGDIR/mps-log" 2>/dev/null
    rm -rf "$MPS_DIR"
}

mps_init() {  # name: the prefix of the daemon's directory
    MPS_DIR=$(mktemp -d "/tmp/$1.XXXXXX")
    trap mps_stop EXIT
}

mps_start() {  # ngpu
    if [ "${1:-0}" -lt 8 ] && command -v nvidia-cuda-mps-control >/dev/null; then
        mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
        export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
        if nvidia-cuda-mps-control -d; then
            MPS_STARTED=1; log "mps daemon started ($MPS_DIR)"
        else
            log "mps start failed"
        fi
    fi
}
