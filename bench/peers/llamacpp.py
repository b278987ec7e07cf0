"""llama.cpp's own server as a peer: `llama-server`, built on this host from the llama.cpp that
the PyPI sdist of llama-cpp-python vendors, serving the model converted to GGUF by that
llama.cpp's own `convert_hf_to_gguf.py`.

Why llama-server and not llama-cpp-python's server: the latter runs one request at a time;
llama-server batches its slots' decode rows into one forward (continuous batching, on by
default), as vLLM and streamgate do. It is built with `GGML_NATIVE` (every instruction set this
CPU has, as streamgate's kernels are) and started with one slot per stream of the largest
level, each slot holding a prompt and its output (`--parallel`, `--ctx-size`), and `--threads`
set to the host's cores.

A spec's flags go to llama-server, except `--outtype T` (default bf16), which chooses the
GGUF's weights (`convert_hf_to_gguf.py --outtype`: f32, f16, bf16, q8_0). Example:
`llamacpp-bf16=llamacpp:--outtype bf16`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"          # vendors llama.cpp (ggml commit 0c1e570)
CONVERT_DEPS = ("transformers==5.24.0", "sentencepiece", "safetensors", "numpy", "pyyaml", "tqdm", "requests",
                "protobuf")
PARALLEL = 32                               # slots: the largest level's streams
SLOT_TOKENS = 1024                          # a prompt (~286 tokens) and its output, with room


def _run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def source(root: Path) -> Path:
    """The vendored llama.cpp tree under root/src (after install)."""
    found = sorted((root / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise FileNotFoundError(f"no llama.cpp source under {root / 'src'} "
                                "(python -m bench.peers.setup --only llamacpp)")
    return found[-1]


def server_binary(root: Path) -> Path:
    return root / "build" / "bin" / "llama-server"


def install(root: Path, python: Path, torch_req: str) -> None:
    """The converter's venv (`python`, made by the caller), the source, and llama-server built
    from it (5.4 minutes on 2 Zen 4 cores from an empty directory). Each step is skipped when done."""
    if subprocess.run([str(python), "-c", "import sentencepiece, transformers, torch"], capture_output=True).returncode:
        _run([str(python), "-m", "pip", "install", "--quiet", torch_req])
        _run([str(python), "-m", "pip", "install", "--quiet", *CONVERT_DEPS])
    src = root / "src"
    if not list(src.glob("llama_cpp_python-*/vendor/llama.cpp")):
        src.mkdir(parents=True, exist_ok=True)
        _run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(src),
              SDIST])
        with tarfile.open(next(src.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(src, filter="data")
    if not server_binary(root).exists():
        build = root / "build"
        _run(["cmake", "-S", str(source(root)), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)])


def split_flags(flags: tuple[str, ...]) -> tuple[str, list[str]]:
    """(`--outtype`'s value, the flags left for llama-server)."""
    rest, outtype, it = [], "bf16", iter(flags)
    for flag in it:
        if flag == "--outtype":
            outtype = next(it, "bf16")
        elif flag.startswith("--outtype="):
            outtype = flag.split("=", 1)[1]
        else:
            rest.append(flag)
    return outtype, rest


def gguf(root: Path, model_dir: str, outtype: str) -> Path:
    """The model as GGUF (converted once, kept under root/models)."""
    out = root / "models" / f"{Path(model_dir).name}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        _run([str(root / "bin" / "python"), str(source(root) / "convert_hf_to_gguf.py"), model_dir,
              "--outtype", outtype, "--outfile", str(tmp)], stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def command(binary: str, model_dir: str, port: int, flags: tuple[str, ...]) -> list[str]:
    """llama-server's command line for one spec (converting the model first if needed)."""
    root = Path(binary).parents[2]
    outtype, rest = split_flags(flags)
    return [binary, "--model", str(gguf(root, model_dir, outtype)), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(os.cpu_count() or 1), "--parallel", str(PARALLEL),
            "--ctx-size", str(PARALLEL * SLOT_TOKENS), "--no-webui", *rest]
