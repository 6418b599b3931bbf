"""A shard server's hold of layer-wise inference's hidden rows (``gnnray.store.hidden_server``), in this process."""

from __future__ import annotations

import numpy as np
import pytest

from gnnray.store.hidden_server import PIECE_BYTES, HiddenRowsHeld, piece_rows


def _rows(lo: int, hi: int, width: int = 8, shift: float = 0.0) -> np.ndarray:
    return (np.arange(lo, hi, dtype=np.float32)[:, None] + shift) * np.ones(width, dtype=np.float32)


def _read(held: HiddenRowsHeld, token: str, ids, piece: int = 3) -> np.ndarray:
    pieces = list(held.hidden(token, 0, np.asarray(ids), piece))
    assert all(len(p) <= piece for p in pieces)
    return np.concatenate(pieces) if pieces else np.zeros((0, 8), dtype=np.float32)


def test_rows_come_from_their_chunks_and_ids_outside_every_chunk_are_an_error(ray_cluster):
    held = HiddenRowsHeld()
    held.begin("t")
    held.keep("t", 0, 30, _rows(30, 40))  # chunks in any order, with a gap at 20..30
    held.keep("t", 0, 10, _rows(10, 20))
    ids = [39, 10, 15, 30, 19, 10]
    np.testing.assert_array_equal(_read(held, "t", ids), _rows(0, 40)[ids])
    for outside in ([5, 12], [25], [40], [39, 55]):  # below the first chunk, in the gap, past the last
        with pytest.raises(KeyError, match="in no chunk"):
            _read(held, "t", outside)


def test_a_late_keep_of_a_replaced_evaluation_leaves_the_current_tables(ray_cluster):
    held = HiddenRowsHeld()
    held.begin("failed")
    held.keep("failed", 0, 0, _rows(0, 10, shift=0.5))
    held.begin("current")  # the next attempt: the failed one's tables go
    assert held.hidden_bytes()["held"] == 0
    assert held.keep("current", 0, 0, _rows(0, 10)) == 10
    assert held.keep("failed", 0, 0, _rows(0, 10, shift=0.5)) == 0  # a call of the failed attempt, late
    np.testing.assert_array_equal(_read(held, "current", range(10)), _rows(0, 10))
    assert held.hidden_bytes()["held"] == _rows(0, 10).nbytes
    held.drop("failed")  # nor does its late drop touch them
    np.testing.assert_array_equal(_read(held, "current", [3]), _rows(3, 4))


def test_pieces_stay_under_rays_inline_size():
    for width in (1, 64, 512, 24_576, 100_000):
        n = piece_rows(width)
        assert n >= 1 and (n * width * 4 <= PIECE_BYTES or n == 1)
    assert piece_rows(512) * 512 * 4 < 100 * 1024 <= (piece_rows(512) + 1) * 512 * 4 + 4096
