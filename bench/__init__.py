"""Benchmarks for streamgate: workloads, HF baselines and the offline throughput run.

`python -m bench.offline` runs the engine and the Hugging Face baselines on one fixed
workload and prints a comparison table (see `bench/offline.py`).
"""
