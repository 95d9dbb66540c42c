// The latency timeline: one row per request, newest first, on a common time scale. Each row is a
// bar from the request's first text message (0 ms) through its first audio to `done` (the server's
// last audio) and on to the end of playback, with a tick for every text message sent; the numbers
// are written out beside it (the bar itself is decoration for screen readers).

const MAX_ROWS = 8;

export class Timeline {
  constructor(list, scaleNote) {
    this.list = list;
    this.scaleNote = scaleNote;
    this.rows = []; // newest first
  }

  // A new request; returns its record, which the page fills in as events arrive (ms since its first
  // text message), calling `render()` after each change.
  start(label) {
    const row = { label, sends: [], firstAudioMs: null, doneMs: null, endMs: null, reason: null };
    this.rows.unshift(row);
    this.rows.length = Math.min(this.rows.length, MAX_ROWS);
    this.render();
    return row;
  }

  render() {
    const scale = Math.max(1000, ...this.rows.map((r) => r.endMs ?? r.doneMs ?? r.firstAudioMs ?? 0));
    const pct = (ms) => `${((100 * ms) / scale).toFixed(2)}%`;
    this.scaleNote.textContent = this.rows.length ? `bars: 0 to ${ms(scale)} after each request's first text` : '';
    this.list.replaceChildren(...this.rows.map((row) => {
      const li = document.createElement('li');
      li.className = 'tl-row';
      li.dataset.firstAudioMs = row.firstAudioMs ?? '';
      li.dataset.doneMs = row.doneMs ?? '';
      li.dataset.sends = row.sends.length;
      const bar = document.createElement('div');
      bar.className = 'tl-bar';
      bar.setAttribute('aria-hidden', 'true');
      const span = (cls, from, to) => {
        if (from === null || to === null || to < from) return;
        const el = document.createElement('span');
        el.className = cls;
        el.style.left = pct(from);
        el.style.width = pct(to - from);
        bar.append(el);
      };
      const first = row.firstAudioMs;
      span('tl-wait', 0, first ?? row.doneMs);
      span('tl-stream', first, row.doneMs);
      span('tl-play', row.doneMs ?? null, row.endMs);
      for (const t of row.sends) {
        const tick = document.createElement('span');
        tick.className = 'tl-send';
        tick.style.left = pct(t);
        bar.append(tick);
      }
      const text = document.createElement('div');
      text.className = 'tl-text';
      text.textContent = describe(row);
      li.append(text, bar);
      return li;
    }));
  }
}

function ms(x) {
  return x >= 1000 ? `${(x / 1000).toFixed(2)} s` : `${Math.round(x)} ms`;
}

function describe(row) {
  const parts = [row.label];
  if (row.sends.length > 1) parts.push(`${row.sends.length} text messages`);
  parts.push(row.firstAudioMs === null ? 'waiting for audio' : `first audio ${ms(row.firstAudioMs)}`);
  if (row.doneMs !== null) parts.push(`done ${ms(row.doneMs)}${row.reason && row.reason !== 'completed' ? ` (${row.reason})` : ''}`);
  if (row.endMs !== null) parts.push(`played out ${ms(row.endMs)}`);
  return parts.join(' · ');
}
