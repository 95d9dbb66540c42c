// Two AudioWorklet processors for the demo page.
//
// 'pcm-player': gapless playback of s16le mono PCM from a Float32 ring buffer.
// Main thread -> processor (port messages):
//   {type: 'pcm', data: ArrayBuffer}   s16le mono samples at `inputRate` (whole samples only)
//   {type: 'end'}                      no more audio for this utterance: running dry is not an underrun
//   {type: 'clear'}                    barge-in: drop everything buffered, back to idle
//   {type: 'waits', on: bool}          on: running dry before 'end' is a wait for more text (text sent
//                                      in pieces), not an underrun: buffer `prebufferMs` again, count it in `waits`
// Processor -> main thread:
//   {type: 'started'}                  first sample of an utterance reached the output
//   {type: 'drained'}                  buffer ran dry after 'end'
//   {type: 'stats', buffered, bufferedMs, underruns, underrunQuanta, waits, overflows, quanta, played}
//
// Playback of an utterance starts once `prebufferMs` of audio is buffered (0: with the first
// sample) or its 'end' has arrived. An underrun is counted once each time the ring runs dry while
// an utterance is playing and its 'end' has not arrived; silence is output until data comes back
// (no re-buffering delay). When the context rate differs from `inputRate`, samples are linearly
// interpolated.
//
// 'pcm-recorder': hands the main thread its input (the microphone) as Float32 blocks of 128
// samples at the context's rate, {type: 'pcm', data: Float32Array}, until it gets {type: 'stop'}.

class PCMPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.inputRate = opts.inputRate || 24000;
    const capacitySeconds = opts.capacitySeconds || 120;
    this.statsEveryQuanta = opts.statsEveryQuanta || 8;
    this.prebuffer = Math.round((this.inputRate * (opts.prebufferMs || 0)) / 1000);
    this.ring = new Float32Array(Math.ceil(this.inputRate * capacitySeconds));
    this.step = this.inputRate / sampleRate; // input samples consumed per output sample
    this.readPos = 0; // integer index of the next unread sample in the ring
    this.frac = 0; // fractional position between readPos and readPos + 1 (resampling only)
    this.count = 0; // unread samples in the ring
    this.state = 'idle'; // idle | buffering | playing | starved
    this.ended = false;
    this.underruns = 0;
    this.underrunQuanta = 0;
    this.waitsForText = false;
    this.waits = 0;
    this.overflows = 0;
    this.quanta = 0;
    this.played = 0; // output samples that carried audio
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg.type === 'pcm') {
      this.write(new Int16Array(msg.data));
      if (this.state === 'idle') {
        this.state = 'buffering';
        this.ended = false;
        this.announceStart = true;
      }
      if (this.state === 'buffering' && this.count >= this.prebuffer) this.state = 'playing';
    } else if (msg.type === 'end') {
      this.ended = true;
      if (this.state === 'buffering') this.state = 'playing';
    } else if (msg.type === 'waits') {
      this.waitsForText = msg.on;
    } else if (msg.type === 'clear') {
      this.readPos = 0;
      this.frac = 0;
      this.count = 0;
      this.state = 'idle';
      this.ended = false;
      this.postStats();
    }
  }

  write(samples) {
    const cap = this.ring.length;
    const free = cap - this.count;
    let n = samples.length;
    if (n > free) {
      this.overflows += 1;
      n = free; // keep what fits; the rest is dropped and counted
    }
    let w = (this.readPos + this.count) % cap;
    for (let i = 0; i < n; i++) {
      this.ring[w] = samples[i] / 32768;
      w = w + 1 === cap ? 0 : w + 1;
    }
    this.count += n;
  }

  // Sample `offset` places after the read position (caller guarantees offset < count).
  peek(offset) {
    return this.ring[(this.readPos + offset) % this.ring.length];
  }

  advance(n) {
    this.readPos = (this.readPos + n) % this.ring.length;
    this.count -= n;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    this.quanta += 1;
    if (this.state === 'idle' || this.state === 'buffering') {
      out.fill(0);
    } else {
      let i = 0;
      if (this.step === 1) {
        const n = Math.min(out.length, this.count);
        for (; i < n; i++) out[i] = this.peek(i);
        this.advance(n);
      } else {
        for (; i < out.length; i++) {
          if (this.count < 2) break; // interpolation needs this sample and the next
          const a = this.peek(0);
          const b = this.peek(1);
          out[i] = a + (b - a) * this.frac;
          this.frac += this.step;
          const whole = Math.floor(this.frac);
          this.frac -= whole;
          this.advance(Math.min(whole, this.count));
        }
      }
      this.played += i;
      if (i > 0 && this.announceStart) {
        this.announceStart = false;
        this.port.postMessage({ type: 'started' });
      }
      if (i < out.length) {
        out.fill(0, i);
        if (this.ended) {
          // The utterance finished: drop a possible last odd sample and go idle.
          this.advance(this.count);
          this.frac = 0;
          this.state = 'idle';
          this.ended = false;
          this.postStats();
          this.port.postMessage({ type: 'drained' });
        } else if (this.waitsForText) {
          if (this.state === 'playing') this.waits += 1;
          this.state = 'buffering'; // the next sentence starts after its own prebuffer
        } else {
          if (this.state === 'playing') this.underruns += 1;
          this.state = 'starved';
          this.underrunQuanta += 1;
        }
      } else if (this.state === 'starved') {
        this.state = 'playing';
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (this.quanta % this.statsEveryQuanta === 0) this.postStats();
    return true;
  }

  postStats() {
    this.port.postMessage({
      type: 'stats',
      buffered: this.count,
      bufferedMs: (1000 * this.count) / this.inputRate,
      underruns: this.underruns,
      underrunQuanta: this.underrunQuanta,
      waits: this.waits,
      overflows: this.overflows,
      quanta: this.quanta,
      played: this.played,
      state: this.state,
    });
  }
}

registerProcessor('pcm-player', PCMPlayer);

class PCMRecorder extends AudioWorkletProcessor {
  constructor() {
    super();
    this.recording = true;
    this.port.onmessage = (e) => {
      if (e.data.type === 'stop') this.recording = false;
    };
  }

  process(inputs) {
    const input = inputs[0];
    if (this.recording && input.length > 0) this.port.postMessage({ type: 'pcm', data: input[0].slice() });
    return this.recording;
  }
}

registerProcessor('pcm-recorder', PCMRecorder);
