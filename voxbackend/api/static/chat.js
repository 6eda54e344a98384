// voxbackend player, conversation mode (a model whose /v1/models entry says conversation): your turn, recorded from
// the microphone, taken from a file or typed, goes to POST /v1/chat/completions with stream: true; the spoken reply
// plays as its PCM16 deltas arrive (player.js's playChunk) and its transcript shows as it comes. The conversation's
// earlier turns go along as history (yours as sent, the assistant's by their transcript).
// Audio leaves as a 16-bit WAV encoded here: MediaRecorder's webm/opus is no format the server reads.
// window.voxChat exposes the state (tests read it). Uses player.js's globals.
"use strict";

const RATE = 24000;  // the replies' PCM16 rate
const MAX_CLIP_S = 59.5;  // the server takes 60 s a clip
const MAX_HISTORY = 32;  // turns the model takes before the current one
const chat = window.voxChat = {
  recording: false, clipS: 0, turns: 0, transcript: "", textPieces: 0, audioPieces: 0, done: false, error: null,
  lastRequest: null,  // the body of the last request sent
};
let earlier = [];  // the conversation so far, as messages
let clip = null;  // the next turn's audio: {wav: Uint8Array, seconds, name}
let recorder = null;

function wavFile(samples, rate) {
  const out = new DataView(new ArrayBuffer(44 + 2 * samples.length));
  const ascii = (at, text) => { for (let i = 0; i < text.length; i++) out.setUint8(at + i, text.charCodeAt(i)); };
  ascii(0, "RIFF");
  out.setUint32(4, 36 + 2 * samples.length, true);
  ascii(8, "WAVEfmt ");
  out.setUint32(16, 16, true);  // PCM, mono, 16 bits
  out.setUint16(20, 1, true);
  out.setUint16(22, 1, true);
  out.setUint32(24, rate, true);
  out.setUint32(28, 2 * rate, true);
  out.setUint16(32, 2, true);
  out.setUint16(34, 16, true);
  ascii(36, "data");
  out.setUint32(40, 2 * samples.length, true);
  for (let i = 0; i < samples.length; i++) {
    out.setInt16(44 + 2 * i, Math.round(Math.max(-1, Math.min(1, samples[i])) * 32767), true);
  }
  return new Uint8Array(out.buffer);
}

function toBase64(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function fromBase64(text) {
  const raw = atob(text);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}

function setClip(samples, rate, name) {
  clip = samples.length ? { wav: wavFile(samples, rate), seconds: samples.length / rate, name } : null;
  chat.clipS = clip ? clip.seconds : 0;
  $("clip").textContent = clip ? `${name}: ${clip.seconds.toFixed(1)} s` : "no audio";
}

async function startRecording() {
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
  const context = new AudioContext();
  const source = context.createMediaStreamSource(stream);
  // ScriptProcessorNode is deprecated, but needs no worklet module; it only runs while connected to the output,
  // through a silent gain here (no echo of the microphone)
  const tap = context.createScriptProcessor(4096, 1, 1);
  const silent = context.createGain();
  silent.gain.value = 0;
  const pieces = [];
  recorder = { stream, context, pieces, samples: 0 };
  tap.onaudioprocess = (event) => {
    if (!recorder || recorder.pieces !== pieces) return;
    pieces.push(new Float32Array(event.inputBuffer.getChannelData(0)));
    recorder.samples += event.inputBuffer.length;
    chat.clipS = recorder.samples / context.sampleRate;
    $("clip").textContent = `recording ${chat.clipS.toFixed(1)} s`;
    if (chat.clipS >= MAX_CLIP_S) stopRecording();
  };
  source.connect(tap);
  tap.connect(silent);
  silent.connect(context.destination);
  chat.recording = true;
  $("record").textContent = "■ Stop recording";
  $("record").classList.add("recording");
}

function stopRecording() {
  if (!recorder) return;
  const { stream, context, pieces, samples } = recorder;
  recorder = null;
  for (const track of stream.getTracks()) track.stop();
  const all = new Float32Array(samples);
  let at = 0;
  for (const piece of pieces) { all.set(piece.subarray(0, samples - at), at); at += piece.length; }
  setClip(all, context.sampleRate, "recording");
  context.close();
  chat.recording = false;
  $("record").textContent = "● Record";
  $("record").classList.remove("recording");
}

async function toggleRecording() {
  try {
    if (recorder) stopRecording();
    else await startRecording();
  } catch (e) {
    chat.error = e.message;
    setStatus("microphone: " + e.message);
  }
}

async function takeFile() {
  const file = $("chat-file").files[0];
  if (!file) return;
  try {
    ensureAudio();
    const decoded = await ctx.decodeAudioData(await file.arrayBuffer());
    const mono = new Float32Array(decoded.length);
    for (let c = 0; c < decoded.numberOfChannels; c++) {
      const channel = decoded.getChannelData(c);
      for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / decoded.numberOfChannels;
    }
    setClip(mono, decoded.sampleRate, file.name);
  } catch (e) {
    setStatus(`cannot read ${file.name}: ${e.message}`);
  }
  $("chat-file").value = "";
}

function addTurn(who, text) {
  const turn = document.createElement("div");
  turn.className = `turn ${who}`;
  turn.innerHTML = `<span class="who">${who === "user" ? "you" : "assistant"}</span><span class="text"></span>`;
  turn.lastChild.textContent = text;
  $("turns").appendChild(turn);
  $("turns").scrollTop = $("turns").scrollHeight;
  return turn.lastChild;
}

// Server-Sent Events: each `data:` payload to onEvent; true when the stream ended with [DONE]
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return true;
      if (data) onEvent(JSON.parse(data));
    }
  }
}

