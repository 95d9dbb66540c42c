// WAV files in the browser: 16-bit PCM mono, what the demo downloads (the audio it played) and what
// it sends as a recorded reference voice.

// A WAV Blob of `chunks` (Int16Array each, s16 samples) at `rate` Hz.
export function wavBlob(chunks, rate) {
  const samples = chunks.reduce((n, c) => n + c.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const ascii = (at, text) => [...text].forEach((ch, i) => header.setUint8(at + i, ch.charCodeAt(0)));
  ascii(0, 'RIFF');
  header.setUint32(4, 36 + 2 * samples, true);
  ascii(8, 'WAVE');
  ascii(12, 'fmt ');
  header.setUint32(16, 16, true); // fmt chunk size
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, rate, true);
  header.setUint32(28, 2 * rate, true); // bytes per second
  header.setUint16(32, 2, true); // bytes per frame
  header.setUint16(34, 16, true); // bits per sample
  ascii(36, 'data');
  header.setUint32(40, 2 * samples, true);
  return new Blob([header, ...chunks], { type: 'audio/wav' });
}

// Float samples in [-1, 1] (e.g. from the microphone) as s16.
export function toInt16(floats) {
  const out = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) {
    const x = Math.max(-1, Math.min(1, floats[i]));
    out[i] = Math.round(x * 32767);
  }
  return out;
}

// The bytes of a Blob as base64 (what the protocol's `reference.audio` carries).
export async function blobToBase64(blob) {
  const bytes = new Uint8Array(await blob.arrayBuffer());
  let binary = '';
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

// Saves `blob` as a file named `name` (a click on a temporary link).
export function saveBlob(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = Object.assign(document.createElement('a'), { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
