// voxbackend player: streams speech from the API and plays each chunk as it arrives (Web Audio API).
// Plain script, no build step. window.voxPlayer exposes the counters (tests read them).
"use strict";

const $ = (id) => document.getElementById(id);
const player = window.voxPlayer = {
  samplesReceived: 0,   // PCM samples that came over the network
  samplesScheduled: 0,  // samples handed to Web Audio buffer source nodes
  audibleFrames: 0,     // analyser frames with signal in them while playing (audio really flowed)
  chunks: 0, stalls: 0, ttfaMs: null, audioS: 0, playing: false, done: false, error: null, stats: null,
};
let ctx = null, analyser = null, cursor = null, abort = null, socket = null, sources = [];
let models = {};
let envelope = [];  // [min, max] of every 20 ms of audio received: the stream's overview in the canvas

function setStatus(text) { $("status").textContent = text; }

async function loadModels() {
  setStatus("loading models");  // the first answer waits for the front ends' voices (a few seconds)
  try {
    const r = await fetch("/v1/models");
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    models = Object.fromEntries(body.data.map((m) => [m.id, m]));
    $("model").innerHTML = body.data.map((m) => `<option>${m.id}</option>`).join("");
    showModel();
    setStatus("idle");
  } catch (e) {
    setStatus("no models: " + e.message);
  }
}

// The model's controls: its voices (first "(default)": no voice sent, the model's own, which may have no name,
// as Chatterbox's built-in one), and the inputs only some models take. A conversation model (one that answers in
// text too) gets the conversation panel (chat.js) instead of the text to speak.
function showModel() {
  const m = models[$("model").value] || {};
  const talks = !!m.conversation;
  $("chat").hidden = !talks;
  for (const id of ["text", "transport-control", "play"]) $(id).hidden = talks;
  const voices = m.voices || [];
  const byId = m.voice_kind === "speaker_id";
  $("voice").hidden = byId;
  $("voice-id").hidden = !byId;
  $("voice").innerHTML = "<option value=''>(default)</option>" + voices.map((v) => `<option>${v}</option>`).join("");
  $("exaggeration-control").hidden = !(m.inputs || []).includes("EXAGGERATION");
  $("cfg-control").hidden = !m.guidance;
}

function ensureAudio() {
  if (!ctx) {
    ctx = new AudioContext();
    analyser = ctx.createAnalyser();
    analyser.fftSize = 2048;
    analyser.connect(ctx.destination);
    requestAnimationFrame(draw);
  }
  if (ctx.state === "suspended") ctx.resume();
}

function resetReadouts() {
  Object.assign(player, { samplesReceived: 0, samplesScheduled: 0, audibleFrames: 0, chunks: 0, stalls: 0,
                          ttfaMs: null, audioS: 0, playing: true, done: false, error: null, stats: null });
  cursor = null;
  envelope = [];
  $("ttfa").textContent = "–";
  showCounters();
}

function showCounters() {
  $("chunks").textContent = player.chunks;
  $("stalls").textContent = player.stalls;
  $("audio-s").textContent = player.audioS.toFixed(2) + " s";
}

// One chunk of float samples: schedule it right after the previous one. A chunk that arrives after the
// previous one finished playing is a stall (the listener heard a gap).
function playChunk(samples, rate, t0) {
  if (!samples.length) return;
  if (player.ttfaMs === null) {
    player.ttfaMs = performance.now() - t0;
    $("ttfa").textContent = player.ttfaMs.toFixed(0) + " ms";
  }
  player.chunks += 1;
  player.samplesReceived += samples.length;
  const buffer = ctx.createBuffer(1, samples.length, rate);
  buffer.copyToChannel(samples, 0);
  const source = ctx.createBufferSource();
  source.buffer = buffer;
  source.connect(analyser);
  const now = ctx.currentTime;
  if (cursor === null) cursor = now + 0.05;
  else if (cursor < now) { player.stalls += 1; cursor = now + 0.02; }
  source.start(cursor);
  cursor += buffer.duration;
  sources.push(source);
  source.onended = () => { sources = sources.filter((s) => s !== source); };
  player.samplesScheduled += samples.length;
  const step = Math.max(1, Math.round(rate / 50));
  for (let i = 0; i < samples.length; i += step) {
    let lo = 0, hi = 0;
    for (let j = i; j < Math.min(i + step, samples.length); j++) { lo = Math.min(lo, samples[j]); hi = Math.max(hi, samples[j]); }
    envelope.push([lo, hi]);
  }
  player.audioS += buffer.duration;
  showCounters();
}

function pcm16ToFloat(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(bytes.byteLength >> 1);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32767;
  return out;
}

function requestFields() {
  const m = models[$("model").value] || {};
  const fields = { model: $("model").value };
  const voice = m.voice_kind === "speaker_id" ? $("voice-id").value : $("voice").value;
  if (voice !== "") fields.voice = voice;
  if ($("seed").value !== "") fields.seed = parseInt($("seed").value, 10);
  if ($("max-tokens").value !== "") fields.max_tokens = parseInt($("max-tokens").value, 10);
  if (!$("exaggeration-control").hidden && $("exaggeration").value !== "") {
    fields.exaggeration = parseFloat($("exaggeration").value);
  }
  if (!$("cfg-control").hidden && $("cfg-weight").value !== "") fields.cfg_weight = parseFloat($("cfg-weight").value);
  return fields;
}

