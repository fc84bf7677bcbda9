#!/usr/bin/env python3
"""cuDNN's own SDPA graphs, planned without a GPU: which engine cuDNN ranks first for each shape.

The reference for tests/test_cudnn.c's `cudnn_plan_without_a_device`: NVIDIA's cudnn-frontend (Python,
`nvidia-cudnn-frontend`) builds its `sdpa` / `sdpa_backward` nodes for the device a JSON describes (cuDNN >= 9.8's
device properties), and cuDNN's heuristics rank engine configurations for them. fitllm's graphs (the C backend API,
src/backend/cuda/cudnn_graph.c) must get the same first-ranked engine: a graph cuDNN does not recognize as fused
attention gets none, or a generic one (the first graphs of 2026-11-30: "no engine for the graph" on an H200).

No GPU is needed: with the CUDA toolkit's stub libcuda.so.1 loaded, cuDNN runs its checks and compiles the chosen
kernel through NVRTC; only loading it fails (CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER), after the ranking is known.

    python3 -m venv /work/venv-fe && /work/venv-fe/bin/pip install nvidia-cudnn-frontend==1.32.0
    mkdir -p /tmp/cudastub && cp /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cudastub/libcuda.so.1
    LD_LIBRARY_PATH=/tmp/cudastub:/usr/local/cuda/lib64 /work/venv-fe/bin/python tests/ref/cudnn_engines.py \
        > tests/fixtures/cudnn-engines.txt

Writes, one per line: `cudnn VERSION frontend VERSION`; `device NAME JSON`; `shape I B Tq Tk NH NKV HD causal
interleaved` (interleaved: q, k, v read in place from a bf16 run's q|k|v rows, (NH + 2 NKV) HD elements a token;
else compact copies); `engine NAME I fwd|bwd ENGINE` (the first-ranked configuration's engine, cuDNN's global index).
"""
import json
import re
import sys

import cudnn

# the devices: cudnnDeviceProp's keys as cuDNN's JSON has them (deviceVer = 100 major + 10 minor), values from
# NVIDIA's data sheets / cudaGetDeviceProperties of an H200 SXM, an A100 SXM 80 GB and an RTX 4090
COMMON = {"cudaDeviceId": 0, "driverVer": 13000, "maxGridSize": [2147483647, 65535, 65535],
          "maxBlockSize": [1024, 1024, 64], "regsPerBlock": 65536, "warpSize": 32, "maxSharedMemoryPerBlock": 49152,
          "reservedSharedMemoryPerBlock": 1024, "maxRegistersPerSM": 65536, "maxCtasPerSM": 32,
          "maxThreadsPerBlock": 1024, "maxThreadsPerSM": 2048, "pciDeviceId": 0, "isTccDriver": 0,
          "supportCoopLaunch": 1}
DEVICES = [
    ("H200", dict(deviceName="NVIDIA H200", deviceVer=900, multiProcessorCount=132, maxSharedMemoryPerBlockOptin=232448,
                  l2CacheSize=62914560, totalGlobalMem=150754820096, smClockRateKHz=1980000, memClockRateKHz=3201000)),
    ("A100", dict(deviceName="NVIDIA A100-SXM4-80GB", deviceVer=800, multiProcessorCount=108,
                  maxSharedMemoryPerBlockOptin=166912, l2CacheSize=41943040, totalGlobalMem=85097971712,
                  smClockRateKHz=1410000, memClockRateKHz=1593000)),
    # sm_89 (Ada: an RTX 4090; an L40S is the same SM): 99 KiB a block, 1,536 threads and 24 blocks an SM
    ("RTX4090", dict(deviceName="NVIDIA GeForce RTX 4090", deviceVer=890, multiProcessorCount=128,
                     maxSharedMemoryPerBlockOptin=101376, l2CacheSize=75497472, totalGlobalMem=25386352640,
                     smClockRateKHz=2520000, memClockRateKHz=10501000, maxThreadsPerSM=1536, maxCtasPerSM=24)),
]
# B, Tq, Tk, NH, NKV, HD, causal, interleaved
SHAPES = [
    (4, 2048, 2048, 32, 4, 64, 1, 1),   # TinyLlama-1.1B, as a bf16 run calls it
    (4, 2048, 2048, 32, 4, 64, 1, 0),   # the same through the compact copies
    (1, 2048, 2048, 32, 32, 128, 1, 1),  # LLaMA-7B's heads
    (2, 1024, 1024, 32, 32, 80, 1, 1),  # BLIP-2 OPT-2.7b's 80
    (2, 257, 257, 16, 16, 88, 0, 0),    # ViT-g's 88, bidirectional
    (2, 77, 300, 8, 8, 64, 0, 0),       # a cross-attention, Tq != Tk
    (1, 2048, 2048, 32, 32, 104, 1, 0),  # OpenLLaMA 3B's 100, run at 104 from zero-padded copies
]
BF16, F32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT


