"""Evaluation sharded over 2 gloo processes equals the one-process evaluation exactly: tau, acceptance, the
histogram and the greedy check at T=0, and the same sampled tokens at T=1 (prompt i keeps seed + i). Also in
lockstep with the target's layers sharded by FSDP2 (fully_shard), where every forward is a collective and the
prompts' decodes take different numbers of steps."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import transformers as T

from draftsmith.decoding.evaluate import Shard, evaluate, sharded
from draftsmith.decoding.proposers import PromptLookup

V, NEW = 96, 16
KEYS = ("tau", "acceptance_by_position", "accept_length_histogram", "target_forwards", "new_tokens",
        "drafted_tokens", "accepted_tokens", "sequences", "greedy_matches_target")


def build():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
                                            bos_token_id=None, pad_token_id=None)).eval()


def prompts() -> list[torch.Tensor]:
    """5 prompts (an odd count: one rank gets a share more), some repetitive (long drafts accepted), some not."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(5):
        x = torch.randint(0, V, (6 + i,), generator=g)
        out.append((torch.cat([x, x, x]) if i % 2 else x)[None])
    return out


def figures(target) -> dict:
    r = evaluate(target, PromptLookup(4), prompts(), NEW, temperatures=(0.0, 1.0), check_greedy=True)
    return {t: {k: r["by_temperature"][t][k] for k in KEYS} for t in r["by_temperature"]}


def _worker(rank: int, port: int, lockstep: bool, queue) -> None:
    from torch import distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    target = build()
    if lockstep:
        for layer in target.model.layers:
            fully_shard(layer)
    with torch.no_grad(), sharded(Shard(rank, 2, lockstep)):
        result = figures(target)
    queue.put((rank, result))
    dist.barrier()  # neither rank tears the group down while the other still talks to it
    dist.destroy_process_group()
    # FSDP2's mesh keeps the group, and gloo's C++ threads, alive past destroy_process_group: they aborted the
    # interpreter's own teardown once in CI ("terminate called without an active exception"), so the worker flushes
    # its result to the parent and ends without that teardown
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.mark.parametrize("lockstep", [False, True], ids=["ddp", "fsdp2-lockstep"])
def test_two_ranks_give_the_one_rank_figures(lockstep):
    with torch.no_grad():
        one = figures(build())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, lockstep, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert results[0] == results[1] == one
    assert one["0"]["greedy_matches_target"] and one["0"]["tau"] > 1.2  # the drafts do get accepted
