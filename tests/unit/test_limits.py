"""services/common/limits.py: what a request may ask, one rule each, and both stages checking
with it: the audio cap's terms and which one wins, the first-audio budget's range and its one
default in the gateway's and the talker's configs, seconds to frames."""

from __future__ import annotations

import math

import pytest

from services.common.config import ConfigError, ConfigValueError, load_config
from services.common.errors import InvalidArgument
from services.common.limits import (
    FIRST_AUDIO_BUDGET_S,
    AudioCap,
    AudioLimits,
    LengthLimit,
    check_first_audio_budget,
    frames_for,
    least,
)
from services.gateway.config import GatewayConfig
from services.talker.config import TalkerConfig
from tests.conftest import REPO

RATE = 12.5
LIMITS = AudioLimits(max_audio_seconds=120.0, default_audio_seconds=30.0, text_guard_min_s=10.0,
                     text_guard_s_per_char=0.3)


def test_frames_for_forgives_float32_and_gives_at_least_one():
    assert frames_for(1.6, RATE) == 20
    assert frames_for(float.fromhex("0x1.99999ap+0"), RATE) == 20  # the float32 of 1.6
    assert frames_for(1.61, RATE) == 21
    assert frames_for(0.0, RATE) == 1


@pytest.mark.parametrize(("asked", "text", "room", "expected"), [
    (None, "x" * 200, None, AudioCap(frames_for(30.0, RATE), LengthLimit.DEFAULT)),   # guard 60 s
    (None, "Hi.", None, AudioCap(frames_for(10.0, RATE), LengthLimit.TEXT)),          # guard 10 s
    (5.0, "Hi.", None, AudioCap(frames_for(5.0, RATE), LengthLimit.REQUESTED)),
    (100.0, "x" * 1000, None, AudioCap(frames_for(100.0, RATE), LengthLimit.REQUESTED)),
    (None, "x" * 100, 50, AudioCap(50, LengthLimit.MODEL)),                            # guard 30 s
    (None, None, None, AudioCap(frames_for(30.0, RATE), LengthLimit.DEFAULT)),         # a session
    (None, "x" * 40, None, AudioCap(frames_for(12.0, RATE), LengthLimit.TEXT)),        # 0.3 s a char
])
def test_the_cap_is_the_least_term_and_names_it(asked, text, room, expected):
    assert LIMITS.cap(RATE, asked=asked, text=text, room_frames=room) == expected


def test_the_server_maximum_caps_a_large_default():
    limits = AudioLimits(max_audio_seconds=20.0, text_guard_min_s=50.0)  # the default: the maximum
    assert limits.cap(RATE, asked=None, text="x") == AudioCap(frames_for(20.0, RATE), LengthLimit.DEFAULT)
    assert limits.cap(RATE, asked=20.0, text="x").limit is LengthLimit.REQUESTED  # ties: the first term
    assert least(AudioCap(5, LengthLimit.SERVER), AudioCap(5, LengthLimit.TEXT)).limit is LengthLimit.SERVER


def test_the_guard_counts_characters_without_surrounding_space():
    assert LIMITS.text_guard_s("  " + "x" * 100 + "\n") == pytest.approx(30.0)
    assert LIMITS.text_guard_s("x") == 10.0


@pytest.mark.parametrize("seconds", [0.0, -1.0, 120.5, math.nan, math.inf])
def test_asking_outside_the_range_names_the_field(seconds):
    with pytest.raises(ConfigValueError) as info:
        LIMITS.check_asked(seconds)
    assert info.value.key == "max_audio_seconds" and "(0, 120]" in info.value.reason


@pytest.mark.parametrize(("fields", "key"), [
    ({"max_audio_seconds": 0.0}, "max_audio_seconds"),
    ({"default_audio_seconds": 700.0}, "default_audio_seconds"),
    ({"text_guard_min_s": math.nan}, "text_guard_min_s"),
    ({"text_guard_s_per_char": -0.1}, "text_guard_s_per_char"),
])
def test_the_server_terms_check_themselves(fields, key):
    with pytest.raises(ConfigValueError) as info:
        AudioLimits(**fields)
    assert info.value.key == key


@pytest.mark.parametrize("seconds", [-0.01, 60.0, math.nan, 3599.0])
def test_the_first_audio_budget_has_one_range(seconds):
    with pytest.raises(ConfigValueError, match=r"\[0, 60\)"):
        check_first_audio_budget(seconds)
    assert check_first_audio_budget(0.0) == 0.0 and check_first_audio_budget(59.9) == 59.9


def test_both_stages_default_to_the_one_budget_and_refuse_the_same_values():
    gateway = load_config(GatewayConfig, REPO / "deploy/configs/gateway.yaml", "gateway", environ={})
    talker = load_config(TalkerConfig, REPO / "deploy/configs/talker.yaml", "talker", environ={})
    budgets = gateway.admission.first_audio_budget_s, talker.engine.first_audio_budget_s
    assert budgets == (FIRST_AUDIO_BUDGET_S, FIRST_AUDIO_BUDGET_S)
    assert GatewayConfig().admission.first_audio_budget_s == TalkerConfig().engine.first_audio_budget_s
    for stage, cls, section in (("gateway", GatewayConfig, "ADMISSION"), ("talker", TalkerConfig, "ENGINE")):
        env = {f"VOXRING_{stage.upper()}__{section}__FIRST_AUDIO_BUDGET_S": "60"}
        with pytest.raises(ConfigError, match=r"FIRST_AUDIO_BUDGET_S: must be in \[0, 60\)"):
            load_config(cls, None, stage, environ=env)


def test_the_shipped_gateway_config_states_the_defaults():
    shipped = load_config(GatewayConfig, REPO / "deploy/configs/gateway.yaml", "gateway", environ={}).limits
    defaults = GatewayConfig().limits
    for key in ("max_audio_seconds", "default_audio_seconds", "text_guard_min_s", "text_guard_s_per_char"):
        assert getattr(shipped, key) == getattr(defaults, key) == getattr(AudioLimits(), key), key


def test_the_talker_refuses_a_submit_or_append_budget_out_of_range():
    from services.talker.servicer import _check_budget
    with pytest.raises(InvalidArgument) as info:
        _check_budget(61.0)
    assert info.value.field == "first_audio_budget_s"
    _check_budget(0.0)
