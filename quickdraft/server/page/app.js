// The chat page of `quickdraft serve`: plain browser JavaScript, no build step, nothing fetched from elsewhere.
// It talks to the server's own OpenAI-compatible API and asks for the per-token speculation trace (the
// `speculation_trace` request field; docs/server.md, "The chat page"), which says which drafter proposed each kept
// token.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "quickdraft-api-key";
const SOURCES = { draft: "draft model", ngram: "n-gram lookup", suffix: "suffix decoding", target: "target" };
const page = { history: [], controller: null, busy: false };

// ---- the server ---------------------------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

// fetch, asking for the API key (once per tab) when the server answers 401
async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(path, { ...init, headers: { ...(init.headers || {}), ...authHeaders() } });
    if (response.status !== 401) return response;
    const had = sessionStorage.getItem(KEY);
    sessionStorage.removeItem(KEY);
    await askKey(had ? "That key was refused: try again." : "");
  }
}

function askKey(problem) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").hidden = !problem;
    $("key-error").textContent = problem;
    $("key").value = "";
    $("key-form").onsubmit = () => {
      sessionStorage.setItem(KEY, $("key").value.trim());
      resolve();
    };
    dialog.showModal();
  });
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
    if (response.headers.get("Retry-After")) message += ` (retry after ${response.headers.get("Retry-After")} s)`;
  } catch (_) { /* not JSON: the status says it */ }
  return new Error(message);
}

async function loadModel() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw await errorOf(response);
    const card = (await response.json()).data[0];
    page.model = card.id;
    $("model").textContent = `${card.id} · draft: ${card.draft} · context ${card.context_length}`;
  } catch (e) {
    $("model").textContent = "server unreachable";
    showError($("chat"), "Cannot read the served model: " + e.message);
  }
}

// ---- the request ------------------------------------------------------------------------------------------

function requestBody(messages, speculation) {
  const body = { messages, stream: true, stream_options: { include_usage: true }, speculation_trace: true };
  if (page.model) body.model = page.model;
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const seed = parseInt($("seed").value, 10);
  if (!Number.isNaN(seed)) body.seed = seed;
  if (speculation === "off") body.speculative = { draft_max: 0 };
  else if (speculation === "fixed") body.speculative = { draft_max: parseInt($("k").value, 10) || 4, adaptive: false };
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error("The JSON schema box does not hold JSON: " + e.message); }
    body.response_format = { type: "json_schema", json_schema: { name: "page", schema: parsed } };
  }
  return body;
}

function conversation(prompt) {
  const system = $("system").value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...page.history, { role: "user", content: prompt }];
}

// Stream one answer into msg (an Answer); resolves when it ends, rejects with the server's message.
async function stream(body, msg, signal) {
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        msg.take(chunk);
      }
    }
  }
}

// ---- an answer on the page --------------------------------------------------------------------------------

class Answer {
  constructor(parent, label) {
    this.content = "";
    this.trace = [];  // {text, source, step, k} per token, in order
    this.timings = null;
    this.finish = null;
    this.started = performance.now();
    this.firstAt = null;
    this.el = document.createElement("div");
    this.el.className = "msg assistant streaming";
    this.el.innerHTML = `<div class="label"><span class="who"></span><span class="state"></span></div>
      <div class="stats"></div><svg class="chart" preserveAspectRatio="none" aria-label="rounds"></svg>
      <div class="body"></div><div class="actions"><button type="button" class="copy">Copy</button></div>`;
    this.el.querySelector(".who").textContent = label;
    this.el.querySelector(".copy").onclick = () => copy(this.content, this.el.querySelector(".copy"));
    parent.appendChild(this.el);
    this.scheduled = false;
  }

