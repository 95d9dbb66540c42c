// higgs-stream browser demo: speak text over the WebSocket protocol (PCM into an AudioWorklet ring
// buffer) or over WebRTC (an aiortc audio track; text and events on a data channel).
// Protocol: stream/PROTOCOL.md. `?token=T` in the page URL is passed on to the server.
// Text goes out whole, in LLM-sized pieces, or word by word as it is typed; a reference voice
// (file or microphone) rides on the first text message. The page draws the output level over time
// and a latency timeline per request, and downloads what it played as a WAV.
// Everything measured is kept in `window.stats` (read by the headless browser tests); times are
// ms since the request's first text message.
import { LevelStrip } from './level-strip.js';
import { ReferenceVoice } from './reference.js';
import { Timeline } from './timeline.js';
import { openWebSocket, RtcPeer } from './transports.js';
import { saveBlob, wavBlob } from './wav.js';

const SAMPLE_RATE = 24000;
const query = new URLSearchParams(location.search);
const token = query.get('token');
// Jitter buffer before an utterance starts playing (WebSocket). 0 plays the first packet at once,
// which stays gapless only while the server runs comfortably ahead of real time.
const PREBUFFER_MS = query.has('prebuffer_ms') ? Number(query.get('prebuffer_ms')) : 100;
const LLM_PIECE_MS = 60; // "like an LLM": one piece every 60 ms ...
const LLM_WORDS = [2, 1, 3, 1, 2, 4]; // ... of this many words, in turn (about 30 words/s)
const $ = (id) => document.getElementById(id);

const stats = (window.stats = {
  transport: null,
  mode: null, // whole | llm | typing
  prebufferMs: PREBUFFER_MS,
  contextId: null,
  events: [], // protocol and player events, in order ('ready', 'audio_start', 'done:completed', ...)
  sent: [], // types of the messages sent for the current request ('text', 'text:flush', 'end', 'cancel')
  textMessages: 0,
  reference: null, // {source, name, bytes, seconds} of the reference sent with the current request
  bytes: 0, // PCM bytes received for the current context (WebSocket)
  chunks: 0,
  arrivals: [], // [ms, samples] per PCM frame (WebSocket)
  firstByteMs: null, // first PCM byte (WebSocket)
  ttfaMs: null, // first sample played (worklet) / playout start (WebRTC audio_start)
  bufferedMs: 0,
  underruns: 0,
  waits: 0, // LLM pieces / typing: times playback caught up with the text (not underruns)
  worklet: null, // last stats message of the worklet
  maxRms: 0, // loudest analyser window since Play
  strip: null, // the level strip's summary
  timeline: null, // the current request's timeline row
  download: null, // {samples, bytes, name} of the last WAV downloaded
  pcState: null,
  rtc: null, // inbound-rtp stats (WebRTC)
  done: null, // the server's done message for the current context
  errors: [],
  voices: [],
});

let audio = null; // {ctx, node, analyser, buf}
let audioSetup = null; // the promise of `audio`
let ws = null; // the WebSocket channel of the latest request
let socketCount = 0; // WebSockets opened; only the latest one's events count
let rtc = null; // the WebRTC peer (RtcPeer), kept across requests
// The request playing: {id, transport, mode, channel: {send(str), close()}, sentAt, options (until the
// first text message takes them), pcm: Int16Array[], row, playing, cancelled, finished, over, failed,
// typing, sentUpTo}
let current = null;
let contextCounter = 0;
let underrunBase = 0; // the worklet counts underruns since the page loaded; stats count per Play
let waitBase = 0;

const strip = new LevelStrip($('strip'));
const timeline = new Timeline($('timeline'), $('timeline-scale'));
const reference = new ReferenceVoice(
  { file: $('ref-file'), record: $('ref-record'), clear: $('ref-clear'), transcript: $('ref-transcript'),
    preview: $('ref-preview'), status: $('ref-status') },
  async () => (await ensureAudio()).ctx,
  () => {
    $('voice').disabled = reference.active;
    $('voice-note').hidden = !reference.active;
  },
);

