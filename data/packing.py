"""Packing of tokenized examples into fixed-length rows.

Each row carries `position_ids` that restart at 0 for every example; transformers turns
restarting position ids into a block-diagonal causal mask, so no token attends across
examples (tested in tests/test_data.py).
"""

from __future__ import annotations


def pack(examples: list[dict[str, list[int]]], seq_len: int, pad_id: int) -> list[dict[str, list[int]]]:
    """First-fit-decreasing packing of examples (each at most `seq_len` long) into rows.

    Returns rows of exactly `seq_len` tokens with input_ids, loss_mask and position_ids;
    the tail of a row is padding with loss_mask 0.
    """
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
    rows: list[list[int]] = []  # example indices per row
    free: list[int] = []
    for i in order:
        n = len(examples[i]["input_ids"])
        if n > seq_len:
            raise ValueError(f"example {i} has {n} tokens > seq_len {seq_len}; truncate or drop it first")
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    out = []
    for members in rows:
        ids, mask, pos = [], [], []
        for i in members:
            ex = examples[i]
            ids += ex["input_ids"]
            mask += ex["loss_mask"]
            pos += list(range(len(ex["input_ids"])))
        pad = seq_len - len(ids)
        out.append({"input_ids": ids + [pad_id] * pad, "loss_mask": mask + [0] * pad,
                    "position_ids": pos + list(range(pad))})
    return out
