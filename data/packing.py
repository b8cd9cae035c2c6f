"""Packing of tokenized examples into fixed-length rows.

Each row carries `position_ids` that restart at 0 for every example; transformers turns
restarting position ids into a block-diagonal causal mask, so no token attends across
examples (tested in tests/test_data.py).
"""

from __future__ import annotations


def pack(examples: list[dict[str, list[int]]], seq_len: int, pad_id: int) -> list[dict[str, list[int]]]:
    """First-fit-decreasing packing of examples (each at most `seq_len` long) into rows, in O(n log n).

    Returns rows of exactly `seq_len` tokens with input_ids, loss_mask and position_ids;
    the tail of a row is padding with loss_mask 0.
    """
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
    size = 1
    while size < len(examples):
        size *= 2
    # Max-tree of free room per row. Leaves past the open rows are empty rows (room seq_len), so the
    # leftmost leaf with enough room is exactly first fit: an open row if one fits, else a new row.
    room = [seq_len] * (2 * size)
    rows: list[list[int]] = []  # example indices per row
    for i in order:
        n = len(examples[i]["input_ids"])
        if n > seq_len:
            raise ValueError(f"example {i} has {n} tokens > seq_len {seq_len}; truncate or drop it first")
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        if node - size == len(rows):
            rows.append([])
        rows[node - size].append(i)
        room[node] -= n
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
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
