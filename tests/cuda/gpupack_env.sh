# Sourced by the device scripts (device_session.sh, device_quick.sh, perf_session.sh) on a lent GPU machine:
#   gpupack_env [pack-dir] [fitllm-binary]
# The pack's shared libraries the machine lacks (tools/gpu_pack.sh's libs.tar.xz; its own libstdc++ and friends
# must win for python3) and the CUDA toolkit's go on LD_LIBRARY_PATH; then cuDNN: fitllm looks for it itself
# (fl_cudnn_search: PyTorch's nvidia-cudnn wheel, conda, the toolkit); only where that finds nothing (its
# `--version` says "cuDNN not found") the wheel's folder as python3 names it is added. GPUPACK_LIBS: the folder.
gpupack_env() {
    local pack=${1:-.gpupack} f=${2:-} d
    if [ -f "$pack/libs.tar.xz" ]; then
        GPUPACK_LIBS=$(mktemp -d /tmp/fitllm-libs-XXXXXX)
        tar -xJf "$pack/libs.tar.xz" -C "$GPUPACK_LIBS"
        for d in "$GPUPACK_LIBS"/*; do if ldconfig -p | grep -q "/$(basename "$d")\$"; then rm -f "$d"; fi; done
        export LD_LIBRARY_PATH="$GPUPACK_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/targets/x86_64-linux/lib"
    [ -n "${FITLLM_CUDNN_LIB:-}" ] && return 0
    if [ -n "$f" ] && ! "$f" --version 2>/dev/null | grep -q '^cudnn: *cuDNN not found'; then return 0; fi
    d=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
    if [ -n "$d" ] && [ -f "$d/libcudnn.so.9" ]; then
        export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
        echo "gpupack_env: fitllm did not find cuDNN itself; LD_LIBRARY_PATH gets $d"
    fi
}
