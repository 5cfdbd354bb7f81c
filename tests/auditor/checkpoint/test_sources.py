"""`sources.boxes` tiles any row-major array into contiguous boxes of bounded size, and
`FileRanges` reads exactly the bytes asked for or says which file fell short."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from numaudit.auditor.checkpoint.sources import CheckpointError, FileRanges, boxes, file_chunk

pytestmark = pytest.mark.timeout(60)

shapes = st.lists(st.integers(0, 7), max_size=4).map(tuple)


@given(shape=shapes, cap=st.integers(0, 100))
def test_boxes_tile_the_array_once_in_contiguous_bounded_boxes(shape, cap):
    n = math.prod(shape)
    index = np.arange(n).reshape(shape)  # each element's row-major position
    seen = np.zeros(shape, dtype=np.int64)
    end = 0
    for offsets, box, start in boxes(shape, cap):
        assert len(offsets) == len(box) == len(shape)
        assert all(o >= 0 and o + s <= d for o, s, d in zip(offsets, box, shape))
        where = tuple(slice(o, o + s) for o, s in zip(offsets, box))
        seen[where] += 1
        count = math.prod(box)
        assert count <= max(cap, 1)
        assert count >= 1 or n == 0  # a box of nothing only where there is nothing
        # contiguous in memory from the element it names first
        assert index[where].ravel().tolist() == list(range(start, start + count))
        # in memory order, each box where the previous ended: a file is read front to back,
        # and a chunk loaded whole (sources.tensor_chunk) is dropped after its last box
        assert start == end
        end = start + count
    assert end == n
    assert (seen == 1).all()


def test_boxes_of_a_scalar_and_of_an_empty_array():
    assert list(boxes((), 1)) == [((), (), 0)]
    assert list(boxes((), 0)) == [((), (), 0)]
    for _offsets, box, start in boxes((3, 0, 2), 1):
        assert math.prod(box) == 0 and start == 0


def test_boxes_cut_rows_only_when_a_row_exceeds_the_cap():
    # rows fit: whole rows, as many as the cap holds
    assert list(boxes((5, 4), 8)) == [((0, 0), (2, 4), 0), ((2, 0), (2, 4), 8),
                                      ((4, 0), (1, 4), 16)]
    # a row exceeds the cap: each row cut on its own, never across two rows
    assert list(boxes((2, 5), 3)) == [((0, 0), (1, 3), 0), ((0, 3), (1, 2), 3),
                                      ((1, 0), (1, 3), 5), ((1, 3), (1, 2), 8)]


def test_file_ranges_read_exact_bytes_into_the_buffer_given(tmp_path):
    path = tmp_path / "data.bin"
    t = torch.arange(20, dtype=torch.float32)
    path.write_bytes(b"head" + t.numpy().tobytes())
    files = FileRanges()
    try:
        chunk = file_chunk(files, path, 4, torch.float32, (0,), (20,))
        buffer = torch.empty(64, dtype=torch.uint8)
        got = chunk.read(5, 7, buffer)
        assert torch.equal(got, t[5:12])
        assert got.data_ptr() == buffer.data_ptr()  # read into the buffer, not a copy
        assert torch.equal(chunk.read(18, 2, None), t[18:])
        assert chunk.read(3, 0, None).numel() == 0
        assert files.bytes_read == 9 * 4
    finally:
        files.close()


def test_aligned_chunks_are_digested_from_the_mapped_file_and_others_read(tmp_path):
    # the reader's zero-copy path: a range whose first element sits at a multiple of its size
    # is a view of the file's mapped pages; a misaligned one (most DCP records) or one past the
    # end of the file is not mapped (None), so it is read, and a short file still names itself
    path = tmp_path / "data.bin"
    t = torch.arange(5000, dtype=torch.float32)
    path.write_bytes(b"head" + t.numpy().tobytes() + b"x")
    files = FileRanges()
    try:
        aligned = file_chunk(files, path, 4, torch.float32, (0,), (5000,))
        got = aligned.view(1000, 3000)
        assert got is not None and got.dtype == torch.float32
        assert torch.equal(got, t[1000:4000])
        assert files.bytes_read == 3000 * 4
        misaligned = file_chunk(files, path, 5, torch.float32, (0,), (4999,))
        assert misaligned.view(0, 10) is None
        past_end = file_chunk(files, path, 8, torch.float32, (0,), (5000,))
        assert past_end.view(0, 5000) is None
        with pytest.raises(CheckpointError, match=r"data\.bin: ends at byte"):
            past_end.read(0, 5000, None)
    finally:
        files.close()


def test_file_ranges_short_file_names_the_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10))
    files = FileRanges()
    try:
        with pytest.raises(CheckpointError, match=r"short\.bin: ends at byte 10, 6 bytes short"):
            files.read_into(path, 4, 12, None)
        with pytest.raises(CheckpointError, match="missing.bin"):
            files.read_into(tmp_path / "missing.bin", 0, 1, None)
    finally:
        files.close()
