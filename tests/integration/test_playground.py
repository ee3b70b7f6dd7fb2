"""The playground page (services/gateway/http/static/playground.html) in a real browser against a
real stack: talker, Code2Wav and a gateway (tiny model, bearer token, HTTP on a free loopback
port) as processes; Debian's Chromium, headless, driven by playwright. The page must fill its
voice list from the server, stream PCM and play it with the Web Audio API, show time to first
audio, bytes and seconds, offer the other formats as a file, and put the server's own words on
screen for a 401. Playwright's own browser downloads are never used: no network here or on CI."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from tests.conftest import StageGroup
from voxring.stage_process import StageProcess

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               "--autoplay-policy=no-user-gesture-required"]
TOKEN = f"vx-play-{secrets.token_hex(12)}"
WRONG = f"vx-wrong-{secrets.token_hex(12)}"
TOKEN_KEY = "voxring.playground.token"  # the page's sessionStorage key
RATE = 24000  # the tiny model's rate: PCM seconds = bytes / 2 / RATE
WAIT_MS = 30_000  # bound on any one thing the page is waited for (a busy 2-core CI)
MAX_AUDIO_S = 1.0
TEXT, SEED = "Hello from the playground.", 7


@pytest.fixture(scope="module")
def chromium() -> Path:
    """Debian's Chromium, or a skip (a failure on CI, where `make test` installs it first)."""
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing (apt-get install chromium; `make tools` does it on CI)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return CHROMIUM


@dataclass(frozen=True)
class Served:
    url: str  # the playground page, http://127.0.0.1:PORT/
    process: StageProcess  # the gateway: its log's tail goes into failure messages

    def log(self) -> str:
        return f"gateway log:\n{self.process.log_tail(15)}"


@pytest.fixture(scope="module")
def gateway(chromium, model_cache):
    """The three stages; the gateway with a token and HTTP on 127.0.0.1:<free port>, its
    audio capped short."""
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-play-", dir="/tmp"))  # short: unix socket paths
    (d / "token").write_text(TOKEN + "\n")
    configs = {
        "talker": f"server: {{listen: 'unix:{d}/talker.sock', drain_timeout: 5, grace: 1}}\n"
                  f"engine: {{k_max: 4, buckets: [1, 2, 4], max_num_seqs: 4, max_len: 256}}\n",
        "code2wav": f"server: {{listen: 'unix:{d}/code2wav.sock', drain_timeout: 5, grace: 1}}\n"
                    f"engine: {{max_slots: 8}}\n"
                    f"talkers: {{attach: [{{id: talker-0, address: 'unix:{d}/talker.sock'}}]}}\n",
        "gateway": f"server: {{listen: 'unix:{d}/gateway.sock', drain_timeout: 5, grace: 1}}\n"
                   f"http: {{listen: '127.0.0.1:0'}}\n"
                   f"auth: {{token_file: token}}\n"
                   f"engines: {{pairs: [{{talker: 'unix:{d}/talker.sock',"
                   f" code2wav: 'unix:{d}/code2wav.sock'}}]}}\n"
                   f"limits: {{max_audio_seconds: {MAX_AUDIO_S}, default_audio_seconds: {MAX_AUDIO_S}}}\n",
    }
    stages = StageGroup(d)
    try:
        for stage in ("talker", "code2wav", "gateway"):
            info = stages.start(stage, configs[stage], timeout=60).ready()
        assert info.get("http"), f"the gateway's ready file names no HTTP address: {info}"
        yield Served(f"http://{info['http']}/", stages["gateway"])
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """One fresh browser context on the playground, the token already in its sessionStorage
    (as a returning user has it), recording page errors, console errors and speech responses."""

    def __init__(self, browser, served: Served, token: str) -> None:
        self.served = served
        self.context = browser.new_context(viewport={"width": 390, "height": 844})  # a phone's width
        self.context.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(token)})")
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.speech: list = []  # playwright Responses of POST /v1/audio/speech
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.page.on("console", self._console)
        self.page.on("response", self._response)
        self.page.goto(served.url)
        self.page.wait_for_selector("#voice[data-loaded]", state="attached", timeout=WAIT_MS)

    def _response(self, response) -> None:
        if response.url.endswith("/v1/audio/speech"):
            self.speech.append(response)

    def _console(self, message) -> None:
        if message.type == "error":
            self.problems.append(f"console error: {message.text}")

    def stat(self, element: str, attribute: str) -> str:
        return self.page.get_attribute(f"#{element}", f"data-{attribute}") or ""

    def wait_state(self, run: int, *states: str) -> str:
        """Waits until the page's ``run``-th request (#status data-run) reaches one of ``states``."""
        self.page.wait_for_function(
            "([run, states]) => { const s = document.getElementById('status').dataset;"
            " return Number(s.run) === run && states.includes(s.state); }",
            arg=[run, list(states)], timeout=WAIT_MS)
        return self.stat("status", "state")

    def evidence(self, shot: Path) -> str:
        """Takes a screenshot into ``shot``; returns what a failure message needs: what the
        page shows, where the screenshot is, the gateway log's tail."""
        self.page.screenshot(path=str(shot), full_page=True)
        return (f"status {self.stat('status', 'state')!r}, error {self.page.inner_text('#error')!r}, "
                f"problems {self.problems}; screenshot {shot}\n{self.served.log()}")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser, gateway):
    pages: list[Page] = []

    def open_(token: str = TOKEN) -> Page:
        pages.append(Page(browser, gateway, token))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