  take(chunk) {
    const choice = chunk.choices && chunk.choices[0];
    if (choice) {
      const delta = choice.delta || {};
      if (delta.content) this.content += delta.content;
      if (choice.trace) {
        if (this.firstAt === null && choice.trace.length) this.firstAt = performance.now();
        this.trace.push(...choice.trace);
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
    if (chunk.timings) this.timings = chunk.timings;
    this.schedule();
  }

  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    requestAnimationFrame(() => { this.scheduled = false; this.render(); });
  }

  end(state) {
    this.el.classList.remove("streaming");
    this.el.dataset.finish = this.finish || state;
    if (this.timings) {
      this.el.dataset.draftAccepted = this.timings.draft_n_accepted;
      this.el.dataset.drafted = this.timings.draft_n;
    }
    if (state) this.el.querySelector(".state").textContent = state;
    this.render();
  }

  rounds() {  // one per step (a round or a plain step): its tokens, those kept from a drafter, its k
    const out = [];
    for (const t of this.trace) {
      let last = out[out.length - 1];
      if (!last || last.step !== t.step) out.push(last = { step: t.step, k: t.k, kept: 0, source: null, n: 0 });
      last.n += 1;
      if (t.source !== "target") { last.kept += 1; last.source = t.source; }
    }
    return out;
  }

  render() {
    renderBody(this.el.querySelector(".body"), this.content, this.trace);
    const rounds = this.rounds();
    renderChart(this.el.querySelector(".chart"), rounds);
    this.el.querySelector(".stats").innerHTML = this.statsLine(rounds);
    const chat = $("chat");
    if (chat.scrollHeight - chat.scrollTop - chat.clientHeight < 120) chat.scrollTop = chat.scrollHeight;
  }

  statsLine(rounds) {
    const spec = rounds.filter((r) => r.k > 0);
    const t = this.timings;  // at the end, the server's own counts (they include a kept draft of the end token)
    const drafted = t ? t.draft_n : spec.reduce((s, r) => s + r.k, 0);
    const kept = t ? t.draft_n_accepted : spec.reduce((s, r) => s + r.kept, 0);
    const perRound = spec.length ? spec.reduce((s, r) => s + r.n, 0) / spec.length : 0;
    let rate = this.trace.length > 1 && this.firstAt !== null
      ? (this.trace.length - 1) / ((performance.now() - this.firstAt) / 1000) : 0;
    if (t) rate = t.predicted_per_second;
    const lastK = rounds.length ? rounds[rounds.length - 1].k : 0;
    const parts = [
      `<span class="tps"><b>${rate.toFixed(1)}</b> tok/s</span>`,
      `<span>accepted <b>${drafted ? Math.round((100 * kept) / drafted) : 0}%</b> (${kept}/${drafted})</span>`,
      `<span><b>${perRound.toFixed(2)}</b> tokens/round</span>`,
      `<span>k <b>${lastK}</b>${t ? ` (mean ${t.k_mean.toFixed(1)})` : ""}</span>`,
      `<span>${this.trace.length} tokens</span>`,
    ];
    if (t) {
      // the wait before the first token: the prefill of what the server did not already hold of the conversation
      const reused = t.cache_n ? `, ${t.cache_n} of ${t.cache_n + t.prompt_n} prompt tokens reused` : "";
      parts.push(`<span class="ttft">first token <b>${(t.ttft_ms / 1000).toFixed(2)} s</b>${reused}</span>`);
      parts.push(`<span>drafter ${escapeHtml(t.drafter)}</span>`);
    }
    return parts.join("");
  }
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// The text as paragraphs and fenced code blocks, every character in a span of its token, coloured by the
// token's source. The content is what the server sent as text; the trace maps its characters to tokens.
function renderBody(el, content, trace) {
  const tokenOf = new Int32Array(content.length).fill(-1);
  let at = 0;
  trace.forEach((t, i) => {
    for (let j = 0; j < t.text.length && at < content.length; j++) tokenOf[at++] = i;
  });
  el.textContent = "";
  for (const block of blocks(content)) {
    const holder = block.code ? document.createElement("pre") : document.createDocumentFragment();
    let start = block.start;
    for (let i = block.start + 1; i <= block.end; i++) {
      if (i === block.end || tokenOf[i] !== tokenOf[start]) {
        const span = document.createElement("span");
        const token = tokenOf[start];
        span.className = "tok " + (token >= 0 ? trace[token].source : "target");
        if (token >= 0) {
          span.dataset.t = token;
          span.title = `${SOURCES[trace[token].source] || trace[token].source} · step ${trace[token].step}` +
            (trace[token].k ? ` (k ${trace[token].k})` : " (plain step)");
        }
        span.textContent = content.slice(start, i);
        holder.appendChild(span);
        start = i;
      }
    }
    el.appendChild(holder);
  }
}

function blocks(text) {  // [{code, start, end}]: ``` fenced code (fences included) and the text between
  const out = [];
  let start = 0, inCode = false, lineStart = 0;
  while (lineStart <= text.length) {
    let lineEnd = text.indexOf("\n", lineStart);
    lineEnd = lineEnd < 0 ? text.length : lineEnd + 1;
    if (text.slice(lineStart, lineEnd).trimStart().startsWith("```")) {
      if (!inCode) {
        if (lineStart > start) out.push({ code: false, start, end: lineStart });
        start = lineStart;
        inCode = true;
      } else {
        out.push({ code: true, start, end: lineEnd });
        start = lineEnd;
        inCode = false;
      }
    }
    if (lineEnd >= text.length) break;
    lineStart = lineEnd;
  }
  if (start < text.length) out.push({ code: inCode, start, end: text.length });
  return out;
}

function renderChart(svg, rounds) {
  const shown = rounds.slice(-400);
  const height = Math.max(4, ...shown.map((r) => Math.max(r.k, r.n))) + 0.5;  // room for the top tick
  svg.setAttribute("viewBox", `0 0 ${Math.max(shown.length, 20)} ${height}`);
  let out = "";
  shown.forEach((r, x) => {
    const keptClass = r.source === "ngram" ? "kept-ngram" : r.source === "suffix" ? "kept-suffix" : "kept-draft";
    if (r.kept) out += `<rect class="${keptClass}" x="${x + 0.1}" y="${height - r.kept}" width="0.8" height="${r.kept}"/>`;
    out += `<rect class="own" x="${x + 0.1}" y="${height - r.n}" width="0.8" height="${r.n - r.kept}"/>`;
    if (r.k) out += `<line class="k" x1="${x + 0.05}" x2="${x + 0.95}" y1="${height - r.k}" y2="${height - r.k}"/>`;
  });
  svg.innerHTML = out;
}

function copy(text, button) {
  const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1200); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text, done));
  } else fallbackCopy(text, done);
}

