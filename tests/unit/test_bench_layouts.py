"""bench.server's engine layouts: which stages run where and how they are wired
(pure functions; the smoke e2e test starts them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.server import BenchError, baseline, gpu, report, settings
from bench.server.args import parse_args


def _settings(layout: str, smoke: bool = False) -> settings.Settings:
    return parse_args(["--layout", layout, "--tiers", "1,8", *(["--smoke"] if smoke else [])])


def test_layout_stages():
    def placed(layout):
        return [(s.name, s.kind, s.pair, s.gpu) for s in settings.layout_stages(layout)]

    assert placed("one") == [("talker", "talker", 0, 0), ("code2wav", "code2wav", 0, 0),
                             ("gateway", "gateway", None, None)]
    assert placed("split") == [("talker", "talker", 0, 0), ("code2wav", "code2wav", 0, 1),
                               ("gateway", "gateway", None, None)]
    assert placed("two-pairs") == [("talker", "talker", 0, 0), ("code2wav", "code2wav", 0, 0),
                                   ("talker-1", "talker", 1, 1), ("code2wav-1", "code2wav", 1, 1),
                                   ("gateway", "gateway", None, None)]
    assert [settings.layout_gpus(x) for x in ("one", "split", "two-pairs")] == [1, 2, 2]
    with pytest.raises(ValueError, match="layout"):
        settings.layout_stages("three")


def test_modes_name_the_layout():
    assert _settings("one").mode == "mps-off"
    assert _settings("two-pairs").mode == "two-pairs-mps-off"
    assert _settings("split", smoke=True).mode == "split-smoke"


def test_two_pairs_configs_wire_each_code2wav_to_its_talker(tmp_path: Path):
    s = _settings("two-pairs")
    configs = settings.stage_configs(s, tmp_path, None)
    assert list(configs) == ["talker", "code2wav", "talker-1", "code2wav-1", "gateway"]
    listen = {name: c["server"]["listen"] for name, c in configs.items()}
    assert len(set(listen.values())) == 5
    assert configs["code2wav-1"]["talkers"] == {
        "consumer_id": "code2wav-1", "attach": [{"id": "talker-1", "address": listen["talker-1"]}]}
    assert configs["gateway"]["engines"]["pairs"] == [
        {"talker": listen["talker"], "code2wav": listen["code2wav"], "talker_id": "talker-0",
         "consumer_id": "code2wav-0"},
        {"talker": listen["talker-1"], "code2wav": listen["code2wav-1"], "talker_id": "talker-1",
         "consumer_id": "code2wav-1"}]
    for name in ("talker", "talker-1"):  # each engine sized for the whole top tier
        assert configs[name]["engine"]["max_num_seqs"] == 8
    assert settings.fingerprint(configs, s, None) != settings.fingerprint(
        settings.stage_configs(_settings("one"), tmp_path, None), _settings("one"), None)


def test_physical_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu.physical_gpus(2) == ["3", "5"]
    assert gpu.physical_gpus(1) == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(BenchError, match="needs 2 GPUs; this machine has 1"):
        gpu.physical_gpus(2)


def test_scale_out_table_compares_with_the_one_pair_run():
    def tier(c, audio, clean, p50):
        return {"concurrency": c, "audio_s_per_s": audio, "clean": clean, "underruns": 0 if clean else 3,
                "ttfa_ms": {"p50": p50, "p90": p50, "p99": p50 * 2},
                "gateway": {"cpu_cores_per_stream": 0.01, "cpu_ms_per_audio_s": 2.5}}

    runs = {
        "mps-off": {"layout": "one", "realtime_streams": 8,
                    "tiers": {"8": tier(8, 100.0, True, 40.0), "16": tier(16, 150.0, False, 90.0)}},
        "two-pairs-mps-off": {"layout": "two-pairs", "gpus_used": 2, "realtime_streams": 16,
                              "tiers": {"8": tier(8, 110.0, True, 35.0), "16": tier(16, 200.0, True, 45.0)}},
    }
    text = "\n".join(report.scale_out_tables(runs))
    assert "**16** against **8** (2.00x)" in text
    assert "| 16 | 150.0 | 200.0 | 1.33x | no / yes | 0.0100 | 2.50 |" in text
    # equal load per GPU: one pair's C=8 against two pairs' C=16 (not their C=8)
    assert "| 8 | 40.0 / 80.0 | 45.0 / 90.0 | 0 / 0 |" in text


def test_the_baseline_ties_the_audio_embedding_where_transformers_does_not(tmp_path):
    # transformers 5.17 loads csm checkpoints with tying off, leaving the backbone's audio
    # embedding (stored once) random: the baseline points it at the stored tensor
    transformers = pytest.importorskip("transformers")
    import torch

    from models.tiny.talker import write_tiny_checkpoint

    model = transformers.CsmForConditionalGeneration.from_pretrained(write_tiny_checkpoint(tmp_path / "tiny"))
    alias = "backbone_model.embed_tokens.embed_audio_tokens.weight"
    stored = model.get_parameter("depth_decoder.model.embed_tokens.weight")
    assert baseline._tie_audio_embeddings(model) == []  # this version already shares it
    model.backbone_model.embed_tokens.embed_audio_tokens.weight = torch.nn.Parameter(torch.randn_like(stored))
    assert baseline._tie_audio_embeddings(model) == [alias]
    assert model.get_parameter(alias) is stored


def test_clean_through_stops_at_the_first_tier_that_is_not_clean():
    tiers = {"1": {"clean": True}, "8": {"clean": True}, "32": {"clean": False}, "128": {"clean": True}}
    assert report.clean_through(tiers) == 8  # the highest clean tier (128) is reported apart
    assert report.clean_through({"1": {"clean": False}, "8": {"clean": True}}) == 0
    assert report.clean_through({}) == 0


def test_a_profiled_tier_profiles_the_engines_device_work_only_when_asked(tmp_path: Path):
    """py-spy alone by default: stopping the engines' device profiles held an engine thread for
    seconds under load, so they come only with --profile-device."""
    def profile_dirs(*extra):
        s = parse_args(["--tiers", "1,8", "--profile-tier", "8", *extra])
        configs = settings.stage_configs(s, tmp_path, None)
        return [configs[name]["metrics"].get("profile_dir") for name in ("talker", "code2wav")]

    assert profile_dirs() == [None, None]
    assert profile_dirs("--profile-device") == [str(tmp_path / settings.PROFILE_FOLDER)] * 2


def test_gateway_processes_each_serve_every_pair_and_name_the_mode(tmp_path: Path):
    assert [(s.name, s.kind) for s in settings.layout_stages("two-pairs", 2)][-2:] == [
        ("gateway", "gateway"), ("gateway-1", "gateway")]
    with pytest.raises(ValueError, match="gateways"):
        settings.layout_stages("one", 0)
    s = parse_args(["--layout", "two-pairs", "--gateways", "2", "--tiers", "1,8", "--load", "poisson"])
    assert s.mode == "two-pairs-2gw-mps-off-poisson"
    assert parse_args(["--gateways", "3", "--tiers", "8"]).mode == "3gw-mps-off"
    configs = settings.stage_configs(s, tmp_path, None)
    assert configs["gateway"]["server"]["listen"] != configs["gateway-1"]["server"]["listen"]
    assert configs["gateway"]["engines"] == configs["gateway-1"]["engines"]  # both pairs, each
    # every listener on a free port (the HTTP default, 8000, would be taken by the first gateway)
    assert configs["gateway"]["http"] == configs["gateway-1"]["http"] == {"listen": "127.0.0.1:0"}
    one = parse_args(["--layout", "two-pairs", "--tiers", "1,8", "--load", "poisson"])
    assert settings.fingerprint(configs, s, None) != settings.fingerprint(
        settings.stage_configs(one, tmp_path, None), one, None)


@pytest.mark.parametrize("argv", [["--gateways", "0"], ["--gateways", "9"],
                                  ["--gateways", "8", "--client-connections", "9"]])
def test_bad_gateway_counts_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--gateways" in capsys.readouterr().err


def test_a_tier_over_two_gateways_connects_each_evenly():
    from bench.server import load

    s = parse_args(["--gateways", "2", "--client-connections", "3", "--load", "poisson", "--tiers", "8"])
    config = load.tier_config(s, ("unix:a", "unix:b"), 8, 60.0)
    assert config.targets == ("unix:a", "unix:b") and config.connections == 6
    warm = load.warmup_configs(s, ("unix:a", "unix:b"), 30.0)
    assert {c.connections for c in warm} == {2, 6} and all(c.more_targets == ("unix:b",) for c in warm)


def test_scale_out_table_compares_gateway_processes_with_the_one_gateway_run():
    def tier(c, audio):
        return {"concurrency": c, "audio_s_per_s": audio, "clean": True, "underruns": 0,
                "ttfa_ms": {"p50": 40.0, "p90": 50.0, "p99": 60.0},
                "gateway": {"cpu_cores_per_stream": 0.01, "cpu_ms_per_audio_s": 0.8}}

    runs = {"mps-on-poisson": {"layout": "one", "realtime_streams": 8, "tiers": {"8": tier(8, 100.0)}},
            "two-pairs-2gw-mps-on-poisson": {"layout": "two-pairs", "gateways": 2, "gpus_used": 2,
                                             "realtime_streams": 16, "tiers": {"16": tier(16, 200.0)}}}
    text = "\n".join(report.scale_out_tables(runs))
    assert "### Scale-out: two-pairs-2gw-mps-on-poisson against mps-on-poisson" in text
    assert "audio-s/s, two-pairs-2gw" in text and "**16** against **8** (2.00x)" in text
    assert "spread evenly over 2 gateway processes" in report.load_text(
        "two-pairs-2gw-mps-on-poisson", {"load": "poisson", "audio_range": [2, 8], "load_seed": 0,
                                         "requests_per_stream": 2, "audio_seconds": 5.0, "gateways": 2})
