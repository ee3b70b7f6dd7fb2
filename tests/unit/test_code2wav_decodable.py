"""Which of a record's frames Code2Wav decodes (services/code2wav/decoding.py ``decodable``): codes
outside ``[0, code_space)`` are a FrameError naming their range, frames holding a special code
(``codebook_size`` and above) are dropped; the rings' int16 codes take a one-reduction path that
must agree with the plain one."""

from __future__ import annotations

import numpy as np
import pytest

from services.code2wav.decoding import FrameError, decodable


class Codes:
    num_codebooks, codebook_size, code_space = 4, 64, 66  # two special codes (the talker's stop, pad)


@pytest.mark.parametrize("dtype", [np.int16, np.int64])
def test_in_range_frames_are_kept_and_frames_with_a_special_code_dropped(dtype):
    codes = np.array([[1, 2, 3, 63], [64, 0, 0, 0], [5, 5, 5, 65], [0, 0, 0, 0]], dtype=dtype)
    frames, dropped = decodable(Codes(), codes)
    assert dropped == 2 and frames.tolist() == [[1, 2, 3, 63], [0, 0, 0, 0]]
    kept, none = decodable(Codes(), codes[[0, 3]])
    assert none == 0 and kept.tolist() == [[1, 2, 3, 63], [0, 0, 0, 0]]


@pytest.mark.parametrize("dtype", [np.int16, np.int64])
@pytest.mark.parametrize(("bad", "says"), [(-1, "from -1 to 63"), (66, "from 0 to 66"),
                                          (-32768, "from -32768 to 63"), (32767, "from 0 to 32767")])
def test_a_code_outside_the_code_space_is_an_error_naming_the_range(dtype, bad, says):
    codes = np.array([[1, 2, 3, 63], [0, bad, 0, 0]], dtype=dtype)
    with pytest.raises(FrameError, match=f"codes outside \\[0, 66\\) \\({says}\\)"):
        decodable(Codes(), codes)


def test_frames_of_other_codebooks_are_an_error():
    with pytest.raises(FrameError, match="frames of 3 codebooks, the decoder takes 4"):
        decodable(Codes(), np.zeros((2, 3), np.int16))
