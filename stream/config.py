"""ServerConfig: every limit and default of the streaming service, validated when built."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.gpu_memory import HEADROOM_GB
from higgs_stream.stream.pacing import PacingConfig

CODEC_QUEUE_ROUNDS = 4  # ServerConfig.codec_queue_rounds' default (why 4: beside the field)
CODEC_MAX_WINDOWS = 64  # ServerConfig.codec_max_windows' default: the most streams one codec call decodes
SAMPLE_RATE = 24000  # the codec's rate; the only rate served in protocol version 1
PROTOCOL_VERSION = 1
MODES = ("exact", "low_latency")

# OpenAI's voice names (what OpenAI SDKs and Pipecat's OpenAITTSService accept).
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable",
    "marin", "nova", "onyx", "sage", "shimmer", "verse",
)

# An allowed browser origin: scheme://host[:port], nothing after it (or "*": any origin).
ORIGIN = re.compile(r"(https?)://([^/?#@\s:]+|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?")
# An ICE server URL: stun:HOST[:PORT], or turn[s]:USER:CREDENTIAL@HOST[:PORT][?transport=udp|tcp].
ICE_SERVER = re.compile(r"(?P<scheme>stuns?|turns?):(?:(?P<username>[^:@]+):(?P<credential>[^@]+)@)?"
                        r"(?P<host>[^:@?/\s]+)(?::(?P<port>\d{1,5}))?(?:\?transport=(?P<transport>udp|tcp))?")


def _number_or_none(convert, what: str, name: str):
    """An argparse `type=` for a number or 'none' (its ValueError reads as an invalid value, named `name`)."""
    def parse(text: str):
        if text.strip().lower() == "none":
            return None
        try:
            return convert(text)
        except ValueError:
            raise ValueError(f"expected {what} or 'none', got {text!r}") from None

    parse.__name__ = name
    return parse


rows_or_none = _number_or_none(int, "a number of rows", "rows_or_none")  # a command-line row count, or 'none'
gb_or_none = _number_or_none(float, "a number of GB", "gb_or_none")  # a command-line size in GB, or 'none'


# Serving defaults per model family (its --arch name) for ServerConfig's family-dependent fields, which are None
# unless set (`for_family` fills them when the pipeline learns what it serves). Measured on one H100, session 16,
# same-call A/Bs (docs/PERF.md):
# - Higgs v2: exact mode's first chunk for 3x the longest recent codec call and chunk 1 as large as chunk 0 (2, 3.0):
#   256 streams arriving over 2 s, 0, 1, 0 (then 0, 0) streams underran vs 16, 16 at (1, 1.0); 20 req/s TTFA p95
#   133 / 134 vs 126 / 127 ms. v3 shares the codec and its 25 Hz frames: the same rule (session 17, 256 over 2 s on
#   session 16's engine: 227 of 372 underran with it, 256 of 383 with (1, 1.0); with the engine's fixes of session 17,
#   0 of 418 and 9 of 365 with it). No codec time cap (at 256, 30 ms caps underran 16, 5, 30 vs 7, 19, 32).
# - Qwen3-TTS (80 ms frames, ~9 ms frame steps), 20 req/s: (2, 3.0) gave TTFA p95 114 / 126 ms against 62 at (1, 1.0)
#   (a larger first chunk costs a frame step each and bought nothing there); the codec cap 12 ms held while a listener
#   has < 0.2 s of audio: p95 63 / 61 ms, 1 and 0 of 190 streams underran, vs 76 / 76 and 5 / 4 without.
# - Higgs v2 / v3: the first chunk may grow to 10 frames (8 before session 19). H200, 256 streams arriving over 2 s,
#   same-call A/Bs: v2 0 of 502 streams underran vs 27 of 495 at 8, v3 0 of 436 vs 1 of 408; the other runs at 8 that
#   session: 20 of 488 and 0 of 449. The cost: a stream whose rule asks for more than 8 frames waits up to two more
#   steps (closed 128 TTFA p95 448 vs 370 ms for v2, 254 vs 353 for v3: within run-to-run spread). Qwen3-TTS keeps 8.
#   Session 20, two more v2 pairs: 22 of 512 and 0 of 509 at 10, 0 of 490 and 17 of 504 at 8; over both sessions no
#   difference measurable (22 of 1,959 vs 45 of 1,897, the stalls of a run coming together in one burst).
# - Higgs v2 / v3: while the codec keeps up, one codec call decodes at most 32 streams (`codec_calm_windows`); once
#   it falls behind (more frames held than one full largest call), up to codec_max_windows (64). Session 27 (H200,
#   128 streams arriving over 2 s, 10 s utterances): v2 TTFA p95 268, 218, 280 ms with every call at 32 against 306,
#   273, 378, 311, 302, 283 at 64 (319, 353 at 16); 0 of 1,129 streams underran at 32, 3 of 2,288 at 64; v3 260, 220
#   against 250, 341. The longest calls shorten (p95 61-62 vs 81-88 ms), so a first chunk waits less behind one; the
#   codec spends 8-26 % more time a frame. Session 28 (H200, 256 streams over 2 s, two runs each): every call at 32
#   fell behind (frames held p95 4,600 vs 1,086; 279 and 31 streams refused `busy` against 21 and 20; TTFA p95 580,
#   451 against 386, 380 ms at 64; 0 underran in all four). With the switch at 1,600 held frames: 256 streams p95
#   425, 419, 535, 486 ms (3, 1, 22, 21 busy) against 386, 380, 447, 474, 399, 477 at 64 (21, 20, 35, 7, 17, 61 busy;
#   0 underran in any); 128 streams 256, 286, 233, 330, 323 against 353, 316, 210 at 64 (0 underran); v3 at 256 478,
#   470, 473 against 451, 453, 469. At 128 it keeps what 32 gave (weakly: sessions 27-28 pooled, medians 274 vs 306,
#   12 % by chance); at 256 it stays within 64's spread, with fewer refusals. Qwen3-TTS calls take 64 streams (not
#   measured at 32).
FAMILY_FIELDS = ("ramp_repeat", "first_chunk_margin", "codec_starting_ms", "max_first_chunk", "codec_calm_windows")
FAMILY_DEFAULT = {"ramp_repeat": 2, "first_chunk_margin": 3.0, "codec_starting_ms": 0.0, "codec_starting_ahead_s": None,
                  "max_first_chunk": 10, "codec_calm_windows": 32}
FAMILY_DEFAULTS = {
    "qwen3-tts": {"ramp_repeat": 1, "first_chunk_margin": 1.0, "codec_starting_ms": 12.0, "codec_starting_ahead_s": 0.2,
                  "max_first_chunk": 8, "codec_calm_windows": 64},
}


def for_family(cfg: "ServerConfig", arch: str | None) -> "ServerConfig":
    """`cfg` with its family-dependent fields (None) filled from the served family's defaults (FAMILY_DEFAULTS; any
    other family, or None, FAMILY_DEFAULT). The codec cap (`codec_starting_ms`, 0: off) comes out as None when off;
    its `codec_starting_ahead_s` is the family's only where the cap is the family's too. A cap option set while the
    cap ends up off is a ConfigError."""
    fam = FAMILY_DEFAULTS.get(arch or "", FAMILY_DEFAULT)
    out = replace(cfg, **{k: fam[k] for k in FAMILY_FIELDS if getattr(cfg, k) is None})
    if not out.codec_starting_ms:
        if cfg.codec_starting_ahead_s is not None or cfg.codec_starting_exempt_s is not None:
            raise ConfigError("codec_starting_ahead_s / codec_starting_exempt_s shape the codec_starting_ms cap, which "
                              f"is off{'' if cfg.codec_starting_ms == 0 else ' for this model family'}: set "
                              "codec_starting_ms too")
        return replace(out, codec_starting_ms=None)
    if cfg.codec_starting_ms is None and cfg.codec_starting_ahead_s is None:
        out = replace(out, codec_starting_ahead_s=fam["codec_starting_ahead_s"])
    return out


def _int_or_none(value: object, lo: int, hi: int | None = None) -> bool:
    """Whether `value` is None or an int (not a bool) in lo..hi (no upper bound without `hi`)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and lo <= value
                             and (hi is None or value <= hi))


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None  # None: no auth
    # Browser origins allowed besides the server's own (WebSocket and POST routes); "*" = any.
    # Requests without an Origin header (non-browser clients) are always allowed.
    allowed_origins: tuple[str, ...] = ()
    # Origins whose pages may call /v1/audio/speech and /v1/voices cross-origin (CORS, preflight
    # answered); each is also allowed like `allowed_origins` (browser WebSockets too). () = no CORS.
    cors_origins: tuple[str, ...] = ()

    # Admission.
    max_streams: int = 32  # contexts + HTTP requests in flight, server-wide
    max_contexts: int = 8  # open contexts per WebSocket connection

    # Input limits.
    max_message_bytes: int = 8 << 20  # soft: typed `too_large`; 2x closes the socket (1009)
    max_text_chars: int = 4096  # per `text` message and per HTTP `input`
    max_context_chars: int = 65536  # all text of one context
    max_reference_bytes: int = 6 << 20  # decoded reference audio file
    max_reference_s: float = 30.0  # checked from the file's header before it is decoded
    max_transcript_chars: int = 2000
    max_scene_chars: int = 1000
    max_instructions_chars: int = 1000  # a voice/style description (Qwen3-TTS VoiceDesign; v2: its scene)

    # Text segmentation.
    max_segment_chars: int = 400
    max_buffer_delay_ms: int = 1000  # idle time before a partial buffer is synthesized
    sentence_delay_ms: int = 150  # same for a buffer ending in '.', '!', '?' (capped by the above)

    # Generation.
    max_frames: int = 1500  # per segment (60 s)
    default_mode: str = "exact"
    history_segments: int = 2  # earlier segments a reference-less context is conditioned on
    history_max_frames: int = 1500

    # Output.
    # A context whose client does not take its audio (a listener that reads in real time, a context queued behind
    # another on its connection, a client that stopped reading) pauses its generation once stream_hold_s of audio
    # waits for the client, and resumes when half of that is left; held that long without draining to half after
    # its client took some of its audio, it ends with `slow_client` (its engine stream freed). stream_buffer_s caps
    # the audio queued per context whatever happens (what a pause lets through: steps and codec calls in flight)
    stream_hold_s: float = 10.0
    slow_client_s: float = 60.0
    stream_buffer_s: float = 60.0
    max_send_ms: int = 1000  # largest merged audio frame after the first
    # each client connection's kernel send buffer (SO_SNDBUF, KiB; Linux doubles it): what a client that stopped
    # reading can have waiting in the server's kernel before its context's hold (stream_hold_s) engages, and the
    # kernel memory a connection may hold; a connection carries at most twice this per round trip. None: the
    # kernel's autotuning (up to tcp_wmem's maximum, 4 MiB by default: ~85 s of 24 kHz audio generated for a loopback
    # client that read nothing before its hold engaged, measured; 128 KiB: 11.7 s with a 2 s hold, README Limits)
    send_buffer_kib: int | None = 128
    heartbeat_s: float = 20.0  # WebSocket ping interval
    # messages a WebSocket (or WebRTC data channel) session reads per second, bursts of as many: past it the
    # session reads no further until its budget refills, so a flood slows its own sender (TCP) and not the others
    max_messages_per_s: float = 1000.0
    idle_timeout_s: float = 300.0  # a connection with no open context and no message for this long is closed
    context_idle_s: float = 60.0  # an open context with no message and no audio for this long ends (idle_timeout)
    http_body_timeout_s: float = 30.0  # an HTTP request body must arrive within this (timeout, 408)
    # shutdown (SIGTERM / SIGINT): new streams are refused (shutting_down) while the open ones run to their end for
    # up to this long; then the rest end with error{shutting_down}. Keep it below the platform's kill grace
    # (Kubernetes: 30 s)
    drain_s: float = 600.0

    # WebRTC: ICE servers the server's peer connections use (none: host candidates only).
    ice_servers: tuple[str, ...] = ()

    # Deadline-aware scheduling (stream/pacing.py).
    # (defaults: PacingConfig's) GPU saturated: pause a stream this far ahead of its listener, and resume it
    # this close (a 25-frame chunk + look-ahead takes ~0.4 s at load)
    pause_ahead_s: float = PacingConfig.pause_ahead_s
    resume_ahead_s: float = PacingConfig.resume_ahead_s
    warm_up: bool = False  # serve: one utterance through the pipeline before the server reports healthy
    gc_freeze: bool = True  # after start-up: gc.freeze() its objects, so full collections stay short (gc_pauses.py)
    admit_step_ratio: float | None = PacingConfig.admit_ratio  # admit while the predicted engine step stays under this share of a frame (None: off)
    codec_schedule: str = "eager"  # "eager": decode as frames come (50 ms batching); "just_in_time": while streams start
    codec_sms: int | None = None  # CUDA: the codec's kernels on a green context of this many SMs (None: every SM)
    codec_overdue_first: bool = False  # CUDA: a codec call holding an overdue job runs above the talker's priority
    # rounds of decode work (one per engine step that made some) queued for the codec thread before the engine thread
    # waits (back-pressure): while a codec call runs the talker makes this many steps, then stops until the call ends.
    # The default, 4 (CODEC_QUEUE_ROUNDS; 8 before session 20, then the Higgs families', every
    # family's since session 21). H200, v2, 256 streams arriving over 2 s (session 20): TTFA p95 385 and 387 ms, 0 of
    # 498 and 0 of 485 streams underran, against 578 ms and 0 of 508 at 8 in the same call and 457-837 ms with 0-22
    # underran in 7 other runs at 8; closed 128 p95 295 vs 355. The talker stops sooner while a codec call runs, so
    # the codec's calls stay short (p95 71-80 ms vs 95-212; backlog at most 3.3k frames vs 5.3-5.7k) and a first chunk
    # waits less behind one; without the bound (256 rounds) 41 and 63 of ~512 underran (backlog up to 16.7k frames:
    # the talker took the GPU from the codec). Session 21, one call each, 4 / 2 / 8: v2 256 p95 454 / 403 / 451 ms (0
    # underran in all), the later requests' p95 258 / 247 / 365; v3 256 p95 401 / 438 / 484 (0 underran); 20 req/s p95
    # 123-129 (v2), 127-128 (v3); Qwen3-TTS 1.7B at 20 req/s p95 53 / 51 / 52 ms, 0 underran: no difference there, so
    # one default for every family. 2 not adopted: one run each, worse on v3.
    codec_queue_rounds: int = CODEC_QUEUE_ROUNDS
    codec_starting_ms: float | None = None  # while a stream waits for its first audio, codec calls keep their predicted time within this (fixed cost + per frame; 0: no cap; None: the family's, FAMILY_DEFAULTS)
    codec_starting_exempt_s: float | None = None  # a capped call still takes every job due within this (None: CODEC_URGENT_S, 0.3 s)
    codec_starting_ahead_s: float | None = None  # the cap also holds while some listener has less than this much audio (its first chunks; None: only first audio)
    max_first_chunk: int | None = None  # exact mode (low-latency under load too): frames the first chunk may grow to under load (TTFA grows by one step per frame; None: the family's)
    codec_max_windows: int = CODEC_MAX_WINDOWS  # streams one codec call decodes at most (the warm-up graphs up to it)
    # streams a call decodes while the codec keeps up (it holds at most codec_max_windows x the steady chunk's frames;
    # more: calls take up to codec_max_windows); None: the family's (FAMILY_DEFAULTS); above codec_max_windows: that
    codec_calm_windows: int | None = None
    # exact mode (low-latency under load too): the first chunk is sized for this many times the longest recent codec
    # call, and `ramp_repeat` chunks of its size come before the schedule doubles (2: chunk 1 = chunk 0). None: the
    # model family's (FAMILY_DEFAULTS)
    first_chunk_margin: float | None = None
    ramp_repeat: int | None = None
    saturated_step_ratio: float = PacingConfig.saturated_ratio  # GPU saturated (pausing on) above this share of a frame
    yield_ahead_s: float | None = PacingConfig.yield_ahead_s  # while a stream waits for first audio, skip streams this far ahead (None: off)
    # The serving process's GIL switch interval (sys.setswitchinterval): how long a thread that wants the
    # GIL back waits behind pure-Python work on another thread. An engine step makes a dozen or more calls
    # that drop and retake the GIL (torch ops, attention planning, graph replay, copies), each costing up
    # to one interval while the event loop or the codec thread runs Python (docs/PERF.md, session 8).
    # CPython's 1 ms by default: 0.1 ms (session 8's default, from a CPU benchmark) measured no better for
    # Qwen3-TTS on an H100 and v2's 20 req/s p95 came out 193 ms against 147-165 at 1 ms in earlier
    # sessions (other calls): back to 1 ms until a same-call A/B says otherwise (docs/PERF.md, session 9).
    gil_switch_s: float = 1e-3
    # CUDA: once the codec has warmed up (its convolution plans picked with 8 GB free, its graphs captured with 48),
    # the process's GPU memory is capped at what it holds plus this (GB) (engine/gpu_memory.py: on an idle H200 a cuDNN
    # plan that took ~80 GB of workspace decoded Qwen3-TTS audio wrong); work beyond it fails its request. None: no cap
    gpu_headroom_gb: float | None = HEADROOM_GB

    # Voices.
    voices_dir: str | None = None
    voice_aliases: dict[str, str] = field(default_factory=dict)  # extra alias -> preset name

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(f"ServerConfig: {msg}")

        need(0 <= self.port <= 65535, f"port {self.port} out of range")
        need(self.token is None or len(self.token) > 0, "token must be non-empty when set")
        for name in (
            "max_streams", "max_contexts", "max_message_bytes", "max_text_chars",
            "max_context_chars", "max_reference_bytes", "max_transcript_chars",
            "max_scene_chars", "max_instructions_chars", "max_segment_chars", "max_frames", "max_send_ms",
        ):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.max_reference_s > 0, "max_reference_s must be > 0")
        need(self.max_text_chars <= self.max_context_chars, "max_text_chars > max_context_chars")
        need(0 <= self.max_buffer_delay_ms <= 10_000, "max_buffer_delay_ms must be in 0..10000")
        need(0 <= self.sentence_delay_ms <= 10_000, "sentence_delay_ms must be in 0..10000")
        need(self.default_mode in MODES, f"default_mode must be one of {MODES}")
        need(self.history_segments >= 0, "history_segments must be >= 0")
        need(self.history_max_frames >= 0, "history_max_frames must be >= 0")
        need(0 < self.stream_hold_s < self.stream_buffer_s, "need 0 < stream_hold_s < stream_buffer_s")
        need(self.slow_client_s > 0, "slow_client_s must be > 0")
        need(self.max_send_ms >= 40, "max_send_ms must be >= 40 (one codec frame)")
        need(self.heartbeat_s > 0, "heartbeat_s must be > 0")
        need(_int_or_none(self.send_buffer_kib, 4, 65536), "send_buffer_kib must be an int in 4..65536 or None")
        need(self.max_messages_per_s > 0, "max_messages_per_s must be > 0")
        need(self.idle_timeout_s > 0, "idle_timeout_s must be > 0")
        need(self.drain_s >= 0, "drain_s must be >= 0")
        need(0 <= self.resume_ahead_s < self.pause_ahead_s, "need 0 <= resume_ahead_s < pause_ahead_s")
        need(self.admit_step_ratio is None or 0 < self.admit_step_ratio <= 1, "admit_step_ratio must be in (0, 1] or None")
        need(self.codec_schedule in ("eager", "just_in_time"), "codec_schedule must be 'eager' or 'just_in_time'")
        need(_int_or_none(self.codec_sms, 1), "codec_sms must be a positive int or None")
        need(not (self.codec_overdue_first and self.codec_sms is not None),
             "codec_overdue_first needs the codec on its own stream: it cannot run with codec_sms")
        need(self.codec_starting_ms is None or self.codec_starting_ms >= 0, "codec_starting_ms must be >= 0 (0: off) or None")
        need(self.codec_starting_ahead_s is None or self.codec_starting_ahead_s > 0,
             "codec_starting_ahead_s must be > 0 or None")
        need(self.codec_starting_exempt_s is None or 0 <= self.codec_starting_exempt_s <= 0.3,
             "codec_starting_exempt_s must lie in 0..0.3 (the codec's urgent horizon) or be None")
        need(_int_or_none(self.max_first_chunk, 1, 64), "max_first_chunk must be an int in 1..64 or None")
        need(self.codec_max_windows is not None and _int_or_none(self.codec_max_windows, 1),
             "codec_max_windows must be an int >= 1")
        need(_int_or_none(self.codec_calm_windows, 1), "codec_calm_windows must be an int >= 1 or None")
        need(self.codec_queue_rounds is not None and _int_or_none(self.codec_queue_rounds, 1),
             "codec_queue_rounds must be an int >= 1")
        need(_int_or_none(self.ramp_repeat, 1, 4), "ramp_repeat must be an int in 1..4 or None")
        need(self.first_chunk_margin is None or 1 <= self.first_chunk_margin <= 10,
             "first_chunk_margin must be in 1..10 or None")
        need(0 < self.saturated_step_ratio <= 1, "saturated_step_ratio must be in (0, 1]")
        need(self.yield_ahead_s is None or self.yield_ahead_s >= 0, "yield_ahead_s must be >= 0 or None")
        need(1e-6 <= self.gil_switch_s <= 0.1, "gil_switch_s must be in [1e-6, 0.1] seconds")
        need(self.gpu_headroom_gb is None or self.gpu_headroom_gb > 0, "gpu_headroom_gb must be > 0 or None")
        need(self.context_idle_s > 0, "context_idle_s must be > 0")
        need(self.http_body_timeout_s > 0, "http_body_timeout_s must be > 0")
        need(isinstance(self.allowed_origins, tuple), "allowed_origins must be a tuple")
        for origin in self.allowed_origins:
            need(origin == "*" or (isinstance(origin, str) and ORIGIN.fullmatch(origin) is not None),
                 f"allowed origin {origin!r} must be '*' or scheme://host[:port] (http or https, no path)")
        need(isinstance(self.cors_origins, tuple), "cors_origins must be a tuple")
        for origin in self.cors_origins:
            need(isinstance(origin, str) and ORIGIN.fullmatch(origin) is not None,
                 f"CORS origin {origin!r} must be scheme://host[:port] (http or https, no path; no '*')")
        need(isinstance(self.ice_servers, tuple), "ice_servers must be a tuple")
        for url in self.ice_servers:
            m = ICE_SERVER.fullmatch(url) if isinstance(url, str) else None
            need(m is not None, f"ICE server {url!r} must be stun:HOST[:PORT] or "
                                f"turn[s]:USER:CREDENTIAL@HOST[:PORT][?transport=udp|tcp]")
            need(m["scheme"].startswith("turn") == (m["username"] is not None),
                 f"ICE server {url!r}: TURN needs USER:CREDENTIAL@, STUN takes none")
            need(m["transport"] is None or m["scheme"].startswith("turn"),
                 f"ICE server {url!r}: only TURN takes a transport")
        for alias, target in self.voice_aliases.items():
            need(isinstance(alias, str) and isinstance(target, str) and alias and target,
                 f"bad voice alias {alias!r} -> {target!r}")

    @property
    def browser_origins(self) -> tuple[str, ...]:
        """Origins a browser request may come from besides the server's own."""
        return self.allowed_origins + self.cors_origins

    @property
    def stream_buffer_samples(self) -> int:
        return int(self.stream_buffer_s * SAMPLE_RATE)

    @property
    def send_buffer_bytes(self) -> int | None:
        return None if self.send_buffer_kib is None else self.send_buffer_kib * 1024

    @property
    def stream_hold_samples(self) -> int:
        return int(self.stream_hold_s * SAMPLE_RATE)

    @property
    def max_send_bytes(self) -> int:
        return self.max_send_ms * SAMPLE_RATE // 1000 * 2  # s16 = 2 bytes/sample

    @property
    def hard_message_bytes(self) -> int:
        return 2 * self.max_message_bytes
