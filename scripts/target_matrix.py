"""Run the target matrix (tests/test_targets.py, its slow tests included) and write its results as docs/targets.md.

    python scripts/target_matrix.py [--out docs/targets.md]

pytest runs the matrix with a JUnit report (-m ""); each test records how far it got (`record_property`), and this
writes three tables from the report: family x method (trains, decodes losslessly, exports; or the one-line refusal,
or where it failed); which engines serve a drafter that reads the target's layers beside each family's target (vLLM's
and SGLang's from their sources: ENGINES below; llama.cpp's from the matrix's own GGUF test); and the decoder alone
with a mostly-right mock drafter (greedy chain and tree, T=1). About 3 minutes on 2 idle CPU cores; llama.cpp's GGUF
tests, where it is built (`draftsmith llama-cpp --build`), add about 6 CPU-minutes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from draftsmith.models import registry

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/test_targets.py"
TRAIN = "test_trains_decodes_losslessly_and_exports"
REFUSE = "test_what_cannot_work_is_refused_in_one_line_before_anything_is_written"
GREEDY = "test_a_mostly_right_drafter_decodes_greedily_as_the_target_past_every_window"
T1 = "test_sampling_at_t1_has_the_targets_distribution"
FIELDS = "test_the_eagle_drafter_is_built_from_the_targets_text_config"
LLAMA_CPP = "test_llama_cpp_serves_an_eagle3_gguf_losslessly_where_the_targets_graph_keeps_its_layers"


@dataclass(frozen=True)
class Builds:
    """The class an engine builds for a family's target (its registry, by the checkpoint's architecture), the file that
    holds it, and whether it lets a drafter read the target's layers: vLLM's SupportsEagle3 (EAGLE-3, P-EAGLE, DFlash
    and DSpark all ask for it); SGLang's set_eagle3_layers_to_capture (EAGLE-3) and set_dflash_layers_to_capture
    (DFlash)."""
    file: str
    cls: str
    eagle3: bool
    dflash: bool = False


# Read in the engines' PyPI wheels, vLLM 0.33.0 and SGLang 0.5.23 (where each stops: docs/targets.md, written below)
ENGINES = {  # family -> (vLLM, under vllm/model_executor/models/; SGLang, under sglang/srt/models/)
    "llama": (Builds("llama.py", "LlamaForCausalLM", True), Builds("llama.py", "LlamaForCausalLM", True, True)),
    "qwen3": (Builds("qwen3.py", "Qwen3ForCausalLM", True), Builds("qwen3.py", "Qwen3ForCausalLM", True, True)),
    "qwen3_moe": (Builds("qwen3_moe.py", "Qwen3MoeForCausalLM", True),
                  Builds("qwen3_moe.py", "Qwen3MoeForCausalLM", True, True)),
    "mixtral": (Builds("mixtral.py", "MixtralForCausalLM", False), Builds("mixtral.py", "MixtralForCausalLM", False)),
    "gpt_oss": (Builds("gpt_oss.py", "GptOssForCausalLM", True), Builds("gpt_oss.py", "GptOssForCausalLM", True, True)),
    "gemma3_text": (Builds("gemma3.py", "Gemma3ForCausalLM", False), Builds("gemma3_causal.py", "Gemma3ForCausalLM", True)),
    "gemma3": (Builds("gemma3_mm.py", "Gemma3ForConditionalGeneration", False),
               Builds("gemma3_mm.py", "Gemma3ForConditionalGeneration (its language model's: gemma3_causal.py)", True)),
    "llama4_text": (Builds("llama4.py", "Llama4ForCausalLM (a LlamaForCausalLM)", True),
                    Builds("llama4.py", "Llama4ForCausalLM (a LlamaForCausalLM)", True, True)),
    "deepseek_v3": (Builds("deepseek_v2.py", "DeepseekV3ForCausalLM (a DeepseekV2ForCausalLM)", True),
                    Builds("deepseek_v2.py", "DeepseekV3ForCausalLM (a DeepseekV2ForCausalLM)", True, True)),
    "qwen3_next": (Builds("qwen3_next.py", "Qwen3NextForCausalLM", True),
                   Builds("qwen3_next.py", "Qwen3NextForCausalLM", True, True)),
    "phi3": (Builds("phi3.py", "Phi3ForCausalLM (a LlamaForCausalLM)", True),
             Builds("llama.py", "Phi3ForCausalLM (a LlamaForCausalLM)", True, True)),
    "olmo2": (Builds("transformers/base.py", "Base (the Transformers backend, which registry.py builds for "
                     "Olmo2ForCausalLM)", True), Builds("olmo2.py", "Olmo2ForCausalLM", False)),
    "glm4_moe": (Builds("glm4_moe.py", "Glm4MoeForCausalLM", False), Builds("glm4_moe.py", "Glm4MoeForCausalLM", True)),
}


def run_tests(report: Path) -> None:
    """The matrix through pytest, its results in the JUnit `report`; failures are results too."""
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "", TEST, f"--junitxml={report}",
                    "-o", "junit_family=xunit1"], cwd=REPO)  # xunit1: the report keeps each test's properties


def results(report: Path) -> dict[tuple[str, str], dict]:
    """(test function, parameter id) -> {"outcome": passed | failed | skipped, "message": ..., recorded properties}."""
    found = {}
    for case in ET.parse(report).iter("testcase"):
        m = re.fullmatch(r"(\w+)\[(.+)\]", case.get("name"))
        if not m:
            continue
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "failed" if bad is not None else "skipped" if case.find("skipped") is not None else "passed"
        found[m[1], m[2]] = {"outcome": outcome, "message": "" if bad is None else bad.get("message", ""),
                             **{p.get("name"): p.get("value") for p in case.iter("property")}}
    return found


def cell(result: dict | None, refused: dict | None, notes: list[str]) -> str:
    """One family x method cell from its matrix test or its refusal test; a refusal's reason becomes a numbered note
    below the table."""
    if refused is not None:
        if refused["outcome"] != "passed":
            return f"refusal fails: {first_line(refused)}"
        return f"refused ({numbered(refused['refused'].split(', as ', 1)[-1], notes)})"
    if result is None:
        return "not run"
    if result["outcome"] == "passed":
        return "yes"
    reached = "lossless, export fails" if "lossless" in result else "trains, decoding fails" if "trains" in result \
        else "fails"
    return f"{reached}: {first_line(result)}"


def numbered(text: str, notes: list[str]) -> int:
    """`text`'s number in `notes` (1-based), added at the end where it is new."""
    if text not in notes:
        notes.append(text)
    return notes.index(text) + 1


