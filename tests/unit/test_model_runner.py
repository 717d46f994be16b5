"""The model runner's host-side batch preparation (the GPU paths run in tests/gpu)."""

from __future__ import annotations


def test_packed_metadata_parts_start_16_byte_aligned():
    """Each part of the eager step's packed metadata starts 16-byte aligned whatever the sizes
    (Triton compiles a kernel variant per pointer alignment), without overlapping the next."""
    from tandem.engine.cuda_graphs import packed_starts

    for lengths in ([1, 1, 1, 1, 2, 1, 3], [5, 5, 5, 0, 6, 5, 10], [4096, 4096, 4096, 7, 8, 7, 70], [0, 0, 3]):
        starts = packed_starts(lengths)
        assert len(starts) == len(lengths) + 1
        assert all(4 * a % 16 == 0 for a in starts)                        # int32 elements
        assert all(a + n <= b for a, n, b in zip(starts, lengths, starts[1:]))
        assert starts[-1] - sum(lengths) < 4 * len(lengths)                # padding only


def test_graph_input_buffers_start_16_byte_aligned():
    """The captured graphs' static inputs too: one buffer, each part 16-byte aligned, any sizes."""
    import torch

    from tandem.engine.cuda_graphs import StaticInputs

    for batch, tokens in ((48, 64), (7, 9), (64, 1024), (1, 1)):
        s = StaticInputs(batch, tokens, 5, torch.device("cpu"))
        parts = (s.input_ids, s.positions, s.slots, s.logits_rows, s.query_start_loc, s.seq_lens)
        assert [p.numel() for p in parts] == [tokens] * 4 + [batch + 1, batch]
        assert all((p.data_ptr() - s.buffer.data_ptr()) % 16 == 0 for p in parts)
        assert s.header_len % 4 == 0


def test_graph_captures_pause_the_garbage_collector():
    """engine.cuda_graphs.collector_paused (around every decode and piecewise capture): no automatic
    collection inside (one could destroy a dropped CUDAGraph and so invalidate the capture), the
    collector's state as it was after, on an exception too, and left off where it was off."""
    import gc

    import pytest

    from tandem.engine.cuda_graphs import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("a capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
