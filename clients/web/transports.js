// The two ways the page talks to the server. Each gives a channel {send(str), close()} for the
// client messages; server messages (and, over the WebSocket, the PCM) go to handlers.
// Protocol: stream/PROTOCOL.md §1 (WebSocket) and §5 (WebRTC).

// Opens a WebSocket and resolves once it is open (a socket that never opens rejects).
// handlers: {message(obj), pcm(ArrayBuffer), closed(code)}; `closed` only for a socket that was open.
export function openWebSocket(url, handlers) {
  return new Promise((resolve, reject) => {
    const sock = new WebSocket(url);
    sock.binaryType = 'arraybuffer';
    let opened = false;
    sock.onopen = () => {
      opened = true;
      resolve({ send: (m) => sock.send(m), close: () => sock.close(1000), open: () => sock.readyState <= WebSocket.OPEN });
    };
    sock.onmessage = (e) => {
      if (typeof e.data === 'string') handlers.message(JSON.parse(e.data));
      else handlers.pcm(e.data);
    };
    sock.onclose = (e) => { // also after an error: the browser closes the socket with 1006
      if (opened) handlers.closed(e.code);
      else reject(new Error(`could not connect (close ${e.code})`));
    };
  });
}

// A WebRTC peer: a receive-only audio transceiver (added first) and one data channel; one offer
// and answer over HTTP once ICE gathering completed (no trickle ICE). Reused across requests.
// handlers: {message(obj), track(MediaStream), state(connectionState)}.
export class RtcPeer {
  constructor(offerUrl, headers, handlers) {
    this.pc = new RTCPeerConnection();
    this.pc.addTransceiver('audio', { direction: 'recvonly' });
    this.dc = this.pc.createDataChannel('tts', { ordered: true });
    this.pc.ontrack = (e) => handlers.track(e.streams[0] || new MediaStream([e.track]));
    this.pc.onconnectionstatechange = () => handlers.state(this.pc.connectionState);
    this.dc.onmessage = (e) => handlers.message(JSON.parse(e.data));
    this.ready = this.connect(offerUrl, headers);
  }

  async connect(offerUrl, headers) {
    const pc = this.pc;
    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    const r = await fetch(offerUrl, {
      method: 'POST',
      headers: { ...headers, 'Content-Type': 'application/json' },
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }),
    });
    if (!r.ok) throw new Error(`offer refused: ${r.status} ${await r.text()}`);
    await pc.setRemoteDescription(await r.json());
    if (this.dc.readyState !== 'open') await new Promise((ok) => this.dc.addEventListener('open', ok, { once: true }));
  }

  get usable() {
    return !['failed', 'closed'].includes(this.pc.connectionState);
  }

  // The data channel as a channel; a message over the peer's SCTP limit throws (a long reference).
  async channel() {
    await this.ready;
    const limit = this.pc.sctp ? this.pc.sctp.maxMessageSize : Infinity;
    const send = (m) => {
      if (m.length > limit) {
        throw new Error(`a ${(m.length / 1024).toFixed(0)} KiB message is over this data channel's ` +
          `${(limit / 1024).toFixed(0)} KiB limit (a long reference?): use the WebSocket transport`);
      }
      this.dc.send(m);
    };
    return { send, close: () => {}, open: () => this.dc.readyState === 'open' }; // the peer stays for the next request
  }

  // The inbound-rtp audio stats (packets, concealment, jitter buffer), or null before any.
  async inboundAudio() {
    let found = null;
    (await this.pc.getStats()).forEach((s) => {
      if (s.type === 'inbound-rtp' && s.kind === 'audio') found = s;
    });
    return found;
  }
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
