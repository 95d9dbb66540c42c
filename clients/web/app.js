// higgs-stream browser demo: speak text over the WebSocket protocol (PCM into an AudioWorklet ring
// buffer) or over WebRTC (an aiortc audio track; text and events on a data channel).
// Protocol: stream/PROTOCOL.md. `?token=T` in the page URL is passed on to the server.
// Everything measured is kept in `window.stats` (read by the headless browser tests).
'use strict';

const SAMPLE_RATE = 24000;
const query = new URLSearchParams(location.search);
const token = query.get('token');
// Jitter buffer before an utterance starts playing (WebSocket). 0 plays the first packet at once,
// which stays gapless only while the server runs comfortably ahead of real time.
const PREBUFFER_MS = query.has('prebuffer_ms') ? Number(query.get('prebuffer_ms')) : 100;
const $ = (id) => document.getElementById(id);

const stats = (window.stats = {
  transport: null,
  prebufferMs: PREBUFFER_MS,
  contextId: null,
  events: [], // protocol and player events, in order ('ready', 'audio_start', 'done:completed', ...)
  bytes: 0, // PCM bytes received for the current context (WebSocket)
  chunks: 0,
  arrivals: [], // [ms since Play, samples] per PCM frame (WebSocket)
  firstByteMs: null, // Play -> first PCM byte (WebSocket)
  ttfaMs: null, // Play -> first sample played (worklet) / playout start (WebRTC audio_start)
  bufferedMs: 0,
  underruns: 0,
  worklet: null, // last stats message of the worklet
  maxRms: 0, // loudest analyser window since Play
  pcState: null,
  rtc: null, // inbound-rtp stats (WebRTC)
  done: null, // the server's done message for the current context
  errors: [],
  voices: [],
});

let audio = null; // {ctx, node, analyser}
let ws = null;
let rtc = null; // {pc, dc, ready: Promise}
let current = null; // {id, t0, playing, cancelled, finished}
let contextCounter = 0;
let underrunBase = 0; // the worklet counts underruns since the page loaded; stats count per Play

function setStatus(text, isError = false) {
  const el = $('status');
  el.textContent = text;
  el.className = isError ? 'error' : '';
}

function fail(message) {
  stats.errors.push(message);
  setStatus(message, true);
  setPlaying(false);
  if (ws && ws.readyState <= WebSocket.OPEN) { // a failed play leaves no connection behind
    const sock = ws;
    ws = null;
    sock.close(1000);
  }
}

function withToken(path, scheme) {
  const url = new URL(path, location.href);
  if (scheme) url.protocol = scheme;
  if (token) url.searchParams.set('token', token);
  return url.toString();
}

