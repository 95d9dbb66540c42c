"""The browser demo in headless Chromium (Debian's /usr/bin/chromium driven by Playwright) against a
live server on the tiny random checkpoint: WebSocket playback through the AudioWorklet, stop =
cancel, WebRTC playback, and the demo's features: the level strip, the latency timeline, the WAV
download, text in LLM-sized pieces and as it is typed, a reference voice from a file or the
(fake) microphone. Screenshots go to $HIGGS_ARTIFACTS (default: the test's tmp_path); each test
prints where."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent (apt-get install -y chromium)", allow_module_level=True)

from playwright import async_api as playwright_api  # pip install playwright

from higgs_stream.clients.client import stream_tts
from higgs_stream.testing import assert_pcm_close

FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
    # getUserMedia answers at once, with Chromium's fake microphone (a beeping tone)
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
]
TOKEN = "demo-token"
# The page's jitter buffer (its default is 100 ms). The CPU test server generates the first chunks
# only ~2x faster than real time while Chromium shares its 2 cores, and the 1, 2, 4, 8 chunk
# schedule needs 2x to keep a player that starts at once fed. The arrival trace printed below
# shows how late the latest frame was against such a player: 0-40 ms on a warm server here, up to
# 150 ms on the first request of a cold one (hence the warm-up request in the fixture).
PREBUFFER_MS = 250
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
async def page(server_factory):
    live = await server_factory("--max-frames", "100", "--token", TOKEN)
    async for _ in stream_tts(live.ws, "Warm up.", token=TOKEN, seed=0):  # first-request costs
        pass
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            pg = await browser.new_page()
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            await pg.goto(f"{live.http}/?token={TOKEN}&prebuffer_ms={PREBUFFER_MS}")
            await pg.evaluate("window.higgs.ready")
            pg.live, pg.js_errors = live, errors
            yield pg
            assert not errors, errors
        finally:
            await browser.close()


def needed_prebuffer_ms(arrivals) -> float:
    """How late the latest frame was against a player that starts at the first frame."""
    t0, played, worst = arrivals[0][0], 0, 0.0
    for t, n in arrivals:
        worst = max(worst, t - (t0 + 1000 * played / 24000))
        played += n
    return worst


async def stats(pg) -> dict:
    return await pg.evaluate("window.stats")


async def play(pg, transport: str, text: str, seed: int) -> None:
    await pg.select_option("#transport", transport)
    await pg.fill("#text", text)
    await pg.fill("#seed", str(seed))
    await pg.click("#play")


async def test_websocket_playback_is_gapless(page):
    s = await stats(page)
    assert s["voices"][0] == "default" and not s["errors"], s  # the token reached /v1/voices
    await play(page, "ws", TEXT, seed=4)
    await page.wait_for_function("window.stats.events.includes('drained')", timeout=60_000)
    s = await stats(page)
    print("browser ws:", {k: s[k] for k in ("ttfaMs", "firstByteMs", "bytes", "chunks", "underruns", "maxRms")})
    print("arrivals", [(round(t), n) for t, n in s["arrivals"]], "needed prebuffer ms", needed_prebuffer_ms(s["arrivals"]))
    assert s["done"]["reason"] == "completed" and not s["errors"], s
    assert s["bytes"] == 2 * s["done"]["samples"] > 2 * 24000, s  # every sample arrived
    assert s["prebufferMs"] == PREBUFFER_MS
    assert s["underruns"] == 0, s["worklet"]
    assert s["worklet"]["played"] >= s["done"]["samples"] and s["worklet"]["overflows"] == 0
    assert s["maxRms"] > 0.05, s["maxRms"]  # it was audible at the output
    assert 0 < s["firstByteMs"] <= s["ttfaMs"] < 30_000
    assert await page.text_content("#underruns") == "0"
    assert await page.text_content("#status") == "done"
    assert s["events"].index("audio_start") < s["events"].index("started") < s["events"].index("done:completed")


async def test_stop_cancels_and_silences(page):
    long_text = " ".join([TEXT] * 3)
    await play(page, "ws", long_text, seed=4)
    await page.wait_for_function("window.stats.events.includes('started')", timeout=60_000)
    await page.wait_for_timeout(300)
    await page.click("#stop")
    await page.wait_for_function("window.stats.events.includes('done:cancelled')", timeout=10_000)
    await page.wait_for_timeout(200)
    s = await stats(page)
    assert s["worklet"]["buffered"] == 0 and s["worklet"]["state"] == "idle", s["worklet"]
    assert "drained" not in s["events"] and s["underruns"] == 0
    assert await page.text_content("#status") == "stopped"
    metrics = page.live.state.metrics.render()
    assert 'outcome="cancelled"' in metrics
    assert page.live.state.pipeline.active == 0
    # The page plays again after a stop.
    await play(page, "ws", "Hello there.", seed=1)
    await page.wait_for_function("window.stats.events.includes('drained')", timeout=60_000)
    s = await stats(page)
    assert s["done"]["reason"] == "completed" and s["bytes"] == 2 * s["done"]["samples"] > 0


async def test_webrtc_playback(page):
    await play(page, "webrtc", TEXT, seed=4)
    await page.wait_for_function("window.stats.events.includes('done:completed')", timeout=60_000)
    s = await stats(page)
    print("browser webrtc:", {k: s[k] for k in ("ttfaMs", "pcState", "maxRms", "rtc")})
    assert s["pcState"] == "connected" and not s["errors"], s
    assert s["maxRms"] > 0.05, s  # remote audio reached Web Audio (through the <audio> element)
    assert s["done"]["samples"] > 24000
    assert s["events"].index("audio_start") < s["events"].index("done:completed")
    assert s["bytes"] == 2 * s["done"]["samples"]  # "audio received" shows what the track played
    assert await page.text_content("#received") != "0.00 s"
    row = s["timeline"]  # audio_start comes when playout starts, done when it ends
    assert 0 < row["firstAudioMs"] <= row["doneMs"] == row["endMs"], row


async def wait_until(pg, pred, what: str, timeout_s: float = 10.0) -> None:
    """Poll a server-side condition (bounded) while the page runs."""
    for _ in range(int(timeout_s / 0.05)):
        if pred():
            return
        await pg.wait_for_timeout(50)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_refused_text_shows_its_own_error_and_closes_its_connection(page):
    """5,000 characters are refused (too_large); the page shows that error, not the not_found its
    `end` would get, and leaves no WebSocket open (three failed plays, then a good one)."""
    for _ in range(3):
        await play(page, "ws", "x" * 5000, seed=1)
        await page.wait_for_function("window.stats.errors.length > 0", timeout=10_000)
        status = await page.text_content("#status")
        assert "too_large" in status and "not_found" not in status, status
        await page.evaluate("window.stats.errors = []")
    await wait_until(page, lambda: page.live.state.metrics.connections.value() == 0, "the failed plays' sockets to close")
    await play(page, "ws", "Hello there.", seed=1)
    await page.wait_for_function("window.stats.events.includes('drained')", timeout=60_000)
    assert (await stats(page))["done"]["reason"] == "completed"
    await wait_until(page, lambda: page.live.state.metrics.connections.value() == 0, "the good play's socket to close")


async def test_a_missing_token_says_so(page):
    other = await page.context.browser.new_page()
    await other.goto(f"{page.live.http}/")  # no ?token=
    await other.evaluate("window.higgs.ready.catch(() => null)")
    await other.wait_for_function("window.stats.errors.length === 1")  # the voice list: 401
    assert "?token=" in await other.text_content("#status")
    await other.fill("#text", "Hello there.")
    await other.click("#play")
    await other.wait_for_function("window.stats.errors.length === 2", timeout=10_000)  # the WebSocket: 1008
    assert "?token=" in await other.text_content("#status")


async def test_favicon_is_served(page):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{page.live.http}/favicon.ico") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("image/svg+xml")
            assert (await r.read()).startswith(b"<svg")


# ---------------------------------------------------------------- the demo's features

@pytest.fixture
def artifacts(request, tmp_path):
    """Where this test's screenshots and downloads go: $HIGGS_ARTIFACTS/<test name> or tmp_path."""
    root = os.environ.get("HIGGS_ARTIFACTS")
    folder = (Path(root) / request.node.name) if root else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nartifacts of {request.node.name}: {folder}")
    return folder


