"""The training row every source yields, and the seeded 'copy' source of the tests and smoke runs.

A row of length T holds input_ids/targets [T] int32, loss_mask [T] float32, segment_ids/positions [T] int32.
The corpus windows (pipeline.py), the synthetic retrieval rows (mixture.py) and `CopyRows` all build theirs
with `pack_row`, so the three sources agree on the format by construction.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

FEATURES = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


def pack_row(tokens: np.ndarray, doc_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Builds one training row from T+1 tokens and their document ids (-1 = padding).

    Returns input_ids/targets [T] int32, loss_mask [T] float32, segment_ids [T] int32 (1-based in order
    of appearance in the row, 0 = padding), positions [T] int32 (index within the segment).
    """
    tokens = np.asarray(tokens, np.int32)
    doc_ids = np.asarray(doc_ids, np.int64)
    inp_doc, tgt_doc = doc_ids[:-1], doc_ids[1:]
    valid = inp_doc >= 0
    seq_len = len(inp_doc)
    new_segment = np.ones(seq_len, bool)
    new_segment[1:] = inp_doc[1:] != inp_doc[:-1]
    segment_ids = np.where(valid, np.cumsum(new_segment), 0).astype(np.int32)
    idx = np.arange(seq_len)
    seg_start = np.maximum.accumulate(np.where(new_segment, idx, 0))
    positions = np.where(valid, idx - seg_start, 0).astype(np.int32)
    loss_mask = (valid & (inp_doc == tgt_doc)).astype(np.float32)
    return {
        "input_ids": tokens[:-1],
        "targets": tokens[1:],
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "positions": positions,
    }


class CopyRows(grain.MapDataset):
    """Row i: a random token block of length ⌈(T+1)/r⌉ (seeded by (seed, i)) repeated r times, cut to T+1 tokens.

    The first block is unpredictable; every later token is a copy of the token one block back, so the
    next-token loss can fall well below log V — a test source whose losses visibly move in a few steps.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, repeats: int):
        super().__init__()
        if repeats < 1:
            raise ValueError(f"CopyRows needs repeats >= 1, got {repeats}.")
        self._v, self._t, self._seed, self._r = int(vocab_size), int(seq_len), int(seed), int(repeats)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        block = -(-(self._t + 1) // self._r)
        tokens = np.random.default_rng([self._seed, int(index)]).integers(0, self._v, block, dtype=np.int64)
        row = np.tile(tokens, self._r + 1)[: self._t + 1]
        return pack_row(row, np.zeros(self._t + 1, np.int64))
