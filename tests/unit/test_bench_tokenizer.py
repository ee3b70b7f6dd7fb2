"""The benchmark checkpoint's tokenizers (bench/server/bpe_tokenizer.py, checkpoint.py): the
committed BPE makes 1.2 to 1.5 tokens a word of the load's corpus, was trained on text that
holds none of the corpus's sentences (and is reproduced from it), keeps the CSM special
tokens at the ids config.json declares; a checkpoint written with it loads through the
talker's loader and its prompts encode as the gateway encodes them; the harness names a
byte-level run apart and never reuses a checkpoint of the other tokenizer."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from bench.server import bpe_tokenizer, checkpoint, report, settings
from bench.server.args import parse_args
from models.tiny.talker import SPECIAL_TOKENS, build_tokenizer

CONFIG_FIELDS = {"bos_token_id": SPECIAL_TOKENS[0], "pad_token_id": SPECIAL_TOKENS[2],
                 "audio_token_id": SPECIAL_TOKENS[2], "audio_eos_token_id": SPECIAL_TOKENS[3]}


@pytest.fixture(scope="module")
def stdlib_lines() -> list[str]:
    return bpe_tokenizer.stdlib_lines()  # a few seconds: every standard library module parsed


def _bench_sentences() -> list[str]:
    """Every text a default ``--load poisson`` run sends (its tiers' and warm-up's schedules),
    and the sentences the tokens-per-word figure is measured on."""
    from bench.server.load import tier_config, warmup_configs
    from voxring.loadgen import schedule

    s = parse_args(["--load", "poisson"])
    configs = [tier_config(s, ("unix:unused",), c, 60.0) for c in s.tiers]
    configs += warmup_configs(s, ("unix:unused",), 60.0)
    sent = {arrival.text for config in configs for arrival in schedule(config)}
    return sorted(sent | set(bpe_tokenizer.measure_texts()))


def _shared(training: list[str], sentences: list[str]) -> list[str]:
    text = "\n".join(training).lower()
    return [sentence for sentence in sentences if sentence.lower() in text]


def test_the_committed_bpe_makes_1_2_to_1_5_tokens_a_word_of_the_corpus():
    texts = bpe_tokenizer.measure_texts()
    bpe = bpe_tokenizer.tokens_per_word(bpe_tokenizer.load(), texts)
    assert 1.2 <= bpe <= 1.5
    assert bpe_tokenizer.tokens_per_word(build_tokenizer(), texts) > 4 * bpe  # the byte-level load's
    assert bpe_tokenizer.load().get_vocab_size() == bpe_tokenizer.VOCAB_SIZE + len(SPECIAL_TOKENS)


def test_the_training_text_holds_no_sentence_of_the_corpus(stdlib_lines):
    sentences = _bench_sentences()
    assert len(sentences) > 6000
    prose = bpe_tokenizer.prose_paragraphs()
    assert sum(len(p.split()) for p in prose) > 8000 and len(stdlib_lines) > 10000
    assert _shared(prose + stdlib_lines, sentences) == []
    assert not any("voxring" in p for p in prose)  # the file's header is not training text
    planted = [f"as it says: {sentences[0].upper()} and more"]  # the check finds one where there is one
    assert _shared(planted, sentences) == [sentences[0]]


def test_training_reproduces_the_committed_file(stdlib_lines):
    if bpe_tokenizer.stdlib_sha256(stdlib_lines) != bpe_tokenizer.TRAINED_ON["stdlib_sha256"]:
        pytest.skip(f"another standard library than the one trained on ({bpe_tokenizer.TRAINED_ON})")
    trained = bpe_tokenizer.train(stdlib_lines, bpe_tokenizer.prose_paragraphs())
    assert bpe_tokenizer.to_json(trained) == bpe_tokenizer.TOKENIZER_JSON.read_text(encoding="utf-8")


@pytest.mark.parametrize("kind", checkpoint.TOKENIZERS)
def test_special_tokens_round_trip_to_the_ids_config_json_declares(kind):
    config = checkpoint.full_config("bfloat16", kind)  # csm-1b's config: no weights drawn
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_json(kind))
    for field, token in CONFIG_FIELDS.items():
        assert tokenizer.token_to_id(token) == config[field], field
        assert tokenizer.id_to_token(config[field]) == token
        assert tokenizer.encode(f"x{token}y", add_special_tokens=False).tokens[1] == token  # kept whole
    assert tokenizer.get_vocab_size() <= config["text_vocab_size"]
    ids = tokenizer.encode("Hello there.").ids
    assert (ids[0], ids[-1]) == (config["bos_token_id"], tokenizer.token_to_id(SPECIAL_TOKENS[1]))
    if kind == "byte":  # the byte-level tokenizer's ids, as before there was a choice
        assert [config[f] for f in CONFIG_FIELDS] == [256, 258, 258, 259]


def test_a_bpe_checkpoint_loads_through_the_talkers_loader_and_its_prompts_encode(tmp_path):
    from models.csm.loader import load_talker
    from models.family import PromptSegment
    from services.gateway.routing import ModelFacts
    from services.talker.__main__ import model_info

    # voxring-tiny's layers with csm-1b's text vocabulary: the tokenizer, config and loader as written
    # for the GPU, without writing 1.6 B parameters
    folder = checkpoint.write_full_checkpoint(tmp_path / "ckpt", dtype="bfloat16", device="cpu",
                                              tokenizer="bpe", shapes="tiny")
    config = json.loads((folder / "config.json").read_text())
    assert json.loads((folder / "voxring.json").read_text())["tokenizer"] == "bpe"
    names = json.loads((folder / "tokenizer_config.json").read_text())
    model = load_talker(folder, "float32", "cpu")
    info = model_info(folder, model, 512)  # what the talker serves the gateway
    assert info.tokenizer_json == bpe_tokenizer.TOKENIZER_JSON.read_bytes()
    facts = ModelFacts(name=info.model_name, tokenizer=Tokenizer.from_str(info.tokenizer_json.decode()),
                       prompt_format=info.prompt_format, max_len=info.max_len,
                       num_codebooks=info.num_codebooks, frame_rate=info.frame_rate,
                       sample_rate=info.sample_rate)
    text = bpe_tokenizer.measure_texts()[0]
    ids = facts.prompt_ids(0, text)
    assert ids[0] == config["bos_token_id"] == facts.tokenizer.token_to_id(names["bos_token"])
    assert ids[-1] == facts.tokenizer.token_to_id(names["eos_token"])
    assert max(ids) < config["text_vocab_size"] == model.config.text_vocab_size == 128256
    assert len(ids) < 2 * len(text.split()) + 6 < len(text.encode())  # words, not bytes
    embeds = model.prompt_embeds([PromptSegment(text_token_ids=ids)])  # the ids index its embedding
    assert tuple(embeds.shape) == (len(ids), model.config.backbone.hidden_size)


def test_the_cached_checkpoint_of_one_tokenizer_is_not_reused_for_the_other(tmp_path, monkeypatch):
    written = []

    def write(folder, seed, dtype, device, tokenizer):  # the folder's marker, not 3 GB of weights
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "voxring.json").write_text(json.dumps({"tokenizer": tokenizer}))
        written.append(tokenizer)

    monkeypatch.setattr(checkpoint, "write_full_checkpoint", write)
    byte, fresh = checkpoint.ensure_full_checkpoint(tmp_path, tokenizer="byte")
    bpe, fresh_bpe = checkpoint.ensure_full_checkpoint(tmp_path, tokenizer="bpe")
    again, fresh_again = checkpoint.ensure_full_checkpoint(tmp_path, tokenizer="byte")
    assert (fresh, fresh_bpe, fresh_again) == (True, True, False) and written == ["byte", "bpe"]
    assert byte != bpe and again == byte
    assert json.loads((bpe / "voxring.json").read_text())["tokenizer"] == "bpe"
    assert bpe.name == checkpoint.checkpoint_name(tokenizer="bpe")
    assert bpe.name.endswith(f"-bpe-{checkpoint.tokenizer_digest('bpe')}")  # a retrained BPE: another


def test_the_tokenizer_option_names_the_result_file_and_is_recorded():
    def parsed(*args):
        return parse_args(list(args))

    assert tuple(settings.TOKENIZERS) == checkpoint.TOKENIZERS and settings.DEFAULT_TOKENIZER == "bpe"
    assert (parsed().tokenizer, parsed().mode) == ("bpe", "mps-off")  # the default keeps the plain names
    assert parsed("--load", "poisson").mode == "mps-off-poisson"
    assert parsed("--load", "poisson", "--tokenizer", "byte").mode == "mps-off-byte-poisson"
    assert parsed("--tokenizer", "byte", "--mps", "on").mode == "mps-on-byte"
    assert parsed("--layout", "two-pairs", "--tokenizer", "byte", "--load", "burst").mode == \
        "two-pairs-mps-off-byte-burst"
    smoke = parsed("--smoke")
    assert (smoke.tokenizer, smoke.mode) == ("byte", "smoke")  # voxring-tiny's own
    assert parsed("--checkpoint", "/somewhere").tokenizer is None  # the folder's own
    with pytest.raises(SystemExit):
        parsed("--smoke", "--tokenizer", "bpe")
    assert report.base_result(smoke)["tokenizer"] == "byte"
    assert report.tokenizer_text({}) == "prompts tokenized by the byte tokenizer"  # files from before
    assert report.tokenizer_text({"tokenizer": "bpe"}) == "prompts tokenized by the bpe tokenizer"