def _speak(page: Page, text: str, fmt: str) -> str:
    """Types ``text``, picks ``fmt``, clicks Play; returns the state the page's request ends in."""
    page.page.fill("#text", text)
    page.page.select_option("#format", fmt)
    run = int(page.stat("status", "run")) + 1
    page.page.click("#play")
    return page.wait_state(run, "done", "error", "stopped")


def test_play_streams_pcm_and_shows_the_numbers(open_page, tmp_path):
    """A voice from the server's list, Play: PCM streams and is scheduled sample for sample, the
    page shows TTFA, RTF, bytes and seconds, and its byte count is what the server sends."""
    page = open_page()
    assert page.stat("voice", "loaded") == "true", page.evidence(tmp_path / "voices.png")
    voices = page.page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert voices, "the voice list is empty"
    page.page.select_option("#voice", voices[-1])
    page.page.click("summary")  # "More options": a fixed seed, so the same request gives the same audio
    page.page.fill("#seed", str(SEED))
    state = _speak(page, TEXT, "pcm")
    why = page.evidence(tmp_path / "playground-pcm.png")
    assert state == "done" and page.problems == [], why
    assert page.page.inner_text("#error") == "", why
    received = int(page.stat("bytes", "bytes"))
    assert received > 0 and received % 2 == 0, f"{received} bytes of int16 PCM; {why}"
    assert int(page.stat("seconds", "samples")) == received // 2, why  # every sample scheduled
    assert float(page.stat("seconds", "seconds")) == pytest.approx(received / 2 / RATE, abs=1e-3), why
    assert float(page.stat("seconds", "seconds")) <= MAX_AUDIO_S + 0.2, why  # the gateway's cap held
    assert float(page.stat("ttfa", "ms")) >= 0 and float(page.stat("rtf", "value")) > 0, why
    # The browser's own view of the answer (headers only: Chromium keeps no body of a fetch read
    # through a stream, and reports one read to its end as aborted, so bytes are the page's count).
    [response] = page.speech
    assert response.status == 200 and response.request.method == "POST", why
    assert response.header_value("x-sample-rate") == str(RATE), why
    sent = response.request.post_data_json
    assert (sent["voice"], sent["response_format"], sent["stream_format"]) == (voices[-1], "pcm", "audio")
    assert response.request.headers.get("authorization") == f"Bearer {TOKEN}", why
    assert sent["seed"] == SEED and sent["input"] == TEXT, why
    status, direct = _post(page.served.url, TOKEN, sent)  # the same request again, outside the browser
    assert status == 200 and len(direct) == received, f"{len(direct)} bytes directly; {why}"