async function send() {
  if (recorder) stopRecording();
  const typed = $("chat-text").value.trim();
  if (!clip && !typed) { setStatus("record, pick a file or type your turn first"); return; }
  ensureAudio();
  stopSources();
  resetReadouts();
  const content = [];
  if (typed) content.push({ type: "text", text: typed });
  if (clip) content.push({ type: "input_audio", input_audio: { data: toBase64(clip.wav), format: "wav" } });
  const user = { role: "user", content };
  const system = $("system-prompt").value.trim();
  const { model, voice, ...sampling } = requestFields();
  const speak = $("speak").checked;
  const body = { model, stream: true, modalities: speak ? ["text", "audio"] : ["text"],
                 messages: [...(system ? [{ role: "system", content: system }] : []), ...earlier, user], ...sampling };
  if (speak) body.audio = { voice: voice || "default", format: "pcm16" };
  chat.lastRequest = body;
  addTurn("user", [typed, clip ? `[${clip.name}, ${clip.seconds.toFixed(1)} s]` : ""].filter(Boolean).join(" "));
  const reply = addTurn("assistant", "");
  $("chat-text").value = "";
  setClip(new Float32Array(0), RATE, "");
  Object.assign(chat, { transcript: "", textPieces: 0, audioPieces: 0, done: false, error: null });
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("streaming");
  const t0 = performance.now();
  abort = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal: abort.signal, body: JSON.stringify(body),
    });
    if (!r.ok) {
      const error = (await r.json().catch(() => ({}))).error;
      throw new Error(error ? `${error.message} (${error.param || r.status})` : r.statusText);
    }
    const complete = await readEvents(r, (event) => {
      if (event.error) throw new Error(`${event.error.message} (${event.error.param || event.error.code})`);
      const delta = (event.choices[0] || {}).delta || {};
      const audio = delta.audio || {};
      if (audio.data) {
        chat.audioPieces += 1;
        playChunk(pcm16ToFloat(fromBase64(audio.data)), RATE, t0);
      }
      const piece = audio.transcript || delta.content;
      if (piece) {
        chat.textPieces += 1;
        chat.transcript += piece;
        reply.textContent = chat.transcript;
      }
    });
    if (!complete) throw new Error("the reply was cut off");
    // the model takes an assistant turn by its text: a reply without any is left out of the history
    earlier.push(user, ...(chat.transcript ? [{ role: "assistant", content: chat.transcript }] : []));
    earlier = earlier.slice(-MAX_HISTORY);
    chat.turns += 1;
    setStatus(speak ? (player.chunks ? "received the reply" : "a reply without audio") : "received the text reply");
  } catch (e) {
    if (e.name !== "AbortError") { chat.error = player.error = e.message; setStatus("error: " + e.message); }
  } finally {
    chat.done = player.done = true;
    player.playing = false;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function newConversation() {
  earlier = [];
  chat.turns = 0;
  $("turns").innerHTML = "";
}

$("record").addEventListener("click", toggleRecording);
$("chat-file").addEventListener("change", takeFile);
$("send").addEventListener("click", send);
$("new-chat").addEventListener("click", newConversation);
$("chat-text").addEventListener("keydown", (e) => { if (e.key === "Enter") send(); });