async def screenshot(pg, folder: Path, name: str) -> None:
    path = folder / f"{name}.png"
    await pg.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    print(f"screenshot: {path}")


async def drained(pg, event="drained", timeout=60_000) -> dict:
    """Waits until the latest request played out (or got `event`, e.g. its done); its stats."""
    await pg.wait_for_function("""event => (e => e.lastIndexOf(event) > e.findLastIndex(x => x.startsWith('play:')))(
        window.stats.events)""", arg=event, timeout=timeout)
    s = await stats(pg)
    assert s["done"]["reason"] == "completed" and not s["errors"], s
    return s


async def test_level_strip_draws_the_played_audio(page, artifacts):
    await play(page, "ws", TEXT, seed=4)
    s = await drained(page)
    strip = s["strip"]
    # one column per 50 ms of playback; most of the utterance is audible noise on random weights
    seconds = s["done"]["samples"] / 24000
    assert strip["drawn"] >= 0.5 * seconds / 0.05 and strip["max"] > 0.05, (strip, seconds)
    # ... and it is on the canvas: pixels in the strip's colour above and below the middle line
    painted = await page.evaluate("""() => {
        const c = document.getElementById('strip');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let above = 0, below = 0;
        for (let y = 0; y < c.height; y++) for (let x = 0; x < c.width; x++) {
            if (d[4 * (y * c.width + x) + 3] === 0 || Math.abs(y - c.height / 2) < 3) continue;
            if (y < c.height / 2) above++; else below++;
        }
        return {above, below, width: c.width, height: c.height};
    }""")
    print("level strip:", strip, painted)
    assert painted["above"] > 200 and painted["below"] > 200, painted
    await screenshot(page, artifacts, "level-strip")


