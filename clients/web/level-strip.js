// The level strip: the output level over time, one column per `push` (the page pushes every 50 ms
// while a request plays), drawn as a bar mirrored around the middle of a canvas from left to
// right; once the canvas is full, older columns scroll off the left edge. `reset()` starts a new
// utterance.

const FLOOR_DB = -60; // a level at or below this draws nothing

export class LevelStrip {
  constructor(canvas, { columnPx = 3 } = {}) {
    this.canvas = canvas;
    this.columnPx = columnPx;
    this.levels = []; // rms per column, linear
    this.drawn = 0; // columns drawn with a visible bar since the last reset
    this.resize();
    new ResizeObserver(() => this.resize()).observe(canvas);
    matchMedia('(prefers-color-scheme: dark)').addEventListener('change', () => this.draw());
  }

  resize() {
    const ratio = window.devicePixelRatio || 1;
    const { width, height } = this.canvas.getBoundingClientRect();
    this.canvas.width = Math.max(1, Math.round(width * ratio));
    this.canvas.height = Math.max(1, Math.round(height * ratio));
    this.capacity = Math.max(1, Math.floor(this.canvas.width / (this.columnPx * ratio)));
    this.draw();
  }

  reset() {
    this.levels = [];
    this.drawn = 0;
    this.draw();
  }

  push(rms) {
    this.levels.push(rms);
    if (this.levels.length > this.capacity) this.levels.shift();
    if (height01(rms) > 0) this.drawn += 1;
    this.draw();
  }

  draw() {
    const ctx = this.canvas.getContext('2d');
    const { width, height } = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const col = this.columnPx * ratio;
    const style = getComputedStyle(this.canvas); // read each time: the colour scheme may change
    ctx.clearRect(0, 0, width, height);
    ctx.fillStyle = style.getPropertyValue('--strip-mid').trim() || '#ccc';
    ctx.fillRect(0, Math.floor(height / 2), width, Math.max(1, Math.round(ratio)));
    ctx.fillStyle = style.getPropertyValue('--strip-color').trim() || '#2a7';
    this.levels.forEach((rms, i) => {
      const h = height01(rms) * (height - 2);
      if (h > 0) ctx.fillRect(i * col, (height - h) / 2, Math.max(1, col - ratio), h);
    });
  }

  // For the tests: how much was drawn.
  summary() {
    return { columns: this.levels.length, drawn: this.drawn, max: Math.max(0, ...this.levels) };
  }
}

// A level as a share of the strip's height: dB from FLOOR_DB (0) to 0 dBFS (1).
function height01(rms) {
  if (!(rms > 0)) return 0;
  return Math.max(0, Math.min(1, 1 - (20 * Math.log10(rms)) / FLOOR_DB));
}
