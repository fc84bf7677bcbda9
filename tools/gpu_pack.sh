#!/usr/bin/env bash
# Pack what a lent GPU machine needs to run this tree's CUDA checks, into the ignored folder .gpupack/
# (carried to the device machine beside the working tree; keep it under the carry limit of 64 MiB):
#   tools/gpu_pack.sh [cuda-build-dir]        (default build-cuda, configured if absent)
#   .gpupack/bin/   fitllm, libfitllm_cuda.so, fitllm_cuda_check (the CUDA build, sm_90, generic CPU code)
#   .gpupack/libs.tar.xz   every shared library fitllm needs except the C library's own (libdnnl, libcurl's
#                          closure, libjpeg, libpng, libyaml, ...): the device's image may lack some of them
# On the device: tests/cuda/device_session.sh (unpacks, keeps only the libraries the machine lacks, runs the checks).
set -eu
B=${1:-build-cuda}
cd "$(dirname "$0")/.."
if [ ! -f "$B/CMakeCache.txt" ]; then
    cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DFL_CUDA=ON -DFL_CUDA_ARCHS=90 -DFL_NCCL=OFF -DFL_MPI=OFF \
        -DFL_NATIVE=OFF >/dev/null
fi
cmake --build "$B" -j2 --target fitllm_cli fitllm_cuda_plugin fitllm_cuda_check >/dev/null
rm -rf .gpupack && mkdir -p .gpupack/bin .gpupack/stage
for f in fitllm libfitllm_cuda.so fitllm_cuda_check; do
    [ -f "$B/$f" ] || { echo "gpu_pack: $B/$f was not built" >&2; exit 1; }
    cp "$B/$f" .gpupack/bin/
done
# the closure of shared libraries, minus glibc's own parts (the device has its own C library)
for bin in .gpupack/bin/fitllm .gpupack/bin/libfitllm_cuda.so; do ldd "$bin"; done | awk '/=> \//{print $3}' |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' | grep -v '/cuda' | sort -u |
    while read -r lib; do cp -L "$lib" .gpupack/stage/; done
tar -cJf .gpupack/libs.tar.xz -C .gpupack/stage .
rm -rf .gpupack/stage
du -sh .gpupack | awk '{print "gpu_pack: .gpupack is " $1 " (carry limit 64 MiB with the working tree)"}'