async def test_timeline_shows_first_audio_and_done_per_request(page, artifacts):
    await play(page, "ws", TEXT, seed=4)
    first = await drained(page)
    await play(page, "ws", "Hello there.", seed=1)
    second = await drained(page)
    rows = await page.eval_on_selector_all("#timeline li", """els => els.map(li => ({
        first: Number(li.dataset.firstAudioMs), done: Number(li.dataset.doneMs), text: li.textContent}))""")
    print("timeline:", rows)
    assert len(rows) == 2 and rows[0]["text"].startswith("#2") and rows[1]["text"].startswith("#1")  # newest first
    for row, s in zip(rows, (second, first)):
        assert 0 < row["first"] <= row["done"], row
        assert row["first"] == s["timeline"]["firstAudioMs"] and row["done"] == s["timeline"]["doneMs"]
        assert s["timeline"]["endMs"] >= row["done"]  # played out after the server's last audio
        assert "first audio" in row["text"] and "done" in row["text"] and "played out" in row["text"]
    assert first["firstByteMs"] == first["timeline"]["firstAudioMs"] <= first["ttfaMs"]
    await screenshot(page, artifacts, "timeline")
    await page.emulate_media(color_scheme="dark")
    await screenshot(page, artifacts, "timeline-dark")


async def test_download_is_the_played_audio_as_a_wav(page, artifacts, reference_pcm):
    import wave

    assert await page.is_disabled("#download")  # nothing played yet
    await play(page, "ws", TEXT, seed=4)
    s = await drained(page)
    async with page.expect_download() as info:
        await page.click("#download")
    path = artifacts / "played.wav"
    await (await info.value).save_as(str(path))
    with wave.open(str(path), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        pcm = w.readframes(w.getnframes())
    assert len(pcm) // 2 == s["done"]["samples"] == s["bytes"] // 2 == (await stats(page))["download"]["samples"]
    await page.live.state.pipeline.stop()  # the engine thread is idle; stop it before generate()
    assert_pcm_close(pcm, reference_pcm(page.live.state, TEXT, 4), what="downloaded WAV")
    await screenshot(page, artifacts, "download")


async def test_llm_sized_pieces_then_end(page, artifacts):
    text = "Hello there. This text arrives the way a language model streams it, a few words at a time."
    await page.check("input[name=send][value=llm]")
    await play(page, "ws", text, seed=2)
    s = await drained(page, "done:completed")
    pieces = await page.evaluate("t => window.higgs.llmPieces(t)", text)
    assert "".join(pieces) == text and len(pieces) >= 8
    assert s["sent"] == ["text"] * len(pieces) + ["end"] and s["textMessages"] == len(pieces)
    assert len(s["timeline"]["sends"]) == len(pieces) and s["timeline"]["sends"][0] == 0
    assert s["bytes"] == 2 * s["done"]["samples"] > 24000
    await page.wait_for_function("window.stats.maxRms > 0.05")  # it plays
    assert page.live.state.metrics.requests.value(transport="ws", outcome="completed") == 2  # warm-up + this
    await screenshot(page, artifacts, "llm-pieces")


async def test_type_as_you_talk(page, artifacts):
    await page.check("input[name=send][value=typing]")
    assert await page.text_content("#play") == "Start typing"
    await page.fill("#seed", "3")
    await page.click("#play")
    await page.wait_for_function("document.activeElement.id === 'text' && window.stats.mode === 'typing'")
    await page.keyboard.type("Hello there. How are", delay=10)
    await page.keyboard.press("Enter")  # speak what is pending at once
    await page.wait_for_function("window.stats.events.includes('audio_start')", timeout=60_000)
    await page.keyboard.type("you today? I am fine", delay=10)
    await page.click("#finish")
    s = await drained(page, "done:completed")  # all audio is in; the test need not hear it out
    print("typed:", s["sent"], "waits", s["waits"])
    # a message per finished word: "Hello ", "there. ", "How ", then Enter sends "are\n" with flush;
    # "you ", "today? ", "I ", "am ", then Finish sends "fine" and end
    assert s["sent"] == ["text"] * 3 + ["text:flush"] + ["text"] * 5 + ["end"], s["sent"]
    assert s["bytes"] == 2 * s["done"]["samples"] > 24000
    await page.wait_for_function("window.stats.maxRms > 0.05")  # it plays
    assert page.live.state.metrics.requests.value(transport="ws", outcome="completed") == 2  # one context
    await screenshot(page, artifacts, "type-as-you-talk")


def _reference_wav(seconds: float = 1.5, sr: int = 16000) -> bytes:
    import io

    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2).astype(np.float32),
             sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def assert_spoken_with_reference(pg, audio_b64: str, transcript: str, seed: int, pcm: bytes) -> None:
    """The page's audio equals offline synthesis conditioned on that reference (within 1 LSB):
    the server took the reference and used it."""
    from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
    from higgs_stream.engine.synth import synthesize
    from higgs_stream.stream.adapter import to_s16le
    from higgs_stream.stream.voices import VoiceLibrary

    state = pg.live.state
    await state.pipeline.stop()  # the engine thread is idle; stop it before generate()
    voice = VoiceLibrary().inline(audio_b64, transcript)
    wav, sr = voice.decode()
    ref = Reference(codes=state.pipeline.codec.encode(wav, sr), transcript=voice.transcript)
    request = GenerationRequest(TEXT, reference=ref, sampling=SamplingParams(seed=seed),
                                max_frames=state.config.max_frames)
    assert_pcm_close(pcm, to_s16le(synthesize(state.pipeline.engine, state.pipeline.codec, request)[0]),
                     what="audio with the reference")
    plain = GenerationRequest(TEXT, sampling=SamplingParams(seed=seed), max_frames=state.config.max_frames)
    assert to_s16le(synthesize(state.pipeline.engine, state.pipeline.codec, plain)[0]) != pcm  # it made a difference


