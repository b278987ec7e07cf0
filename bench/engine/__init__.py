"""The engine alone, in process: throughput against HF (offline), scheduling traces, decode
profiles, kernels (attention, gemm, grammar masks), the roofline and tensor parallelism."""