def engine_cells(family: str, notes: list[str]) -> tuple[list[str], int]:
    """vLLM's and SGLang's cells for `family` (yes / no), and the number of the note that says where."""
    vllm, sglang = ENGINES[family]
    has = "implements" if vllm.eagle3 else "does not implement"
    e, d = "set_eagle3_layers_to_capture", "set_dflash_layers_to_capture"
    hooks = {(True, True): f"has {e} and {d}", (True, False): f"has {e}, not {d}",
             (False, False): f"has neither {e} nor {d}"}[sglang.eagle3, sglang.dflash]
    where = numbered(f"{family}: vllm/model_executor/models/{vllm.file}: {vllm.cls} {has} SupportsEagle3; "
                     f"sglang/srt/models/{sglang.file}: {sglang.cls} {hooks}", notes)
    return ["yes" if ok else "no" for ok in (vllm.eagle3, sglang.eagle3, sglang.dflash)], where


def llama_cpp_cell(result: dict | None, refused: str, notes: list[str]) -> str:
    """The GGUF test's finding: served losslessly, or llama-server's reason (a note), or where the test failed."""
    if result is None:
        return refused
    if result["outcome"] == "skipped":
        return "not built"
    if result["outcome"] != "passed":
        return f"fails: {first_line(result)}"
    arch, found = result["llama_cpp_arch"], result["llama_cpp"]
    if found == "served losslessly":
        return f"yes: `{arch}` served losslessly"
    return f"no: `{arch}` has no graph ({numbered(f'llama-server aborts at the first request: {found}', notes)})"


def outcome(result: dict, passed: str) -> str:
    return passed if result["outcome"] == "passed" else first_line(result)


def first_line(result: dict) -> str:
    return (result["message"].splitlines() or [result["outcome"]])[0][:100].replace("|", "/")


