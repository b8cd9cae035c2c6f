"""Run the target matrix (tests/test_targets.py, its slow tests included) and write its results as docs/targets.md.

    python scripts/target_matrix.py [--out docs/targets.md]

pytest runs the matrix with a JUnit report (-m ""); each test records how far it got (`record_property`), and this
writes two tables from the report: family x method (trains, decodes losslessly, exports; or the one-line refusal, or
where it failed), and the decoder alone with a mostly-right mock drafter (greedy chain and tree, T=1). About 3 minutes
on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from draftsmith.models import registry

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/test_targets.py"
TRAIN = "test_trains_decodes_losslessly_and_exports"
REFUSE = "test_what_cannot_work_is_refused_in_one_line_before_anything_is_written"
GREEDY = "test_a_mostly_right_drafter_decodes_greedily_as_the_target_past_every_window"
T1 = "test_sampling_at_t1_has_the_targets_distribution"
FIELDS = "test_the_eagle_drafter_is_built_from_the_targets_text_config"


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
        reason = refused["refused"].split(", as ", 1)[-1]
        if reason not in notes:
            notes.append(reason)
        return f"refused ({notes.index(reason) + 1})"
    if result is None:
        return "not run"
    if result["outcome"] == "passed":
        return "yes"
    reached = "lossless, export fails" if "lossless" in result else "trains, decoding fails" if "trains" in result \
        else "fails"
    return f"{reached}: {first_line(result)}"


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
    decoder = ["| family | greedy: chain and tree | T=1: chi-square, top 4 |", "|---|---|---|"]
    for family in families:
        greedy, t1 = found.get((GREEDY, family)), found.get((T1, family))
        decoder.append(f"| {family} | {refused[family] if greedy is None else outcome(greedy, 'lossless')} | "
                       f"{'-' if t1 is None else outcome(t1, 'exact')} |")
    notes_text = "\n".join(f"({i + 1}) {reason}" for i, reason in enumerate(notes))
    out.write_text(f"""# Targets: every model family, for every method

Written by `python scripts/target_matrix.py` from the results of tests/test_targets.py, which builds each family as a
tiny random model from its own transformers config class (4 layers, hidden 32, vocabulary 300; sliding windows and
Llama 4's attention chunks of 8 tokens). A cell says what the matrix test found for that family and method: "yes" =
trained for two steps through the method's entry point, decoded greedily exactly as the target alone (every way the
method decodes: chains and trees), and exported to each format under the method's name, each loaded back by its
loader (llama.cpp's GGUF, DSpark's only format: tests/test_llama_cpp.py). Tiny random models show that the code
paths work for a family, not the acceptance a trained drafter reaches on it.

{chr(10).join(table)}

{notes_text}

The decoder alone, with a mock drafter that drafts the target's own continuation with a token changed every third
draft (accepted most of the time, so that nearly every step rolls the KV cache back: sliding-window layers, latent
attention, MoE routing), over 24 new tokens, three windows:

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