function authHeaders(extra = {}) {
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

function setPlaying(on) {
  $('play').disabled = on;
  $('stop').disabled = !on;
}

// ---- audio graph ----

async function ensureAudio() {
  if (audio) {
    if (audio.ctx.state !== 'running') await audio.ctx.resume();
    return audio;
  }
  const ctx = new AudioContext({ sampleRate: SAMPLE_RATE, latencyHint: 'interactive' });
  await ctx.audioWorklet.addModule('pcm-worklet.js');
  const node = new AudioWorkletNode(ctx, 'pcm-player', {
    numberOfInputs: 0,
    outputChannelCount: [1],
    processorOptions: { inputRate: SAMPLE_RATE, prebufferMs: PREBUFFER_MS },
  });
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  node.connect(ctx.destination);
  node.connect(analyser);
  node.port.onmessage = (e) => onPlayer(e.data);
  if (ctx.state !== 'running') await ctx.resume();
  audio = { ctx, node, analyser, buf: new Float32Array(analyser.fftSize) };
  setInterval(meter, 50);
  return audio;
}

function meter() {
  const { analyser, buf } = audio;
  analyser.getFloatTimeDomainData(buf);
  let sum = 0;
  for (let i = 0; i < buf.length; i++) sum += buf[i] * buf[i];
  const rms = Math.sqrt(sum / buf.length);
  if (current && rms > stats.maxRms) stats.maxRms = rms;
  $('meter').firstElementChild.style.width = `${Math.min(100, rms * 400)}%`;
}

function onPlayer(msg) {
  if (msg.type === 'stats') {
    stats.worklet = msg;
    if (stats.transport === 'ws') {
      stats.bufferedMs = msg.bufferedMs;
      stats.underruns = msg.underruns - underrunBase;
    }
    render();
  } else if (msg.type === 'started') {
    stats.events.push('started');
    if (current && stats.ttfaMs === null) stats.ttfaMs = performance.now() - current.t0;
    render();
  } else if (msg.type === 'drained') {
    stats.events.push('drained');
    if (current && current.finished) {
      setStatus('done');
      setPlaying(false);
    }
  }
}

function render() {
  $('ttfa').textContent = stats.ttfaMs === null ? '–' : `${stats.ttfaMs.toFixed(0)} ms`;
  $('buffered').textContent = `${stats.bufferedMs.toFixed(0)} ms`;
  $('underruns').textContent = String(stats.underruns);
  $('prebuffer').textContent = stats.transport === 'webrtc' ? 'WebRTC (browser)' : `${PREBUFFER_MS} ms`;
  $('received').textContent = `${(stats.bytes / 2 / SAMPLE_RATE).toFixed(2)} s`;
}

// ---- protocol messages (shared by both transports) ----

function requestMessages(id) {
  const text = { type: 'text', context_id: id, text: $('text').value, voice: $('voice').value || 'default' };
  const seed = $('seed').value.trim();
  if (seed !== '') text.seed = Number(seed);
  return [JSON.stringify(text), JSON.stringify({ type: 'end', context_id: id })];
}

function onServerMessage(msg) {
  const mine = current && msg.context_id === current.id;
  if (msg.type === 'ready') {
    stats.events.push('ready');
  } else if (msg.type === 'audio_start' && mine) {
    stats.events.push('audio_start');
    current.playing = true;
    if (stats.transport === 'webrtc' && stats.ttfaMs === null) stats.ttfaMs = performance.now() - current.t0;
    setStatus('playing');
  } else if (msg.type === 'done' && mine) {
    stats.events.push(`done:${msg.reason}`);
    stats.done = msg;
    current.finished = true;
    current.playing = false;
    if (stats.transport === 'ws') {
      audio.node.port.postMessage({ type: 'end' });
      ws.close(1000);
    }
    if (msg.reason === 'cancelled') {
      setStatus('stopped');
      setPlaying(false);
    } else if (msg.reason === 'error') {
      setPlaying(false);
    } else if (stats.transport === 'webrtc') {
      stats.bytes = 2 * (msg.samples || 0); // what the track played (the audio itself is not seen here)
      setStatus('done');
      setPlaying(false);
    } else {
      setStatus('finishing playback…');
    }
    render();
  } else if (msg.type === 'error') {
    stats.events.push(`error:${msg.code}`);
    // The first error of a request is the one to show: after a refused text (e.g. too_large) the
    // `end` that follows is answered `not_found`, which says nothing to the user.
    if (current && msg.context_id === current.id) {
      if (current.failed) return;
      current.failed = true;
    }
    const hint = msg.code !== 'unauthorized' ? ''
      : token ? ' (the page passes its ?token= on: is it the server\'s token?)'
        : ' (this server needs a token: open the page as /?token=YOUR_TOKEN)';
    fail(`server error [${msg.code}]: ${msg.message}${hint}`);
  }
}

function onPcm(buf) {
  if (!current || !current.playing || current.cancelled) return; // audio of a stopped context
  if (buf.byteLength % 2 !== 0) {
    fail(`odd PCM frame of ${buf.byteLength} bytes`);
    return;
  }
  if (stats.firstByteMs === null) stats.firstByteMs = performance.now() - current.t0;
  stats.bytes += buf.byteLength;
  stats.chunks += 1;
  stats.arrivals.push([performance.now() - current.t0, buf.byteLength / 2]);
  audio.node.port.postMessage({ type: 'pcm', data: buf }, [buf]);
}

// ---- WebSocket ----

function playWebSocket(id) {
  const sock = new WebSocket(withToken('/v1/tts/stream', location.protocol === 'https:' ? 'wss:' : 'ws:'));
  sock.binaryType = 'arraybuffer';
  ws = sock;
  sock.onopen = () => requestMessages(id).forEach((m) => sock.send(m));
  sock.onmessage = (e) => {
    if (sock !== ws) return;
    if (typeof e.data === 'string') onServerMessage(JSON.parse(e.data));
    else onPcm(e.data);
  };
  sock.onerror = () => { if (sock === ws) fail('WebSocket error'); };
  sock.onclose = (e) => {
    stats.events.push(`close:${e.code}`);
    if (sock !== ws || !current || current.finished) return;
    if (e.code === 1008) {
      fail(token ? 'unauthorized: the server refused this token (close 1008)'
        : 'unauthorized: this server needs a token; open the page as /?token=YOUR_TOKEN (close 1008)');
    } else {
      fail(`connection closed (${e.code}) before the audio finished`);
    }
  };
}

// ---- WebRTC ----

function connectRtc() {
  const pc = new RTCPeerConnection();
  pc.addTransceiver('audio', { direction: 'recvonly' }); // the audio transceiver comes first
  const dc = pc.createDataChannel('tts', { ordered: true });
  const el = $('rtc-audio');
  pc.ontrack = (e) => {
    const stream = e.streams[0] || new MediaStream([e.track]);
    el.srcObject = stream; // Chromium plays remote WebRTC audio only through a media element
    el.play().catch((err) => fail(`audio element: ${err}`));
    audio.ctx.createMediaStreamSource(stream).connect(audio.analyser); // level meter only
  };
  pc.onconnectionstatechange = () => {
    stats.pcState = pc.connectionState;
    if (pc.connectionState === 'failed') fail('WebRTC connection failed');
  };
  dc.onmessage = (e) => onServerMessage(JSON.parse(e.data));
  const ready = (async () => {
    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    const r = await fetch(withToken('/v1/webrtc/offer'), {
      method: 'POST',
      headers: authHeaders({ 'Content-Type': 'application/json' }),
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }),
    });
    if (!r.ok) throw new Error(`offer refused: ${r.status} ${await r.text()}`);
    await pc.setRemoteDescription(await r.json());
    if (dc.readyState !== 'open') await new Promise((ok) => dc.addEventListener('open', ok, { once: true }));
  })();
  const conn = { pc, dc, ready };
  ready.catch(() => { if (rtc === conn) rtc = null; });
  return conn;
}

