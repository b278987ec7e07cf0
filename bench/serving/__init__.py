"""The gateway under a workload: TOML workloads (workloads/), a load generator and replay,
drivers (WebSocket, SSE, in process, HF), per-request statistics, fairness traces, pooled
seeds, the gateway's own overhead and the quota backends."""