async def test_uploaded_reference_is_sent_and_used(page, artifacts):
    import base64

    path = artifacts / "reference.wav"
    path.write_bytes(_reference_wav())
    await page.click("#clone summary")
    await page.set_input_files("#ref-file", str(path))
    await page.fill("#ref-transcript", "A short hum.")
    assert await page.is_disabled("#voice")  # the reference replaces the voice menu
    await play(page, "ws", TEXT, seed=5)
    s = await drained(page)
    assert s["reference"] == {"source": "file", "name": "reference.wav", "bytes": path.stat().st_size, "seconds": None}
    async with page.expect_download() as info:
        await page.click("#download")
    await (await info.value).save_as(str(artifacts / "played.wav"))
    pcm = (artifacts / "played.wav").read_bytes()[44:]
    assert len(pcm) == s["bytes"]
    await screenshot(page, artifacts, "reference-file")
    await assert_spoken_with_reference(page, base64.b64encode(path.read_bytes()).decode(), "A short hum.", 5, pcm)


async def test_microphone_reference_is_recorded_sent_and_used(page, artifacts):
    await page.click("#clone summary")
    await page.click("#ref-record")
    await page.wait_for_selector("#ref-record[aria-pressed=true]")  # the microphone is open
    await page.wait_for_function(
        "parseFloat((document.getElementById('ref-status').textContent.match(/([0-9.]+) s/) || [0, 0])[1]) >= 1.5",
        timeout=20_000)
    await page.click("#ref-record")  # stop
    await page.wait_for_function("window.higgs.reference.active")
    info = await page.evaluate("window.higgs.reference.info")
    assert info["source"] == "mic" and 1.4 <= info["seconds"] < 5
    assert info["bytes"] == 44 + 2 * round(info["seconds"] * 24000)  # a 24 kHz s16 WAV
    transcript = await page.input_value("#ref-transcript")
    assert transcript  # prefilled with the sentence to read aloud
    await play(page, "ws", TEXT, seed=6)
    s = await drained(page)
    assert s["reference"]["source"] == "mic"
    option = await page.evaluate("window.higgs.reference.option()")
    async with page.expect_download() as dl:
        await page.click("#download")
    await (await dl.value).save_as(str(artifacts / "played.wav"))
    pcm = (artifacts / "played.wav").read_bytes()[44:]
    await screenshot(page, artifacts, "reference-microphone")
    await assert_spoken_with_reference(page, option["audio"], option["transcript"], 6, pcm)