def strides(shape):
    """(b, h, s, d) strides of q, k, v and of the compact o / dO / gradients, as fitllm's layouts give them"""
    B, Tq, Tk, NH, NKV, HD, causal, inter = shape
    if inter:
        row = (NH + 2 * NKV) * HD
        q = [Tq * row, HD, row, 1]
        kv = [Tk * row, HD, row, 1]
    else:
        q = [Tq * NH * HD, HD, NH * HD, 1]
        kv = [Tk * NKV * HD, HD, NKV * HD, 1]
    return q, kv, [Tq * NH * HD, HD, NH * HD, 1]


def first_engine(dev_json, shape, backward):
    B, Tq, Tk, NH, NKV, HD, causal, inter = shape
    dp = cudnn.create_device_properties(json.dumps(dev_json))
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, device_property=dp,
                      sm_version=dev_json["deviceVer"] // 10, sm_count=dev_json["multiProcessorCount"])
    sq, skv, so = strides(shape)
    q = g.tensor(name="q", dim=[B, NH, Tq, HD], stride=sq, data_type=BF16)
    k = g.tensor(name="k", dim=[B, NKV, Tk, HD], stride=skv, data_type=BF16)
    v = g.tensor(name="v", dim=[B, NKV, Tk, HD], stride=skv, data_type=BF16)
    scale = 1.0 / HD ** 0.5
    if not backward:
        o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_causal_mask=bool(causal))
        o.set_output(True).set_dim([B, NH, Tq, HD]).set_stride(so)
        st.set_output(True).set_data_type(F32)
    else:
        o = g.tensor(name="o", dim=[B, NH, Tq, HD], stride=so, data_type=BF16)
        do = g.tensor(name="do", dim=[B, NH, Tq, HD], stride=so, data_type=BF16)
        st = g.tensor(name="stats", dim=[B, NH, Tq, 1], stride=[NH * Tq, Tq, 1, 1], data_type=F32)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=st, attn_scale=scale,
                                     use_causal_mask=bool(causal))
        dq.set_output(True).set_dim([B, NH, Tq, HD]).set_stride(so)
        for t in (dk, dv):
            t.set_output(True).set_dim([B, NKV, Tk, HD]).set_stride([Tk * NKV * HD, HD, NKV * HD, 1])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A])
    if g.get_execution_plan_count() < 1:
        return -1
    name = g.get_plan_name_at_index(0)  # "eng6_k24=26": engine 6, knob 24 (KERNEL_CFG) = 26
    m = re.match(r"eng(\d+)", name)
    return int(m.group(1)) if m else -1


def main():
    print("cudnn %s frontend %s" % (cudnn.backend_version(), cudnn.__version__))
    for name, d in DEVICES:
        print("device %s %s" % (name, json.dumps(dict(COMMON, **d), separators=(",", ":"))))
    for i, s in enumerate(SHAPES):
        print("shape %d %s" % (i, " ".join(str(x) for x in s)))
    for name, d in DEVICES:
        dev = dict(COMMON, **d)
        for i, s in enumerate(SHAPES):
            for bwd in (0, 1):
                print("engine %s %d %s %d" % (name, i, "bwd" if bwd else "fwd", first_engine(dev, s, bwd)))
                sys.stdout.flush()


if __name__ == "__main__":
    main()