function setStatus(text, isError = false) {
  const el = $('status');
  el.textContent = text;
  el.className = isError ? 'error' : '';
}

function fail(message) {
  stats.errors.push(message);
  setStatus(message, true);
  if (current) {
    current.over = true;
    current.typing = false;
  }
  setPlaying(false);
  if (ws && ws.open()) { // a failed play leaves no connection behind
    const channel = ws;
    ws = null;
    channel.close();
  }
}

function withToken(path, scheme) {
  const url = new URL(path, location.href);
  if (scheme) url.protocol = scheme;
  if (token) url.searchParams.set('token', token);
  return url.toString();
}

function tokenHint() {
  return token ? 'the page passes its ?token= on: is it the server\'s token?'
    : 'this server needs a token: open the page as /?token=YOUR_TOKEN';
}

function authHeaders(extra = {}) {
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

function setPlaying(on) {
  $('play').disabled = on;
  $('stop').disabled = !on;
  $('finish').disabled = !(on && current && current.typing);
  document.querySelectorAll('input[name=send]').forEach((el) => { el.disabled = on; });
  $('transport').disabled = on;
  const pcm = current && current.transport === 'ws' && current.pcm.length > 0;
  $('download').disabled = on || !pcm;
}

function sendMode() {
  return document.querySelector('input[name=send]:checked').value;
}

// ---- audio graph ----

// The audio graph, made once (the first Play or Record), resumed when the browser suspended it.
async function ensureAudio() {
  if (!audioSetup) audioSetup = createAudio().catch((err) => { audioSetup = null; throw err; });
  const a = await audioSetup;
  if (a.ctx.state !== 'running') await a.ctx.resume();
  return a;
}

async function createAudio() {
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
  if (current && !current.over) {
    if (rms > stats.maxRms) stats.maxRms = rms;
    strip.push(rms);
    stats.strip = strip.summary();
  }
}

function onPlayer(msg) {
  if (msg.type === 'stats') {
    stats.worklet = msg;
    if (stats.transport === 'ws') {
      stats.bufferedMs = msg.bufferedMs;
      stats.underruns = msg.underruns - underrunBase;
      stats.waits = msg.waits - waitBase;
    }
    render();
  } else if (msg.type === 'started') {
    stats.events.push('started');
    if (current && stats.ttfaMs === null) stats.ttfaMs = since(current);
    render();
  } else if (msg.type === 'drained') {
    stats.events.push('drained');
    if (current && current.finished) {
      current.over = true;
      mark('endMs');
      setStatus('done');
      setPlaying(false);
    }
  }
}

function since(req) {
  return req.sentAt === null ? 0 : performance.now() - req.sentAt;
}

// Sets a timeline time of the current request (once) and redraws.
function mark(field, value = since(current)) {
  if (current.row[field] === null) current.row[field] = value;
  stats.timeline = current.row;
  timeline.render();
}

function render() {
  $('ttfa').textContent = stats.ttfaMs === null ? '–' : `${stats.ttfaMs.toFixed(0)} ms`;
  $('buffered').textContent = `${stats.bufferedMs.toFixed(0)} ms`;
  $('underruns').textContent = String(stats.underruns);
  $('waits').textContent = stats.mode === 'whole' || stats.transport !== 'ws' ? '–' : String(stats.waits);
  $('prebuffer').textContent = stats.transport === 'webrtc' ? 'WebRTC (browser)' : `${PREBUFFER_MS} ms`;
  $('received').textContent = `${(stats.bytes / 2 / SAMPLE_RATE).toFixed(2)} s`;
}

// ---- protocol messages (shared by both transports) ----

function send(msg) {
  if (!current || current.over) return;
  const now = performance.now();
  if (current.sentAt === null) current.sentAt = now;
  stats.sent.push(msg.flush ? 'text:flush' : msg.type);
  if (msg.type === 'text') {
    stats.textMessages += 1;
    current.row.sends.push(now - current.sentAt);
    timeline.render();
  }
  try {
    current.channel.send(JSON.stringify(msg));
  } catch (err) {
    fail(`${current.transport}: ${err.message || err}`);
  }
}

// A text message; the first of a context carries its options.
function sendText(text, extra = {}) {
  const msg = { type: 'text', context_id: current.id, text, ...extra };
  if (current.options) {
    Object.assign(msg, current.options);
    current.options = null;
  }
  send(msg);
}

async function contextOptions() {
  const options = {};
  const ref = await reference.option();
  if (ref) options.reference = ref;
  else options.voice = $('voice').value || 'default';
  const seed = $('seed').value.trim();
  if (seed !== '') options.seed = Number(seed);
  return options;
}

function onServerMessage(msg) {
  const mine = current && msg.context_id === current.id;
  if (msg.type === 'ready') {
    stats.events.push('ready');
  } else if (msg.type === 'audio_start' && mine) {
    stats.events.push('audio_start');
    current.playing = true;
    if (current.transport === 'webrtc') {
      if (stats.ttfaMs === null) stats.ttfaMs = since(current);
      mark('firstAudioMs');
    }
    setStatus(current.typing ? 'speaking as you type…' : 'playing');
  } else if (msg.type === 'done' && mine) {
    stats.events.push(`done:${msg.reason}`);
    stats.done = msg;
    current.finished = true;
    current.playing = false;
    current.typing = false;
    current.row.reason = msg.reason;
    mark('doneMs');
    if (current.transport === 'ws') {
      audio.node.port.postMessage({ type: 'end' });
      current.channel.close();
    }
    if (msg.reason === 'cancelled') {
      current.over = true;
      setStatus('stopped');
      setPlaying(false);
    } else if (msg.reason === 'error') {
      current.over = true;
      setPlaying(false);
    } else if (current.transport === 'webrtc') {
      stats.bytes = 2 * (msg.samples || 0); // what the track played (the audio itself is not seen here)
      current.over = true;
      mark('endMs', current.row.doneMs); // done is sent when playout reaches the end
      setStatus('done');
      setPlaying(false);
    } else {
      setStatus('finishing playback…');
      setPlaying(true);
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
    const hint = msg.code === 'unauthorized' ? ` (${tokenHint()})` : '';
    fail(`server error [${msg.code}]: ${msg.message}${hint}`);
  }
}

function onPcm(buf) {
  if (!current || !current.playing || current.cancelled) return; // audio of a stopped context
  if (buf.byteLength % 2 !== 0) {
    fail(`odd PCM frame of ${buf.byteLength} bytes`);
    return;
  }
  if (stats.firstByteMs === null) {
    stats.firstByteMs = since(current);
    mark('firstAudioMs', stats.firstByteMs);
  }
  stats.bytes += buf.byteLength;
  stats.chunks += 1;
  stats.arrivals.push([since(current), buf.byteLength / 2]);
  current.pcm.push(new Int16Array(buf.slice(0))); // kept for the download; `buf` goes to the worklet
  audio.node.port.postMessage({ type: 'pcm', data: buf }, [buf]);
}

// ---- transports (transports.js): each gives a channel {send(str), close(), open()} ----

async function openChannel(transport) {
  if (transport === 'ws') {
    const wsUrl = withToken('/v1/tts/stream', location.protocol === 'https:' ? 'wss:' : 'ws:');
    const n = ++socketCount;
    const latest = (fn) => (...args) => { if (n === socketCount) fn(...args); }; // not a replaced socket's
    ws = await openWebSocket(wsUrl, {
      message: latest(onServerMessage), pcm: latest(onPcm), closed: latest(onWebSocketClosed),
    });
    return ws;
  }
  if (!rtc || !rtc.usable) {
    const peer = new RtcPeer(withToken('/v1/webrtc/offer'), authHeaders(), {
      message: onServerMessage,
      track: (stream) => {
        const el = $('rtc-audio');
        el.srcObject = stream; // Chromium plays remote WebRTC audio only through a media element
        el.play().catch((err) => fail(`audio element: ${err}`));
        audio.ctx.createMediaStreamSource(stream).connect(audio.analyser); // level meter only
      },
      state: (state) => {
        stats.pcState = state;
        if (state === 'failed') fail('WebRTC connection failed');
      },
    });
    peer.ready.catch(() => { if (rtc === peer) rtc = null; });
    rtc = peer;
  }
  return rtc.channel();
}

function onWebSocketClosed(code) {
  stats.events.push(`close:${code}`);
  if (!current || current.finished || current.over) return;
  if (code === 1008) {
    fail(`unauthorized (close 1008): ${tokenHint()}`);
  } else {
    fail(`connection closed (${code}) before the audio finished`);
  }
}

async function pollRtcStats() {
  if (!rtc) return;
  const s = await rtc.inboundAudio();
  if (!s) return;
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

// ---- how the text goes out ----

// LLM-sized pieces of `text` (joined, they are `text`): LLM_WORDS words each, in turn.
function llmPieces(text) {
  const words = text.match(/\s*\S+\s*/g) || [];
  const pieces = [];
  for (let i = 0, k = 0; i < words.length; k++) {
    const n = LLM_WORDS[k % LLM_WORDS.length];
    pieces.push(words.slice(i, i + n).join(''));
    i += n;
  }
  return pieces;
}

async function sendLikeAnLlm(req, text) {
  for (const piece of llmPieces(text)) {
    if (current !== req || req.cancelled || req.over) return;
    sendText(piece);
    await new Promise((ok) => setTimeout(ok, LLM_PIECE_MS));
  }
  if (current === req && !req.cancelled && !req.over) send({ type: 'end', context_id: req.id });
}

// Type as you talk: every finished word goes out as it is typed; Enter speaks what is pending at
// once (`flush:true`); Finish sends the rest and `end`. Text before the cursor that was already
// sent cannot be unsaid: editing it changes nothing.
function onTyping(e) {
  const req = current;
  if (!req || !req.typing) return;
  const value = $('text').value;
  if (value.length < req.sentUpTo) {
    req.sentUpTo = value.length;
    return;
  }
  const pending = value.slice(req.sentUpTo);
  if (e.inputType === 'insertLineBreak') {
    if (pending.trim()) sendText(pending, { flush: true });
    else if (req.sentAt !== null) send({ type: 'flush', context_id: req.id });
    req.sentUpTo = value.length;
    return;
  }
  const cut = pending.search(/\s\S*$/); // the last whitespace: everything before it is finished words
  if (cut >= 0 && pending.slice(0, cut + 1).trim()) {
    sendText(pending.slice(0, cut + 1));
    req.sentUpTo += cut + 1;
  }
}

function finishTyping() {
  const req = current;
  if (!req || !req.typing) return;
  req.typing = false;
  const rest = $('text').value.slice(req.sentUpTo);
  if (rest.trim()) sendText(rest);
  if (req.sentAt === null) { // nothing was typed: no context exists
    req.over = true;
    req.finished = true;
    req.channel.close();
    setStatus('nothing typed');
    setPlaying(false);
    return;
  }
  send({ type: 'end', context_id: req.id });
  setStatus('finishing…');
  setPlaying(true);
}

// ---- controls ----

async function play() {
  const mode = sendMode();
  const text = $('text').value;
  if (mode !== 'typing' && !text.trim()) {
    setStatus('type some text first', true);
    return;
  }
  const transport = $('transport').value;
  const id = `ctx-${Date.now()}-${++contextCounter}`;
  const label = `#${contextCounter} ${transport === 'ws' ? 'WebSocket' : 'WebRTC'}, ${
    { whole: 'whole text', llm: 'LLM pieces', typing: 'typed' }[mode]}`;
  current = {
    id, transport, mode, channel: null, sentAt: null, pcm: [], row: timeline.start(label), options: null,
    playing: false, cancelled: false, finished: false, over: false, failed: false, typing: false, sentUpTo: 0,
  };
  const req = current;
  setPlaying(true);
  try {
    req.options = await contextOptions();
    await ensureAudio();
  } catch (err) {
    fail(`${err.message || err}`);
    return;
  }
  audio.node.port.postMessage({ type: 'clear' });
  // Text that comes in pieces can run out before the audio does: then playback waits for it.
  audio.node.port.postMessage({ type: 'waits', on: mode !== 'whole' });
  Object.assign(stats, {
    transport, mode, contextId: id, bytes: 0, chunks: 0, arrivals: [], firstByteMs: null, ttfaMs: null, maxRms: 0,
    underruns: 0, waits: 0, done: null, sent: [], textMessages: 0, timeline: req.row,
    reference: reference.active ? { ...reference.info } : null,
  });
  underrunBase = stats.worklet ? stats.worklet.underruns : 0;
  waitBase = stats.worklet ? stats.worklet.waits : 0;
  stats.events.push(`play:${transport}`);
  strip.reset();
  setStatus(mode === 'typing' ? 'connecting…' : 'waiting for audio…');
  render();
  try {
    req.channel = await openChannel(transport);
    if (current !== req || req.cancelled || req.over) {
      req.channel.close(); // stopped while connecting
      return;
    }
    if (mode === 'whole') {
      sendText(text);
      send({ type: 'end', context_id: id });
    } else if (mode === 'llm') {
      await sendLikeAnLlm(req, text);
    } else {
      req.typing = true;
      $('text').value = '';
      $('text').focus();
      setPlaying(true);
      setStatus('type: each finished word is spoken; Enter speaks at once; Finish ends');
    }
  } catch (err) {
    fail(`${transport}: ${err.message || err}`);
  }
}

function stop() {
  const req = current;
  if (!req || req.finished || req.over) return;
  req.cancelled = true;
  req.typing = false;
  stats.events.push('stop');
  if (req.transport === 'ws') audio.node.port.postMessage({ type: 'clear' }); // silence now; the server confirms with done
  if (req.sentAt === null) { // no text went out: there is no context to cancel
    req.over = true;
    if (req.channel) req.channel.close();
    setStatus('stopped');
    setPlaying(false);
    return;
  }
  send({ type: 'cancel', context_id: req.id }); // WebRTC: the server also drops the track's queued audio
  if (!req.over) setStatus('stopping…');
}

function download() {
  if (!current || current.pcm.length === 0) return;
  const samples = current.pcm.reduce((n, c) => n + c.length, 0);
  const name = `higgs-stream-${current.id}.wav`;
  const blob = wavBlob(current.pcm, SAMPLE_RATE);
  stats.download = { samples, bytes: blob.size, name };
  saveBlob(blob, name);
}

async function loadVoices() {
  const select = $('voice');
  let names = ['default'];
  try {
    const r = await fetch(withToken('/v1/voices'), { headers: authHeaders() });
    if (r.status === 401) throw new Error(`401: ${tokenHint()}`);
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

function onModeChange() {
  const mode = sendMode();
  $('play').textContent = mode === 'typing' ? 'Start typing' : 'Play';
  $('finish').hidden = mode !== 'typing';
}

$('play').onclick = play;
$('stop').onclick = stop;
$('finish').onclick = finishTyping;
$('download').onclick = download;
$('text').addEventListener('input', onTyping);
document.querySelectorAll('input[name=send]').forEach((el) => el.addEventListener('change', onModeChange));
onModeChange();
setPlaying(false);
setInterval(pollRtcStats, 500);
window.higgs = { play, stop, finishTyping, llmPieces, reference, ready: loadVoices() };
