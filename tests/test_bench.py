"""The leaderboard harness (draftsmith bench, train/bench.py): the speedup model by hand (decoding/cost.py), and a
real run on a tiny target."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftsmith.decoding import cost
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.train import bench as leaderboard


def bench():
    return leaderboard


def test_predicted_speedup_matches_hand_values():
    f = cost.predicted_speedup
    assert f(0.5, 0.1, 2) == pytest.approx((1 - 0.5 ** 3) / (0.5 * 1.2))  # 1.4583
    assert f(0.0, 0.2, 3) == pytest.approx(1 / 1.6)  # nothing accepted: only the bonus token, drafting wasted
    assert f(1.0, 0.0, 4) == pytest.approx(5.0)  # everything accepted, free drafter: gamma + 1 tokens per forward
    assert f(0.8, 0.05, 1) == pytest.approx(1.8 / 1.05)


def test_speedup_model_reads_alpha_and_c_from_the_decode_statistics():
    stats = DecodeStats(steps=10, drafted=40, drafter_s=0.2, target_s=1.0,
                        reached=Counter({1: 10, 2: 6, 3: 3}), passed=Counter({1: 6, 2: 3, 3: 1}))
    rel = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}  # a CPU-like verify-cost curve
    m = cost.speedup_model(stats, gamma=4, max_gamma=8, rel=rel, plain_step_s=0.05)
    alpha, c = 10 / 19, (0.2 / 40) / (1.0 / 10)  # accepted / offered positions; 5 ms per drafted token / 100 ms
    c_plain = (0.2 / 40) / 0.05  # 5 ms per drafted token / a 50 ms plain step
    assert m["alpha"] == pytest.approx(alpha) and m["c"] == pytest.approx(c) and m["c_plain"] == pytest.approx(c_plain)
    v = {2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8, 6: 2.0, 7: 2.2, 8: 2.4, 9: 2.6}  # v(k), interpolated and extrapolated
    by_hand = {g: (1 - alpha ** (g + 1)) / (1 - alpha) / (v[g + 1] + g * c_plain) for g in range(1, 9)}
    assert m["predicted_speedup"] == pytest.approx(by_hand[4])
    assert m["predicted_speedup_flat"] == pytest.approx((1 - alpha ** 5) / ((1 - alpha) * (1 + 4 * c)))
    assert m["predicted_tau"] == pytest.approx((1 - alpha ** 5) / (1 - alpha))
    assert m["gamma_star"] == max(by_hand, key=by_hand.get) == 1  # on this curve every extra draft costs more than it brings
    assert cost.speedup_model(stats, 2, 2, rel, 0.05)["gamma_star"] <= 2  # Medusa: no more heads than it has


def test_merge_compares_the_reference_target_and_prompts_by_their_place_in_the_checkout():
    portable = bench()._portable
    assert portable("/work/main/models/reference-target") == portable("/tmp/x/models/reference-target")
    assert portable("/a/data/reference_prompts.jsonl") == "data/reference_prompts.jsonl"
    assert portable("/a/my-target") == "/a/my-target" and portable(20) == 20  # anything else compares as it is


def test_unavailable_method_is_reported_not_raised():
    b = bench()
    missing = b.Method("nope", "Nope", None, "train/nope.py", "recipes/nope.yaml")
    assert b.unavailable(missing) == "not available: train/nope.py does not exist"
    assert b.unavailable(b.BY_KEY["ngram"]) is None


@pytest.fixture(scope="module")
def first_run(tiny_chat_target, tmp_path_factory):
    """Train Medusa-1 on the tiny target under a 0.3 s budget, then evaluate it with n-gram and a draft model."""
    out = tmp_path_factory.mktemp("bench")
    args = ["--target", str(tiny_chat_target), "--methods", "ngram", "suffix", "draft", "medusa1", "--num-prompts", "2",
            "--max-new-tokens", "8", "--runs-dir", str(out / "runs"), "--budget-minutes", "0.005",
            "--override", "data.limit=48", "data.max_length=128", "data.cache=false", "loop.batch_size=2",
            "loop.max_steps=500", "loop.save_every=3", "eval.heldout_examples=6", "eval.num_prompts=1",
            "eval.max_new_tokens=4", "eval.tree_budget=6", "eval.tree_ranks=3"]
    return out, args, bench().main([*args, "--out", str(out / "first" / "leaderboard.json")])


def test_budget_caps_training_and_the_run_is_recorded(first_run):
    out, _, board = first_run
    t = board["methods"]["medusa1"]["training"]
    assert not t["reused"] and t["max_minutes"] == 0.005
    assert t["train_seconds"] >= 0.3 and t["steps"] < 500  # stopped by the budget, not by max_steps
    assert (out / "runs" / "medusa1" / "config.yaml").is_file()
    assert t["curve"] and t["curve"][-1][0] == t["steps"]  # tau at every checkpoint, the last one included


def test_every_method_is_lossless_and_the_outputs_are_written(first_run):
    out, _, board = first_run
    assert [board["methods"][k]["status"] for k in ("ngram", "suffix", "draft", "medusa1")] == ["ok"] * 4
    assert set(board["methods"]["suffix"]["variants"]) == {"chain", "tree"}
    assert set(board["methods"]["medusa1"]["variants"]) == {"chain", "tree"}
    for entry in board["methods"].values():
        for row in entry["variants"].values():
            assert row["by_temperature"]["0"]["greedy_matches_target"] is True
            assert row["by_temperature"]["1"]["greedy_matches_target"] is None
            assert row["by_temperature"]["0"]["tau"] >= 1 and row["by_temperature"]["0"]["speedup"] > 0
    medusa, draft = board["methods"]["medusa1"]["variants"], board["methods"]["draft"]["variants"]["chain"]
    assert medusa["chain"]["new_params"] == medusa["chain"]["drafter_params"] > 0  # heads: all new
    assert draft["new_params"] == 0 < draft["drafter_params"]  # the truncated copy shares the target's weights
    m = draft["speedup_model"]
    assert m["gamma"] == 5 and 0 <= m["alpha"] <= 1 and m["c"] > 0 and 1 <= m["gamma_star"] <= 8
    table = (out / "first" / "leaderboard.md").read_text()
    assert "| Medusa-1 | tree |" in table and "| prompt lookup (n-gram) | chain |" in table
    c = cost.drafting_cost(draft["by_temperature"]["0"])
    assert c == pytest.approx(m["c"], rel=1e-2) and f"| {c:.3f} |" in table  # c beside tau (from rounded JSON)
    assert (out / "first" / "leaderboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # its three plots
    assert sorted(p.name for p in (out / "first").glob("*.png")) == ["leaderboard.png"]


def test_real_target_rows_keep_budget_tokens_tau_and_both_speedups_per_method(first_run):
    out, _, board = first_run
    rows = bench().real_target_rows(board)
    medusa, ngram = rows["methods"]["medusa1"], rows["methods"]["ngram"]
    t = board["methods"]["medusa1"]["training"]
    assert medusa["budget_minutes"] == 0.005 and medusa["steps"] == t["steps"] > 0
    assert medusa["tokens_seen"] == t["steps"] * 2 * 128  # steps x batch 2 x packed rows of 128
    table = (out / "first" / "leaderboard.md").read_text()
    assert f"| {t['steps']} steps ({t['steps'] * 256 / 1e3:.0f}k tokens), " in table
    chain = medusa["variants"]["chain"]
    assert chain["T=0"]["greedy_matches_target"] is True and chain["T=1"]["greedy_matches_target"] is None
    assert chain["T=0"]["tau"] == board["methods"]["medusa1"]["variants"]["chain"]["by_temperature"]["0"]["tau"]
    model = board["methods"]["medusa1"]["variants"]["chain"]["speedup_model"]
    assert chain["speedup_model"]["predicted_speedup"] == model["predicted_speedup"]
    assert chain["speedup_model"]["measured_speedup"] == chain["T=0"]["speedup"]
    assert ngram["steps"] is None and ngram["tokens_seen"] is None and set(ngram["variants"]) == {"chain"}
    assert rows["budget_minutes"] == 0.005 and rows["num_prompts"] == 2


def test_reuse_reevaluates_without_training_and_gives_the_same_greedy_numbers(first_run):
    out, args, first = first_run
    again = bench().main([*args, "--reuse", "--out", str(out / "again" / "leaderboard.json")])
    assert again["methods"]["medusa1"]["training"]["reused"]
    assert again["methods"]["medusa1"]["training"]["steps"] == first["methods"]["medusa1"]["training"]["steps"]
    same = ("tau", "acceptance_by_position", "accept_length_histogram", "new_tokens", "target_forwards",
            "greedy_matches_target")
    for key, entry in first["methods"].items():
        for variant, row in entry["variants"].items():
            for t in ("0", "1"):  # greedy, and sampling with the same seeds
                a, b = row["by_temperature"][t], again["methods"][key]["variants"][variant]["by_temperature"][t]
                assert {k: a[k] for k in same} == {k: b[k] for k in same}, (key, variant, t)
    assert json.loads((out / "again" / "leaderboard.json").read_text())["settings"]["reuse"] is True


def test_merge_adds_methods_to_a_leaderboard_with_the_same_settings(first_run, tmp_path):
    out, args, _ = first_run
    board = tmp_path / "leaderboard.json"
    board.write_text((out / "first" / "leaderboard.json").read_text())
    only = [a for a in args if a not in ("suffix", "draft", "medusa1")]  # --methods ngram
    merged = bench().main([*only, "--merge", "--out", str(board)])
    assert list(merged["methods"]) == ["ngram", "suffix", "draft", "medusa1"] and len(merged["settings"]["earlier"]) == 1
    assert "draft" in json.loads(board.read_text())["methods"]
    with pytest.raises(SystemExit, match="max_new_tokens"):
        bench().main([*only, "--max-new-tokens", "4", "--merge", "--out", str(board)])


def test_run_names_an_existing_run_and_bad_ones_fail_in_one_line(first_run, tmp_path):
    out, args, _ = first_run
    only = [a for a in args if a not in ("ngram", "suffix", "draft")]  # --methods medusa1
    with pytest.raises(SystemExit, match="not a trained method"):
        bench().main([*only, "--run", "ngram=x", "--out", str(tmp_path / "a.json")])
    board = bench().main([*only, "--run", f"medusa1={tmp_path}", "--out", str(tmp_path / "b.json")])
    assert board["methods"]["medusa1"]["status"] == f"failed: --run medusa1={tmp_path}: no drafter there " \
                                                    "(no drafter.json, best/ or checkpoint)"