function fallbackCopy(text, done) {
  const area = document.createElement("textarea");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  done();
}

function showError(parent, message) {
  const el = document.createElement("div");
  el.className = "msg error";
  el.setAttribute("role", "alert");
  el.textContent = message;
  parent.appendChild(el);
  return el;
}

function addUser(prompt) {
  $("empty").hidden = true;
  const el = document.createElement("div");
  el.className = "msg user";
  el.textContent = prompt;
  $("chat").appendChild(el);
}

// ---- sending ------------------------------------------------------------------------------------------------

function setBusy(busy) {
  page.busy = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function run(msg, body) {
  page.controller = new AbortController();
  try {
    await stream(body, msg, page.controller.signal);
    msg.end(msg.finish === "length" ? "cut at max tokens" : "");
    return true;
  } catch (e) {
    if (e.name === "AbortError") {
      msg.end("stopped");
      return false;
    }
    msg.end("failed");
    showError(msg.el, e.message);
    return false;
  }
}

async function send(prompt) {
  const messages = conversation(prompt);
  const speculation = $("speculation").value;
  let body;
  try { body = requestBody(messages, speculation); } catch (e) { showError($("chat"), e.message); return; }
  addUser(prompt);
  setBusy(true);
  try {
    if ($("side-by-side").checked) await sideBySide(messages, speculation, body);
    else {
      const msg = new Answer($("chat"), speculation === "off" ? "speculation off" : `speculation ${speculation}`);
      if (await run(msg, body)) page.history.push({ role: "user", content: prompt }, { role: "assistant", content: msg.content });
    }
  } finally {
    setBusy(false);
    page.controller = null;
  }
}

async function sideBySide(messages, speculation, body) {  // body: as sent without side by side
  const pair = document.createElement("div");
  pair.className = "pair";
  $("chat").appendChild(pair);
  // sampled answers are comparable only with the same draws: one seed for both
  const seed = body.seed !== undefined || !(body.temperature > 0) ? body.seed : Math.floor(Math.random() * 2 ** 31);
  const seeded = (b) => (seed === undefined ? b : { ...b, seed });
  const on = speculation === "off" ? "adaptive" : speculation;
  const plain = new Answer(pair, "speculation off");
  const fast = new Answer(pair, `speculation ${on}`);
  const verdict = document.createElement("div");
  verdict.className = "verdict";
  verdict.textContent = "speculation off first, then on…";
  pair.appendChild(verdict);
  if (!(await run(plain, seeded(requestBody(messages, "off"))))) {
    verdict.textContent = "stopped";
    return;
  }
  if (!(await run(fast, seeded(requestBody(messages, on))))) {
    verdict.textContent = "stopped";
    return;
  }
  const a = plain.content, b = fast.content;
  const speeds = `${plain.timings.predicted_per_second.toFixed(1)} tok/s off, ` +
    `${fast.timings.predicted_per_second.toFixed(1)} tok/s on: ` +
    `${(fast.timings.predicted_per_second / plain.timings.predicted_per_second).toFixed(2)}x`;
  if (a === b) {
    verdict.className = "verdict same";
    verdict.textContent = `identical texts (${fast.trace.length} tokens) · ${speeds}`;
  } else {
    let i = 0;
    while (i < a.length && a[i] === b[i]) i++;
    verdict.className = "verdict differ";
    verdict.textContent = `the texts differ from character ${i} · ${speeds}`;
  }
  verdict.dataset.same = String(a === b);
  const user = messages[messages.length - 1];
  page.history.push(user, { role: "assistant", content: b });
}

function newChat() {
  if (page.controller) page.controller.abort();
  page.history = [];
  for (const el of [...$("chat").children]) if (el.id !== "empty") el.remove();
  $("empty").hidden = false;
  $("prompt").focus();
}

function toggleSettings() {
  const aside = $("settings");
  const narrow = window.matchMedia("(max-width: 720px)").matches;
  const open = narrow ? aside.classList.toggle("open") : !aside.classList.toggle("closed");
  $("toggle-settings").setAttribute("aria-expanded", String(open));
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || page.busy) return;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => page.controller && page.controller.abort());
$("new-chat").addEventListener("click", newChat);
$("toggle-settings").addEventListener("click", toggleSettings);
$("speculation").addEventListener("change", () => { $("k-label").hidden = $("speculation").value !== "fixed"; });
loadModel();
