"""The browser demo in headless Chromium (Debian's /usr/bin/chromium driven by Playwright) against a
live server on the tiny random checkpoint: WebSocket playback through the AudioWorklet, stop =
cancel, and WebRTC playback."""

from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent (apt-get install -y chromium)", allow_module_level=True)

from playwright import async_api as playwright_api  # pip install playwright

from higgs_stream.clients.client import stream_tts

FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
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
    await other.fill("#text", "Hello there.")
    await other.click("#play")
    await other.wait_for_function("document.querySelector('#status').textContent.includes('token')", timeout=10_000)
    assert "?token=" in await other.text_content("#status")


async def test_favicon_is_served(page):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{page.live.http}/favicon.ico") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("image/svg+xml")
            assert (await r.read()).startswith(b"<svg")