async function playHttp(text, t0) {
  abort = new AbortController();
  const r = await fetch("/v1/audio/speech", {
    method: "POST", headers: { "Content-Type": "application/json" }, signal: abort.signal,
    body: JSON.stringify({ ...requestFields(), input: text, response_format: "pcm" }),
  });
  if (!r.ok) {
    const body = await r.json().catch(() => ({}));
    throw new Error(body.error ? `${body.error.message} (${body.error.param || r.status})` : r.statusText);
  }
  const rate = parseInt(r.headers.get("X-Sample-Rate") || "24000", 10);
  const reader = r.body.getReader();
  let carry = null;  // an odd byte left over from the previous read
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    let bytes = value;
    if (carry !== null) { bytes = new Uint8Array(value.length + 1); bytes[0] = carry; bytes.set(value, 1); carry = null; }
    if (bytes.length % 2) { carry = bytes[bytes.length - 1]; bytes = bytes.subarray(0, bytes.length - 1); }
    playChunk(pcm16ToFloat(bytes), rate, t0);
  }
}

function playSocket(text, t0) {
  return new Promise((resolve, reject) => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/v1/audio/speech/stream`);
    socket.binaryType = "arraybuffer";
    let rate = 24000;
    socket.onopen = () => {
      socket.send(JSON.stringify({ type: "start", ...requestFields() }));
      for (const piece of text.match(/\S+\s*/g) || []) socket.send(JSON.stringify({ type: "text", text: piece }));
      socket.send(JSON.stringify({ type: "end" }));
    };
    socket.onmessage = (event) => {
      if (typeof event.data !== "string") { playChunk(pcm16ToFloat(new Uint8Array(event.data)), rate, t0); return; }
      const message = JSON.parse(event.data);
      if (message.type === "sentence") rate = message.sample_rate;
      else if (message.type === "done") player.stats = message.stats;
      else if (message.type === "error") reject(new Error(`${message.error.message} (${message.error.param || message.error.code})`));
    };
    socket.onclose = () => resolve();
    socket.onerror = () => reject(new Error("WebSocket failed"));
  });
}

async function play() {
  ensureAudio();
  stopSources();
  resetReadouts();
  $("play").disabled = true;
  $("stop").disabled = false;
  setStatus("streaming");
  const t0 = performance.now();
  try {
    if ($("transport").value === "ws") await playSocket($("text").value, t0);
    else await playHttp($("text").value, t0);
    setStatus(player.chunks ? "received all audio" : "no audio");
  } catch (e) {
    if (e.name !== "AbortError") { player.error = e.message; setStatus("error: " + e.message); }
  } finally {
    player.done = true;
    player.playing = false;
    $("play").disabled = false;
    $("stop").disabled = true;
  }
}

function stopSources() {
  for (const s of sources) { try { s.stop(); } catch (e) { /* already ended */ } }
  sources = [];
}

function stop() {
  if (abort) abort.abort();
  if (socket) socket.close();
  stopSources();
  setStatus("stopped");
}

function draw() {
  const canvas = $("wave"), g = canvas.getContext("2d");
  const data = new Float32Array(analyser.fftSize);
  analyser.getFloatTimeDomainData(data);
  let peak = 0;
  for (const x of data) peak = Math.max(peak, Math.abs(x));
  if (peak > 1e-4) player.audibleFrames += 1;
  const w = canvas.width, h = canvas.height, half = h / 2;
  g.fillStyle = "#0b0e12";
  g.fillRect(0, 0, w, h);
  // top: everything received so far (min/max per 20 ms), squeezed to the width once it is longer
  g.fillStyle = "#7a5cff";
  const columns = Math.max(envelope.length, w / 2);
  envelope.forEach(([lo, hi], i) => {
    const x = (i / columns) * w, y0 = (0.5 - 0.45 * hi) * half, y1 = (0.5 - 0.45 * lo) * half;
    g.fillRect(x, y0, Math.max(1, w / columns), Math.max(1, y1 - y0));
  });
  // bottom: what is playing now (the analyser node after every chunk's source node)
  g.strokeStyle = "#4fa3ff";
  g.lineWidth = 2;
  g.beginPath();
  for (let i = 0; i < data.length; i++) {
    const x = (i / (data.length - 1)) * w, y = half + (0.5 - 0.45 * data[i]) * half;
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  }
  g.stroke();
  g.fillStyle = "#8b93a3";
  g.font = "12px system-ui";
  g.fillText("received", 6, 14);
  g.fillText("playing", 6, half + 14);
  requestAnimationFrame(draw);
}

async function pollGauges() {
  try {
    const r = await fetch("/v1/stats");
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    const rows = Object.entries(body.models).map(([name, e]) =>
      `<tr><td>${e.engine} <span class="sub">(${name})</span></td><td>${e.engine_alive === undefined ? "?" : e.engine_alive ? "yes" : "NO"}</td>` +
      `<td>${e.active_streams ?? "–"}</td><td>${e.queued_requests ?? "–"}</td>` +
      `<td>${e.kv_pages_used ?? "–"} / ${e.kv_pages_total ?? "–"}</td></tr>`);
    $("gauges").innerHTML = rows.join("") || "<tr><td colspan='5'>no engines</td></tr>";
    player.gauges = body.models;
  } catch (e) {
    $("gauges").innerHTML = `<tr><td colspan="5">metrics unavailable: ${e.message}</td></tr>`;
  }
  setTimeout(pollGauges, 500);
}

$("model").addEventListener("change", showModel);
$("play").addEventListener("click", play);
$("stop").addEventListener("click", stop);
loadModels();
pollGauges();