def write(found: dict, out: Path) -> None:
    recipes = registry.RECIPES
    families = [i for (test, i) in found if test == FIELDS]  # every family, in the test file's order
    formats = {r.key: next((v["exports"] for (t, i), v in found.items() if t == TRAIN and i.endswith(f"-{r.key}")
                            and v.get("exports")), "") for r in recipes}
    notes: list[str] = []
    head = [f"{r.name}<br>{formats[r.key].replace(' ', ', ')}" if formats[r.key] else r.name for r in recipes]
    table = ["| family | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    refused = {}  # family -> its first refusal's note, for the decoder's table
    for family in families:
        cells = [cell(found.get((TRAIN, f"{family}-{r.key}")), found.get((REFUSE, f"{family}-{r.key}")), notes)
                 for r in recipes]
        refused[family] = next((c for c in cells if c.startswith("refused")), "not run")
        table.append(f"| {family} | " + " | ".join(cells) + " |")
    engines = ["| family | vLLM: EAGLE-3, P-EAGLE, DFlash | SGLang: EAGLE-3 | SGLang: DFlash | llama.cpp: EAGLE-3 GGUF "
               "(tested) | where |", "|---|---|---|---|---|---|"]
    notes_text = "\n".join(f"({i + 1}) {reason}" for i, reason in enumerate(notes))
    first = len(notes)  # the engines' notes follow the refusals' in one numbering
    cannot: dict[str, list[str]] = {}
    for family in families:
        llama = llama_cpp_cell(found.get((LLAMA_CPP, family)), refused[family], notes)
        read, where = engine_cells(family, notes)
        cells = [*read, llama]
        engines.append(f"| {family} | " + " | ".join(cells) + f" | ({where}) |")
        for engine, c in zip(["vLLM", "SGLang EAGLE-3", "SGLang DFlash", "llama.cpp"], cells, strict=True):
            if c.startswith("no"):
                cannot.setdefault(engine, []).append(family)
    sources_text = "\n".join(f"({i + 1}) {s}" for i, s in enumerate(notes) if i >= first)
    cannot_text = "; ".join(f"{engine}: {', '.join(fs)}" for engine, fs in cannot.items())
    decoder = ["| family | greedy: chain and tree | T=1: chi-square, top 4 |", "|---|---|---|"]
    for family in families:
        greedy, t1 = found.get((GREEDY, family)), found.get((T1, family))
        decoder.append(f"| {family} | {refused[family] if greedy is None else outcome(greedy, 'lossless')} | "
                       f"{'-' if t1 is None else outcome(t1, 'exact')} |")
    out.write_text(f"""# Targets: every model family, for every method

Written by `python scripts/target_matrix.py` from the results of tests/test_targets.py, which builds each family as a
tiny random model from its own transformers config class (4 layers, hidden 32, vocabulary 300; sliding windows and
Llama 4's attention chunks of 8 tokens). A cell says what the matrix test found for that family and method: "yes" =
trained for two steps through the method's entry point, decoded greedily exactly as the target alone (every way the
method decodes: chains and trees), and exported to each format under the method's name, each loaded back by its
loader (llama.cpp's GGUF, DSpark's only format: the engines' table below and tests/test_llama_cpp.py). Tiny random
models show that the code paths work for a family, not the acceptance a trained drafter reaches on it.

{chr(10).join(table)}

{notes_text}

## Which engines serve these drafters for each family

EAGLE-3, P-EAGLE, DFlash and DSpark read hidden states from the target's inner layers, so an engine serves them
beside a target only where its implementation of that family hands those layers out. Medusa, EAGLE-1 and a distilled
draft model read only the target's last hidden state or its tokens: an engine that serves the target serves them in
the formats above (vLLM asks the target's class for nothing more; only EAGLE-3 and DFlash switch its aux hidden
states on). vLLM's and SGLang's columns are read in their sources, the PyPI wheels of vLLM 0.33.0 and SGLang 0.5.23
(each row's note names the files and classes); where one says no, the engine stops at start-up:

- vLLM: vllm/v1/worker/gpu_model_runner.py, `_setup_eagle3_aux_hidden_state_outputs`, raises "Model does not
  support EAGLE3 interface" for EAGLE-3 and DFlash where the target's class lacks SupportsEagle3 (DSpark:
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, alike). Its Transformers backend (`--model-impl
  transformers`: vllm/model_executor/models/transformers/base.py) implements SupportsEagle3 for any model; this
  matrix does not test it.
- SGLang: sglang/srt/model_executor/model_runner_components/attention_backend_setup.py,
  `configure_aux_hidden_state_capture`, raises "does not implement set_eagle3_layers_to_capture" (EAGLE-3) and
  "implements neither set_dspark_layers_to_capture nor set_dflash_layers_to_capture" (DFlash).
- llama.cpp (its converter and llama-server, tested here): each family's tiny target converts with
  convert_hf_to_gguf.py, a random EAGLE-3 drafter exports as GGUF, and llama-server serves the two; "yes" = greedy
  output equal to the target's alone, acceptance length equal to our decoder's. A graph that keeps no layer inputs
  (`res->t_layer_inp` in src/models/<arch>.cpp) makes llama-server abort at the first request. DFlash and DSpark
  read the same layer inputs (common/speculative.cpp), so they need the same graphs.

{chr(10).join(engines)}

{sources_text}

What an engine cannot serve yet, by family: {cannot_text}.

## The decoder alone

With a mock drafter that drafts the target's own continuation with a token changed every third draft (accepted most
of the time, so that nearly every step rolls the KV cache back: sliding-window layers, latent attention, MoE
routing), over 24 new tokens, three windows:

{chr(10).join(decoder)}
""")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "targets.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        run_tests(report)
        write(results(report), args.out)


if __name__ == "__main__":
    main()
