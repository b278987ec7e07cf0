"""streamgate's benchmarks, in four wings (not shipped in the runtime package):

    bench/engine/     the engine alone, in process (offline throughput against HF, scheduling,
                      decode profiles, kernels, roofline, tensor parallelism)
    bench/serving/    the gateway under a workload (serve, trace, pooled, gateway overhead,
                      quota backends; workloads/*.toml)
    bench/isolation/  one tenant attacks while another streams
    bench/peers/      streamgate against vLLM and HF under the same client

`streamgate-bench NAME` (or `python -m bench NAME`) runs one; `streamgate-bench --help` lists
them. Shared here: workload.py (the offline workload and its text), server.py (a
`streamgate serve` process), redis_server.py.
"""
