"""Tree structure, tree attention mask, position ids, and the KV-rollback invariant on real models."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from draftsmith.decoding import cache as kv
from draftsmith.decoding.generate import attention_masks
from draftsmith.decoding.tree import DraftTree, ancestor_mask, layout, position_ids, tree_attention_mask

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)


def tiny(arch: str):
    torch.manual_seed(0)
    cfg = {"llama": lambda: T.LlamaConfig(**COMMON),
           "gemma2": lambda: T.Gemma2Config(**COMMON, head_dim=8, sliding_window=4),
           "mistral": lambda: T.MistralConfig(**COMMON, sliding_window=4)}[arch]()
    return T.AutoModelForCausalLM.from_config(cfg).eval()


def test_from_paths_merges_shared_prefixes_and_lists_parents_first():
    tree, nodes = DraftTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert nodes == [[0, 1, 2], [0, 3], [4]]
    assert tree.depth.tolist() == [1, 2, 3, 2, 1]
    assert tree.children(0) == [1, 3] and tree.children(-1) == [0, 4]


def test_ancestor_mask_and_positions():
    parents = torch.tensor([-1, 0, 1, 0, -1])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],   # root
                             [1, 1, 0, 0, 0, 0],   # node 0
                             [1, 1, 1, 0, 0, 0],   # node 1 (child of 0)
                             [1, 1, 1, 1, 0, 0],   # node 2 (child of 1)
                             [1, 1, 0, 0, 1, 0],   # node 3 (child of 0)
                             [1, 0, 0, 0, 0, 1]],  # node 4 (child of root)
                            dtype=torch.bool)
    assert torch.equal(ancestor_mask(parents), expected)
    assert position_ids(parents, 10).tolist() == [[10, 11, 12, 13, 12, 11]]
    mask = tree_attention_mask(parents, 3, torch.float32)  # [1, 1, 6, 9]
    assert mask.shape == (1, 1, 6, 9) and (mask[0, 0, :, :3] == 0).all()
    assert torch.equal(mask[0, 0, :, 3:] == 0, expected)
    windowed = tree_attention_mask(parents, 3, torch.float32, sliding_window=2)[0, 0] == 0  # [6, 9]
    assert windowed[3].tolist() == [False] * 4 + [False, True, True, False, False]  # node 2 at pos 6 sees 5, 6


def test_layout_equals_a_walk_over_the_nodes_and_is_built_once_per_shape():
    """The vectorised layout (closure by squaring) against the definition, on random trees up to depth 40."""
    g = torch.Generator().manual_seed(0)
    for n in [0, 1, 2, 7, 40, 63]:
        parents = [int(torch.randint(-1, i, (), generator=g)) if i else -1 for i in range(n)]
        if n == 40:
            parents = list(range(-1, n - 1))  # a deep chain: 40 levels of ancestors
        lay = layout(torch.tensor(parents, dtype=torch.long))
        depth, seen = [0], [{0}]
        for i, p in enumerate(parents):
            depth.append(depth[p + 1] + 1)
            seen.append(seen[p + 1] | {i + 1})
        assert lay.depth.tolist() == depth and lay.height == max(depth)
        assert lay.visible.tolist() == [[j in row for j in range(n + 1)] for row in seen]
        assert lay.kids == tuple(tuple(i for i, p in enumerate(parents) if p == r - 1) for r in range(n + 1))
        assert lay.chain == (parents == list(range(-1, n - 1)))
        assert layout(torch.tensor(parents, dtype=torch.long)) is lay  # cached by shape


def test_truncate_keeps_a_prefix_closed_subtree():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5, 6]])[0]
    cut = tree.truncate(1)
    assert cut.tokens.tolist() == [1, 5] and cut.parents.tolist() == [-1, -1]
    cut = tree.truncate(2)
    assert cut.tokens.tolist() == [1, 2, 4, 5, 6] and cut.parents.tolist() == [-1, 0, 0, -1, 3]


def test_bad_tree_fails_clearly():
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


def forward_tree(model, prefix: torch.Tensor, tree: DraftTree):
    """Prefill prefix[:-1], then score [root, nodes] in one forward; returns (cache, logits [n+1, V])."""
    cache = kv.new_cache()
    model(input_ids=prefix[None, :-1], cache=cache, use_cache=True)
    n0 = cache.get_seq_length()
    out = model(input_ids=torch.cat([prefix[-1:], tree.tokens])[None], position_ids=position_ids(tree.parents, n0),
                attention_mask=attention_masks(model.config, tree.parents, n0, model.dtype), cache=cache,
                use_cache=True)
    return cache, n0, out.logits[0]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
def test_tree_logits_equal_a_plain_forward_over_each_path(arch):
    model = tiny(arch)
    prefix = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(1))
    paths = [[3, 4, 5, 6], [3, 7], [8, 9, 10]]
    tree, nodes = DraftTree.from_paths(paths)
    _, _, logits = forward_tree(model, prefix, tree)
    with torch.no_grad():
        for path, idx in zip(paths, nodes, strict=True):
            fresh = model(input_ids=torch.cat([prefix, torch.tensor(path)])[None]).logits[0]  # [L+d, V]
            torch.testing.assert_close(logits[[0] + [i + 1 for i in idx]], fresh[len(prefix) - 1:], atol=1e-5,
                                       rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("accepted", [[3, 4], [3, 7], [8], []], ids=["chain-crop", "branch", "other-root", "none"])
def test_rollback_then_continue_equals_fresh_forward(arch, accepted):
    """Invariant: after keeping root + accepted path, the next forward equals one over the committed tokens."""
    model = tiny(arch)
    prefix = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(2))
    tree, _ = DraftTree.from_paths([[3, 4, 5, 6], [3, 7], [8, 9, 10]])
    with torch.no_grad():
        cache, n0, _ = forward_tree(model, prefix, tree)
        path = DraftTree.from_paths([[3, 4, 5, 6], [3, 7], [8, 9, 10], accepted])[1][-1]
        kv.keep(cache, n0, [0] + [i + 1 for i in path])
        committed = torch.cat([prefix, torch.tensor(accepted, dtype=torch.long), torch.tensor([11])])
        assert cache.get_seq_length() == len(committed) - 1
        nxt = model(input_ids=committed[None, -1:], cache=cache, use_cache=True).logits[0, -1]
        fresh = model(input_ids=committed[None]).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, atol=1e-5, rtol=1e-4)


def test_rollback_refuses_a_cache_it_cannot_roll_back():
    model = tiny("gemma2")
    cache = T.DynamicCache(config=model.config)  # sliding layers truncate their past
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    with pytest.raises(TypeError, match="new_cache"):
        kv.keep(cache, 1, [0])
