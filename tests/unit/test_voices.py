"""The voices file is read as strictly as the stage configs."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.gateway.voices import VoiceCatalog


def _load(tmp_path, text):
    path = tmp_path / "voices.yaml"
    path.write_text(text)
    return VoiceCatalog.load(path)


def test_good_file_with_reference_clip(tmp_path):
    (tmp_path / "ref.wav").write_bytes(b"RIFF")
    catalog = _load(tmp_path, "voices:\n  - {name: a, speaker_id: 0}\n"
                              "  - {name: b, speaker_id: 3, reference_audio: ref.wav,"
                              " reference_text: hello}\n")
    assert catalog.default == "a"
    assert catalog.get("").name == "a" and catalog.get("b").speaker_id == 3
    assert catalog.get("c") is None


@pytest.mark.parametrize(("text", "needle"), [
    ("voices: []\n", "needs at least one voice"),
    ("{}\n", "missing required key voices"),
    ("voices:\n  - {name: a, speaker_id: 0}\n  - {name: a, speaker_id: 1}\n", "duplicate voice names: a"),
    ("default_voice: z\nvoices:\n  - {name: a, speaker_id: 0}\n", "default_voice: 'z' is not a voice"),
    ("voices:\n  - {name: a, speaker_id: 0, reference_text: hi}\n", "go together"),
    ("voices:\n  - {name: a, speaker_id: 0, reference_audio: none.wav, reference_text: hi}\n",
     "'none.wav' does not exist"),
    ("voices:\n  - {name: a, speaker: 0}\n", "unknown key speaker"),
    ("voices:\n  - {name: a, speaker_id: '0'}\n", "speaker_id: expected an integer"),
    ("- a\n", "expected a mapping"),
])
def test_bad_voices_files(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    assert needle in str(info.value) and "voices.yaml" in str(info.value)
