"""Measure the reference target's held-out loss and record it.

    python scripts/eval_target.py [--model models/reference-target] [--out benchmarks/reference_target.json]

Scores every held-out row (raw files and chat answers) of the stdlib corpus, in nats per
trained token, checks that this interpreter's corpus matches the one the target was trained
on, greedily answers one held-out prompt, and merges the figures into the benchmark file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train.target import measure

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REFERENCE_TARGET))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reference_target.json"))
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}; train one with: accelerate launch train/target.py")

    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.is_file() else {}
    t = time.perf_counter()
    figures = measure(args.model)
    figures["eval_seconds"] = round(time.perf_counter() - t, 1)
    if recorded.get("file_list_sha256") not in (None, figures["file_list_sha256"]):
        print(f"warning: this interpreter's stdlib (Python {figures['python_version']}) differs from the training "
              f"corpus (Python {recorded.get('python_version')}); held-out loss is measured on different files")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    prompt = load_prompts(limit=1)[0]
    ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        answer = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:]
    print(f"prompt:\n{prompt['messages'][0]['content']}\n--- greedy answer:\n{tokenizer.decode(answer)}\n---")

    recorded.update(figures)
    if "path" not in recorded:
        recorded["path"] = str(Path(args.model).resolve().relative_to(REPO))
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(json.dumps({k: figures[k] for k in ("params", "heldout_loss", "heldout_raw_loss", "heldout_chat_loss")}))


if __name__ == "__main__":
    main()
