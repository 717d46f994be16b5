"""Draft trees as flat node arrays, and what verifying one needs. Pure Python, no torch.

A tree of n draft nodes is `token_ids[n]` and `parents[n]`: node i's parent is node parents[i]
(parents[i] < i, so every prefix of the arrays is itself a tree), or -1 for a child of the root,
the sequence's last token. A chain is the tree with parents [-1, 0, 1, ...].

Verifying a tree runs 1 + n query rows per sequence in one forward: row 0 is the root (the last
token), row 1 + i is node i. Row r sits at rotary position `root position + depth(r)` and is
written to the KV slot of position `root position + r` (the sequence's next 1 + n slots act as
scratch). Row r attends to the context and to the rows of its ancestors and itself:
`ancestor_masks` gives that set as a bitmask over the rows (bit s: row s), which the attention
paths take as `AttentionMetadata.tree_mask`. After acceptance the accepted path's node at depth d
must hold the KV of position root + d: `kv_moves` says which rows to copy where (none for a chain).
"""

from __future__ import annotations

MAX_TREE_ROWS = 64  # root + nodes: the ancestor mask is one int64 per query row


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def check_tree(parents: list[int]) -> None:
    """Refuse parent arrays that are not a tree in this layout (the engine would attend wrong)."""
    if len(parents) + 1 > MAX_TREE_ROWS:
        raise ValueError(f"a draft tree has at most {MAX_TREE_ROWS - 1} nodes, got {len(parents)}")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents must come first (-1: the root)")


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for the root's children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def ancestor_masks(parents: list[int]) -> list[int]:
    """Per query row (root first): the rows it sees among the tree's, itself included, as bits."""
    masks = [1]
    for i, p in enumerate(parents):
        masks.append(masks[p + 1] | (1 << (i + 1)))
    return masks


def children(parents: list[int]) -> list[list[int]]:
    """Per row (root first): the nodes whose parent it is, in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def accept_tree_greedy(target_ids: list[int], token_ids: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """target_ids: the target's argmax at each of the 1 + n rows. -> (the accepted nodes, root to
    leaf; the new tokens: their tokens and then the target's token after the last of them). The
    longest root path whose every token equals the target's argmax at its parent."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        want = target_ids[row]
        nxt = next((c for c in kids[row] if token_ids[c] == want), None)
        if nxt is None:
            return path, [token_ids[c] for c in path] + [want]
        path.append(nxt)
        row = nxt + 1


def kv_moves(path: list[int]) -> list[tuple[int, int]]:
    """(source row, destination row) pairs that put the accepted path's KV at the sequence's next
    positions: the node at depth d (row path[d - 1] + 1) goes to row d. A source row is never
    below its destination (a node's ancestors come before it), so copying all at once is safe."""
    return [(node + 1, depth) for depth, node in enumerate(path, start=1) if node + 1 != depth]