function iceGatheringComplete(pc) {
  if (pc.iceGatheringState === 'complete') return Promise.resolve();
  return new Promise((resolve) => {
    const check = () => {
      if (pc.iceGatheringState === 'complete') {
        pc.removeEventListener('icegatheringstatechange', check);
        resolve();
      }
    };
    pc.addEventListener('icegatheringstatechange', check);
    setTimeout(resolve, 3000); // host candidates are enough on a LAN; do not wait forever for STUN
  });
}

async function playWebRtc(id) {
  if (!rtc || ['failed', 'closed'].includes(rtc.pc.connectionState)) rtc = connectRtc();
  const conn = rtc;
  await conn.ready;
  if (!current || current.id !== id || current.cancelled) return;
  requestMessages(id).forEach((m) => conn.dc.send(m));
}

async function pollRtcStats() {
  if (!rtc) return;
  const report = await rtc.pc.getStats();
  report.forEach((s) => {
    if (s.type === 'inbound-rtp' && s.kind === 'audio') {
      stats.rtc = {
        packetsReceived: s.packetsReceived,
        concealmentEvents: s.concealmentEvents,
        totalSamplesReceived: s.totalSamplesReceived,
        jitterBufferDelay: s.jitterBufferDelay,
        jitterBufferEmittedCount: s.jitterBufferEmittedCount,
      };
      if (stats.transport === 'webrtc') {
        stats.underruns = s.concealmentEvents || 0;
        stats.bufferedMs = s.jitterBufferEmittedCount ? (1000 * s.jitterBufferDelay) / s.jitterBufferEmittedCount : 0;
        render();
      }
    }
  });
}

// ---- controls ----

async function play() {
  const text = $('text').value;
  if (!text.trim()) {
    setStatus('type some text first', true);
    return;
  }
  setPlaying(true);
  try {
    await ensureAudio();
  } catch (err) {
    fail(`audio: ${err}`);
    return;
  }
  audio.node.port.postMessage({ type: 'clear' });
  const id = `ctx-${Date.now()}-${++contextCounter}`;
  const transport = $('transport').value;
  Object.assign(stats, {
    transport, contextId: id, bytes: 0, chunks: 0, arrivals: [], firstByteMs: null, ttfaMs: null, maxRms: 0,
    underruns: 0, done: null,
  });
  underrunBase = stats.worklet ? stats.worklet.underruns : 0;
  stats.events.push(`play:${transport}`);
  current = { id, t0: performance.now(), playing: false, cancelled: false, finished: false };
  setStatus('waiting for audio…');
  render();
  try {
    if (transport === 'ws') playWebSocket(id);
    else await playWebRtc(id);
  } catch (err) {
    fail(`${transport}: ${err}`);
  }
}

function stop() {
  if (!current || current.finished) return;
  current.cancelled = true;
  stats.events.push('stop');
  const cancel = JSON.stringify({ type: 'cancel', context_id: current.id });
  if (stats.transport === 'ws') {
    audio.node.port.postMessage({ type: 'clear' }); // silence now; the server confirms with done
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(cancel);
  } else if (rtc && rtc.dc.readyState === 'open') {
    rtc.dc.send(cancel); // the server drops the track's queued audio
  }
  setStatus('stopping…');
}

async function loadVoices() {
  const select = $('voice');
  let names = ['default'];
  try {
    const r = await fetch(withToken('/v1/voices'), { headers: authHeaders() });
    if (!r.ok) throw new Error(`${r.status} ${await r.text()}`);
    const body = await r.json();
    names = [body.default, ...body.voices.map((v) => v.name).filter((n) => n !== body.default)];
    setStatus('ready');
  } catch (err) {
    fail(`could not load the voice list (${err}); using the default voice`);
  }
  stats.voices = names;
  select.replaceChildren(...names.map((n) => new Option(n, n)));
}

$('play').onclick = play;
$('stop').onclick = stop;
setInterval(pollRtcStats, 500);
window.higgs = { play, stop, ready: loadVoices() };
