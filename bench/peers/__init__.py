"""streamgate against peer servers (vLLM, HF) under the same client; `python -m bench.peers`
runs it (run.py), `python -m bench.peers.setup` installs the peers' venvs."""
