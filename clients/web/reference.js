// The reference voice (voice cloning): an audio file the user picks, or a microphone recording made
// here (an AudioWorklet takes the samples; they are sent as a WAV), plus its transcript. The
// server takes it as the `reference` option of a context's first text message (PROTOCOL.md §1.1):
// {audio: base64 file, transcript}; it checks the file (≤ 6 MiB, ≤ 30 s, decodable, not silent).

import { blobToBase64, toInt16, wavBlob } from './wav.js';

export const MAX_REFERENCE_BYTES = 6 << 20;
const MAX_RECORD_S = 20;
export const READ_ALOUD = 'The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background.';

export class ReferenceVoice {
  // els: {file, record, clear, transcript, preview, status}; audioContext: async () => AudioContext;
  // onChange(): called when a reference is set or cleared.
  constructor(els, audioContext, onChange) {
    this.els = els;
    this.audioContext = audioContext;
    this.onChange = onChange;
    this.blob = null;
    this.info = null; // {source: 'file'|'mic', name, bytes, seconds}
    this.recording = null; // {stream, source, node, sink, chunks, samples, rate, timer}
    els.file.addEventListener('change', () => this.pick(els.file.files[0]));
    els.record.addEventListener('click', () => (this.recording ? this.stopRecording() : this.startRecording()));
    els.clear.addEventListener('click', () => this.clear());
  }

  get active() {
    return this.blob !== null;
  }

  pick(file) {
    if (!file) return;
    if (file.size > MAX_REFERENCE_BYTES) {
      this.say(`${file.name} is ${(file.size / 2 ** 20).toFixed(1)} MiB; the server takes at most 6 MiB`, true);
      this.els.file.value = '';
      return;
    }
    this.set(file, { source: 'file', name: file.name, bytes: file.size, seconds: null });
  }

  async startRecording() {
    let rec;
    this.els.record.disabled = true; // until the microphone is open
    try {
      rec = await this.openMicrophone();
    } catch (err) {
      this.say(`microphone: ${err.message || err}`, true);
      return;
    } finally {
      this.els.record.disabled = false;
    }
    const { node } = rec;
    node.port.onmessage = (e) => {
      rec.chunks.push(toInt16(e.data.data));
      rec.samples += e.data.data.length;
      this.say(`recording… ${(rec.samples / rec.rate).toFixed(1)} s`);
      if (rec.samples >= MAX_RECORD_S * rec.rate) this.stopRecording();
    };
    this.recording = rec;
    if (!this.els.transcript.value.trim()) this.els.transcript.value = READ_ALOUD;
    this.els.record.textContent = 'Stop recording';
    this.els.record.setAttribute('aria-pressed', 'true');
    this.say('recording… read the transcript aloud');
  }

  // The microphone into a recorder worklet: {stream, source, node, sink, chunks, samples, rate}.
  async openMicrophone() {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    try {
      const ctx = await this.audioContext();
      const source = ctx.createMediaStreamSource(stream);
      const node = new AudioWorkletNode(ctx, 'pcm-recorder', { numberOfOutputs: 1 });
      const sink = ctx.createGain(); // the graph renders nodes that lead to the destination
      sink.gain.value = 0;
      source.connect(node).connect(sink).connect(ctx.destination);
      return { stream, source, node, sink, chunks: [], samples: 0, rate: ctx.sampleRate };
    } catch (err) {
      stream.getTracks().forEach((t) => t.stop());
      throw err;
    }
  }

  stopRecording() {
    const rec = this.recording;
    if (!rec) return;
    this.recording = null;
    rec.node.port.postMessage({ type: 'stop' });
    rec.node.port.onmessage = null;
    rec.source.disconnect();
    rec.node.disconnect();
    rec.sink.disconnect();
    rec.stream.getTracks().forEach((t) => t.stop());
    this.els.record.textContent = 'Record';
    this.els.record.setAttribute('aria-pressed', 'false');
    if (rec.samples < rec.rate / 2) {
      this.say('the recording is shorter than 0.5 s; record again', true);
      return;
    }
    this.set(wavBlob(rec.chunks, rec.rate),
      { source: 'mic', name: 'microphone.wav', bytes: 44 + 2 * rec.samples, seconds: rec.samples / rec.rate });
  }

  set(blob, info) {
    this.blob = blob;
    this.info = info;
    if (this.els.preview.src) URL.revokeObjectURL(this.els.preview.src);
    this.els.preview.src = URL.createObjectURL(blob);
    this.els.preview.hidden = false;
    this.els.clear.disabled = false;
    const length = info.seconds === null ? '' : `, ${info.seconds.toFixed(1)} s`;
    this.say(`using ${info.name} (${(info.bytes / 1024).toFixed(0)} KiB${length}) as the voice`);
    this.onChange();
  }

  clear() {
    if (this.recording) this.stopRecording();
    this.blob = null;
    this.info = null;
    this.els.file.value = '';
    if (this.els.preview.src) URL.revokeObjectURL(this.els.preview.src);
    this.els.preview.removeAttribute('src');
    this.els.preview.hidden = true;
    this.els.clear.disabled = true;
    this.say('no reference: the voice menu applies');
    this.onChange();
  }

  // The `reference` option, or null when none is set. Throws when the transcript is missing.
  async option() {
    if (!this.blob) return null;
    const transcript = this.els.transcript.value.trim();
    if (!transcript) throw new Error('the reference needs its transcript (what is said in it)');
    return { audio: await blobToBase64(this.blob), transcript };
  }

  say(text, isError = false) {
    this.els.status.textContent = text;
    this.els.status.classList.toggle('error', isError);
  }
}