def test_other_formats_become_a_file_link(open_page, tmp_path):
    """A file format (WAV) is offered as a download of exactly the bytes received, which the
    browser can decode (its length is shown)."""
    page = open_page()
    state = _speak(page, "A file to keep.", "wav")
    why = page.evidence(tmp_path / "playground-wav.png")
    assert state == "done" and page.problems == [], why
    link = page.page.locator("#download-link")
    assert link.get_attribute("download") == "speech.wav", why
    assert link.get_attribute("href").startswith("blob:"), why
    with page.page.expect_download(timeout=WAIT_MS) as saved:
        link.click()
    data = Path(saved.value.path()).read_bytes()
    assert saved.value.suggested_filename == "speech.wav", why
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", f"not a WAV file: {data[:12]!r}; {why}"
    assert len(data) == int(page.stat("bytes", "bytes")), f"a {len(data)}-byte file; {why}"
    assert 0 < float(page.stat("seconds", "seconds")) <= MAX_AUDIO_S + 0.2, why  # decoded by the browser


def _post(url: str, token: str, body: dict) -> tuple[int, bytes]:
    """POST /v1/audio/speech outside the browser: (status, the response's body)."""
    request = urllib.request.Request(f"{url}v1/audio/speech", method="POST", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_MS / 1000) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_wrong_token_shows_the_401_message(open_page, gateway, tmp_path):
    """A token typed into the field is kept in sessionStorage and sent; a wrong one puts the
    server's own error.message on screen, with no audio counted."""
    page = open_page()
    assert page.stat("voice", "loaded") == "true", page.evidence(tmp_path / "voices.png")
    page.page.fill("#token", WRONG)
    page.page.press("#token", "Tab")  # a change event: kept in sessionStorage, the lists asked for again
    page.page.wait_for_selector("#voice[data-loaded='false']", state="attached", timeout=WAIT_MS)
    assert page.page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == WRONG
    state = _speak(page, "Not with this token.", "pcm")
    why = page.evidence(tmp_path / "playground-401.png")
    status, answer = _post(gateway.url, WRONG, {"model": "x", "input": "x", "voice": "x"})
    words = json.loads(answer)["error"]["message"]  # what the server itself says to this token
    assert status == 401 and words, f"the server answered {status} {answer!r}"
    assert state == "error" and page.stat("error", "http-status") == "401", why
    assert page.page.inner_text("#error") == words, why
    assert page.stat("bytes", "bytes") == "0" and page.stat("ttfa", "ms") == "", why
    # the browser logs each refused fetch (the lists, the speech request); nothing else may go wrong
    assert [p for p in page.problems if "status of 401" not in p] == [], why


def test_pcm_samples_split_across_chunks_are_joined(open_page):
    """The page's PcmPlayer on odd-sized chunks (the network may cut anywhere): every int16
    sample is decoded once, in order, into the AudioBuffers it schedules."""
    page = open_page()
    samples = [0, 1, -1, 32767, -32768, 1234, -4321, 77]
    pcm = b"".join(s.to_bytes(2, "little", signed=True) for s in samples)
    cuts = [1, 2, 1, 4, 3, len(pcm)]  # chunk sizes: a 1-byte chunk, halves of samples on both sides
    chunks, at = [], 0
    for size in cuts:
        chunks.append(list(pcm[at:at + size]))
        at += size
    decoded = page.page.evaluate(
        """chunks => {
            const player = new PcmPlayer(new OfflineAudioContext(1, 1, 24000));
            for (const chunk of chunks) player.push(new Uint8Array(chunk));
            const out = [];
            for (const source of player.sources) out.push(...source.buffer.getChannelData(0));
            return {out, samples: player.samples, carry: player.carry ? player.carry.length : 0};
        }""", chunks)
    assert decoded["out"] == [s / 32768 for s in samples]
    assert decoded["samples"] == len(samples) and decoded["carry"] == 0
    assert page.problems == []


def test_stop_aborts_the_request(open_page, tmp_path):
    """Play then Stop in one task (so the answer cannot have come yet): the fetch is aborted
    through its AbortController and the page says stopped, not failed."""
    page = open_page()
    page.page.fill("#text", "Stopped before it starts.")
    page.page.evaluate("() => { const play = document.getElementById('play'); play.click(); play.click(); }")
    state = page.wait_state(1, "done", "error", "stopped")
    why = page.evidence(tmp_path / "playground-stop.png")
    assert state == "stopped" and page.problems == [], why
    assert page.page.inner_text("#error") == "" and page.page.inner_text("#play") == "Play", why
