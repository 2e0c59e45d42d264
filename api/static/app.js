// mmserve's page: upload images and videos once, ask several questions, watch the cache.
// Plain JavaScript, no build step; every request goes to this server's own origin.
"use strict";

const $ = (sel) => document.querySelector(sel);
const items = new Map(); // id -> {kind: "image" | "video", info, name}
let selected = null;
const session = { cached: 0, towerSaved: 0 }; // this page's totals since it opened

// ---- API calls -------------------------------------------------------------------

class APIError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.param = body && body.error ? body.error.param : null;
  }
}

function headers(json) {
  const h = {};
  const key = $("#api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

// fetch a path of this server; a non-2xx answer throws its error.message
async function call(path, { body, form, method } = {}) {
  const opts = { headers: headers(body !== undefined) };
  if (body !== undefined) opts.body = JSON.stringify(body);
  if (form) opts.body = form;
  if (opts.body) opts.method = "POST";
  if (method) opts.method = method;
  const resp = await fetch(path, opts);
  if (!resp.ok) {
    const err = new APIError(resp.status, await resp.json().catch(() => null));
    if (resp.status === 401) $("#key-box").hidden = false;
    throw err;
  }
  return resp;
}

// yield the lines of a streamed response body as they arrive
async function* lines(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      yield buf.slice(0, nl);
      buf = buf.slice(nl + 1);
    }
  }
  if (buf) yield buf;
}

function showError(err) {
  const box = $("#error");
  box.textContent = err ? err.message || String(err) : "";
  box.hidden = !err;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- statistics panel ------------------------------------------------------------

async function refreshStats() {
  try {
    const s = await (await call("/v1/cache/stats")).json();
    $("#stat-hit").textContent = `${(100 * s.cache_hit_rate).toFixed(1)}%`;
    $("#stat-tower").textContent = String(s.vision_tower_images);
    // the pool's states are disjoint: used (held by requests) + evictable (cached) + free
    const used = s.used_pages / s.pool_pages;
    const cached = s.evictable_pages / s.pool_pages;
    $("#stat-kv").textContent =
      `${(100 * used).toFixed(1)}% used, ${(100 * cached).toFixed(1)}% cached, of ${s.pool_pages * s.page_size} tokens`;
    $("#stat-kv-bar").value = used + cached;
    showTiers(s);
    $("#stats").title = "";
  } catch (err) {
    $("#stats").title = err.message; // the page's alert line is for the user's actions
  }
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function plural(n, word) {
  return `${n.toLocaleString("en")} ${word}${n === 1 ? "" : "s"}`;
}

// The host and disk KV tiers (--kv-host-bytes, --kv-disk-dir): shown only when on.
function showTiers(s) {
  const host = (s.tier_host_capacity_bytes || 0) > 0;
  const disk = "tier_disk_on" in s && (s.tier_disk_on || s.tier_disk_capacity_bytes > 0);
  $("#tier-host").hidden = !host;
  $("#tier-disk").hidden = !disk;
  if (host) {
    $("#stat-tier-host").textContent =
      `${bytes(s.tier_host_bytes)} of ${bytes(s.tier_host_capacity_bytes)}, ` +
      `${plural(s.tier_host_hit_tokens, "token")} loaded`;
  }
  if (disk) {
    $("#stat-tier-disk").textContent = !s.tier_disk_on ? "off (directory not writable)" :
      `${plural(s.tier_disk_pages, "page")}, ${plural(s.tier_disk_feature_files, "image")}, ` +
      `${bytes(s.tier_disk_bytes)} of ${bytes(s.tier_disk_capacity_bytes)}, ` +
      `${plural(s.tier_disk_hit_tokens, "token")} loaded` +
      (s.tier_disk_writable ? "" : " (read-only after a write error)");
  }
}

async function loadModel() {
  try {
    const m = await (await call("/v1/models")).json();
    $("#model-name").textContent = m.data[0].id;
    // make-model's seeded random weights: say plainly that the answers are noise
    $("#random-note").hidden = !m.data[0].random_weights;
    $("#random-note-text").textContent = m.data[0].note || "";
    showError(null);
  } catch (err) {
    showError(err); // e.g. the 401 of a server with --api-key, as the server words it
  }
}

// ---- uploads ---------------------------------------------------------------------

function isVideo(file) {
  return file.type.startsWith("video/") || /\.(mp4|m4v|mov|webm|mkv|avi)$/i.test(file.name);
}

async function upload(file) {
  const kind = isVideo(file) ? "video" : "image";
  const form = new FormData();
  form.append("file", file);
  const info = await (await call(`/v1/${kind}s`, { form })).json();
  const src = URL.createObjectURL(file); // a blob: URL of this page, nothing is fetched
  $("#media-list").prepend(mediaItem(kind, info, info.name || file.name, src));
  select(info.id);
}

// One entry of the media list; `src` is a blob: URL of an upload of this page, or
// null for an item stored before the page was opened: its thumbnail then comes from
// the server (`thumbnail_url`, fetched with the API key, shown as a blob: URL).
function mediaItem(kind, info, name, src) {
  const li = el("li", "media");
  li.dataset.id = info.id;
  li.dataset.kind = kind;
  if (src) {
    const thumb = document.createElement(kind === "video" ? "video" : "img");
    thumb.src = src;
    if (kind === "video") thumb.muted = true;
    else thumb.alt = name;
    li.append(thumb);
  } else {
    const thumb = el("img", "thumb stored");
    thumb.alt = `${kind} ${name}`;
    li.append(thumb);
    if (info.thumbnail_url) {
      call(info.thumbnail_url)
        .then((r) => r.blob())
        .then((b) => { thumb.src = URL.createObjectURL(b); })
        .catch(() => thumb.classList.add("missing"));
    }
  }
  const text = el("div", "meta");
  text.append(el("b", "name", name), el("code", "id", info.id));
  const size = `${info.width}×${info.height}, ${(info.bytes / 1024).toFixed(0)} KiB`;
  text.append(
    el(
      "span",
      "size",
      kind === "video"
        ? `${size}, ${info.duration.toFixed(1)} s, ${info.num_frames} frames at ${info.fps} fps`
        : `${size}, ${info.num_image_tokens} tokens (low: ${info.num_image_tokens_by_detail.low})`,
    ),
  );
  li.append(text);
  li.addEventListener("click", () => select(info.id));
  const old = $(`#media-list li[data-id="${info.id}"]`); // the same pixels: the same id
  if (old) {
    if (old.firstChild.src) URL.revokeObjectURL(old.firstChild.src);
    old.remove();
  }
  items.set(info.id, { kind, info, name });
  return li;
}

// The images and videos the server already stores (GET /v1/images, /v1/videos: most
// recently used first, bounded by --max-stored-images and --max-stored-videos).
async function loadStored() {
  try {
    for (const kind of ["image", "video"]) {
      const list = await (await call(`/v1/${kind}s`)).json();
      for (const info of list.data) {
        if (items.has(info.id)) continue;
        const when = new Date(info.created_at * 1000).toLocaleString();
        const name = info.name || `stored ${kind}, ${when}`;
        $("#media-list").append(mediaItem(kind, info, name, null));
      }
    }
  } catch (err) {
    showError(err);
  }
}

async function uploadAll(files) {
  showError(null);
  for (const file of files) {
    try {
      await upload(file);
    } catch (err) {
      showError(err);
    }
  }
  refreshStats();
}

function select(id) {
  selected = id;
  const item = items.get(id);
  for (const li of document.querySelectorAll("#media-list li")) {
    li.classList.toggle("selected", li.dataset.id === id);
  }
  $("#selected-name").textContent = `${item.name} (${id.slice(0, 16)}…)`;
  $("#video-options").hidden = item.kind !== "video";
  $("#schema-box").hidden = item.kind === "video"; // structured output is for chat answers
  $("#detail-box").hidden = item.kind === "video"; // an image's view
  $("#ask").disabled = false;
}

// ---- questions about an image: one streaming chat completion per question ---------

function schemaFormat() {
  const text = $("#schema").value.trim();
  if (!text) return undefined;
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (err) {
    throw new Error(`the JSON schema is not valid JSON: ${err.message}`);
  }
  return { type: "json_schema", json_schema: { name: "answer", schema } };
}

// The answer's prompt tokens as a bar, cached then computed, with whether the vision
// tower ran: its image's tokens all in the reused prefix means its KV was reused, so
// the tower was skipped. Adds to the page's session totals.
function showCache(card, u) {
  const cached = u.prompt_tokens_details.cached_tokens;
  const image = u.prompt_tokens_details.image_tokens;
  const computed = u.prompt_tokens - cached;
  const box = el("div", "cache-bar");
  const bar = el("div", "bar");
  bar.title = `${cached} of ${u.prompt_tokens} prompt tokens cached`;
  const a = el("span", "cached");
  const b = el("span", "computed");
  a.style.flexGrow = String(cached);
  b.style.flexGrow = String(computed);
  bar.append(a, b);
  const skipped = image > 0 && cached >= image;
  const legend = el("div", "legend");
  legend.append(
    el("span", "key-cached", `${plural(cached, "token")} cached`),
    el("span", "key-computed", `${plural(computed, "token")} computed`),
  );
  if (image > 0) {
    const tower = el("span", skipped ? "tower skipped" : "tower run",
      skipped ? "vision tower skipped" : "vision tower run");
    tower.title = skipped ? "the image's KV came from the prefix cache"
      : "the image was encoded (or its features came from the embedding cache)";
    legend.append(tower);
  }
  box.append(bar, legend);
  card.dataset.tower = image > 0 ? (skipped ? "skipped" : "run") : "none";
  card.querySelector(".meta").before(box);
  addSession(cached, skipped ? 1 : 0);
}

function addSession(cached, towerSaved) {
  session.cached += cached;
  session.towerSaved += towerSaved;
  $("#stat-session-cached").textContent = session.cached.toLocaleString("en");
  $("#stat-session-tower").textContent = session.towerSaved.toLocaleString("en");
}

// Stream one question's answer into its card; onStart() fires at the first text (the
// prompt, image included, is then in the server's prefix cache) or at the end.
async function askOne(card, body, onStart) {
  const t0 = performance.now();
  const seconds = () => ((performance.now() - t0) / 1000).toFixed(2);
  const answer = card.querySelector(".answer");
  const meta = card.querySelector(".meta");
  let firstText = null;
  try {
    const resp = await call("/v1/chat/completions", { body });
    for await (const line of lines(resp)) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) throw new APIError(500, chunk);
      const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta : null;
      if (delta && delta.content) {
        answer.textContent += delta.content;
        firstText = firstText || seconds();
        meta.textContent = `streaming… first text after ${firstText} s`;
        onStart();
      }
      if (chunk.usage) {
        const u = chunk.usage;
        card.dataset.cached = u.prompt_tokens_details.cached_tokens;
        showCache(card, u);
        meta.textContent =
          `cached ${u.prompt_tokens_details.cached_tokens} of ${u.prompt_tokens} prompt tokens ` +
          `(${u.prompt_tokens_details.image_tokens} image), ` +
          `${u.completion_tokens} generated, first text after ${firstText ?? "–"} s, ` +
          `done in ${seconds()} s`;
      }
    }
    card.dataset.state = "done";
  } catch (err) {
    card.dataset.state = "error";
    meta.textContent = err.message; // as the API words it
  } finally {
    onStart();
  }
}

async function askImage(id, questions) {
  const base = {
    max_tokens: Number($("#max-tokens").value),
    temperature: Number($("#temperature").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  const format = schemaFormat();
  if (format) base.response_format = format;
  const jobs = questions.map((q, i) => {
    const card = el("article", "answer-card");
    card.dataset.index = i;
    card.dataset.state = "running";
    card.append(el("h3", "question", q), el("p", "answer"), el("p", "meta", "waiting…"));
    $("#results").append(card);
    const content = [
      { type: "image_url", image_url: { url: id, detail: $("#detail").value } },
      { type: "text", text: q },
    ];
    return { card, body: { ...base, messages: [{ role: "user", content }] } };
  });
  // The first question goes alone; the others start when its answer starts, so the
  // image is encoded and prefilled once and every later question reports it as cached.
  let started;
  const first = new Promise((resolve) => (started = resolve));
  const runs = [askOne(jobs[0].card, jobs[0].body, started)];
  await first;
  for (const job of jobs.slice(1)) runs.push(askOne(job.card, job.body, () => {}));
  await Promise.all(runs);
}

// ---- questions about a video: /v1/videos/{id}/qa, streamed as NDJSON ---------------

function frameSelection() {
  const by = $("#frames-by").value;
  const raw = $("#frames-value").value.trim();
  if (by === "timestamps") return { timestamps: raw.split(/[\s,]+/).filter(Boolean).map(Number) };
  return { [by]: Number(raw) };
}

async function askVideo(id, questions) {
  const body = {
    questions,
    mode: $("#mode").value,
    max_tokens: Number($("#max-tokens").value),
    temperature: Number($("#temperature").value),
    ...frameSelection(),
  };
  const box = el("article", "video-run");
  box.dataset.state = "running";
  const progress = el("progress");
  progress.value = 0;
  const count = el("span", "count", "sending…");
  const table = el("table");
  const summary = el("p", "meta");
  const progressRow = el("div", "progress-row");
  progressRow.append(progress, count);
  box.append(progressRow, table, summary);
  $("#results").append(box);
  const cells = new Map(); // "frame/question" -> td
  const head = table.createTHead().insertRow();
  head.append(el("th", "", body.mode === "clip" ? "" : "time"));
  for (const q of questions) head.append(el("th", "", q));
  const addRow = (label, key) => {
    const row = table.insertRow();
    row.append(el("th", "ts", label));
    questions.forEach((_, qi) => {
      const td = row.insertCell();
      td.className = "pending";
      cells.set(`${key}/${qi}`, td);
    });
  };
  try {
    const resp = await call(`/v1/videos/${id}/qa`, { body });
    for await (const line of lines(resp)) {
      if (!line.trim()) continue;
      const ev = JSON.parse(line);
      if (ev.type === "error") throw new APIError(500, ev);
      if (ev.type === "frames") {
        progress.max = ev.num_answers;
        count.textContent = `0 / ${ev.num_answers}`;
        if (body.mode === "clip") addRow("clip", "clip");
        else for (const f of ev.frames) addRow(`${f.timestamp.toFixed(2)} s`, f.frame);
        if (ev.skipped_frames.length) {
          const ts = ev.skipped_frames.map((f) => `${f.timestamp.toFixed(2)} s`).join(", ");
          summary.textContent = `skipped frames that do not decode: ${ts}`;
        }
      } else if (ev.type === "answer") {
        progress.value = ev.completed;
        count.textContent = `${ev.completed} / ${ev.total}`;
        const td = cells.get(`${ev.frame ?? "clip"}/${ev.question_index}`);
        td.className = "";
        td.textContent = ev.text;
        td.title = `cached ${ev.cached_tokens} of ${ev.prompt_tokens} prompt tokens`;
        addSession(ev.cached_tokens || 0, 0);
      } else if (ev.type === "summary") {
        summary.textContent =
          `${ev.answers} answers over ${ev.distinct_frames} distinct frames in ` +
          `${ev.seconds.toFixed(2)} s; cache hit rate ${(100 * ev.cache_hit_rate).toFixed(1)}%, ` +
          `${ev.vision_tower_runs} vision-tower runs`;
        // frames the answers used minus the tower's runs: encodings the caches spared
        const used = body.mode === "clip" ? ev.answers * ev.distinct_frames : ev.answers;
        addSession(0, Math.max(0, used - ev.vision_tower_runs));
      }
    }
    box.dataset.state = "done";
  } catch (err) {
    box.dataset.state = "error";
    summary.textContent = err.message;
  }
}

async function ask(event) {
  event.preventDefault();
  const questions = $("#questions")
    .value.split("\n")
    .map((q) => q.trim())
    .filter(Boolean);
  if (!selected || !questions.length) return;
  showError(null);
  $("#results").replaceChildren();
  $("#ask").disabled = true;
  const item = items.get(selected);
  try {
    if (item.kind === "video") await askVideo(selected, questions);
    else await askImage(selected, questions);
  } catch (err) {
    showError(err);
  } finally {
    $("#ask").disabled = false;
    refreshStats();
  }
}

// ---- live: the camera or a shared screen, a frame every N seconds to a stream --------

// The stream this page feeds (POST /v1/streams): its id, the capture, the timer that
// grabs a frame every N seconds, and counts of what was sent.
const live = { id: null, media: null, timer: null, t0: 0, sent: 0, skipped: 0, busy: false };
const LIVE_MAX_SIDE = 640; // frames are scaled down to this side before JPEG encoding

function liveStatus(text) {
  $("#live-status").textContent = text;
}

// The stream's figures as GET /v1/streams/{id} gives them, with this page's counts:
// frames in its window (and the seconds they span), how many of them are prefilled
// in its held prefix, its cached tokens, and frames thinned by its fps.
function showLive(info) {
  const parts = [`${live.id}`, `${plural(live.sent, "frame")} sent`];
  if (live.skipped) parts.push(`${live.skipped} not sent (the previous one was still on its way)`);
  if (info) {
    const win = info.window || {};
    parts.push(
      `server: ${plural(info.frames_held, "frame")} held of ${info.max_frames} ` +
        `(${(win.seconds || 0).toFixed(1)} s), ` +
        `${info.cached.frames} prefilled, ${plural(info.tokens, "token")} cached`,
    );
    if (info.frames_thinned) parts.push(`${info.frames_thinned} thinned by fps`);
    if (info.cached.error) parts.push(`prefill failed: ${info.cached.error}`);
    $("#live-status").dataset.held = String(info.frames_held);
  }
  liveStatus(parts.join(" · "));
}

async function refreshLive() {
  if (!live.id) return;
  try {
    showLive(await (await call(`/v1/streams/${live.id}`)).json());
  } catch (err) {
    if (err.status === 404) liveStop(`the stream ended on the server: ${err.message}`);
  }
}

async function capture(source) {
  if (!navigator.mediaDevices) {
    throw new Error("the browser allows camera and screen capture only over https or on localhost");
  }
  return source === "screen"
    ? navigator.mediaDevices.getDisplayMedia({ video: true, audio: false })
    : navigator.mediaDevices.getUserMedia({ video: true, audio: false });
}

async function liveStart(event) {
  event.preventDefault();
  showError(null);
  const interval = Number($("#live-interval").value);
  if (!(interval > 0)) {
    showError(new Error("a frame every: give a number of seconds above 0"));
    return;
  }
  $("#live-start").disabled = true;
  try {
    live.media = await capture($("#live-source").value);
    const video = $("#live-video");
    video.srcObject = live.media;
    $("#live-view").hidden = false;
    await video.play();
    const body = { fps: 1 / interval };
    const frames = $("#live-window").value.trim();
    if (frames) body.max_frames = Number(frames);
    const info = await (await call("/v1/streams", { body })).json();
    Object.assign(live, { id: info.id, t0: performance.now(), sent: 0, skipped: 0 });
    $("#live-panel").dataset.stream = info.id;
    // the user ending the share from the browser's own bar stops the stream too
    live.media.getVideoTracks()[0].addEventListener("ended", () => liveStop());
    $("#live-stop").disabled = false;
    $("#live-ask").disabled = false;
    showLive(info);
    sendFrame();
    live.timer = setInterval(sendFrame, interval * 1000);
  } catch (err) {
    showError(err);
    liveStop();
  }
}

// Grab the video's current picture into the canvas, JPEG it, and POST it with its
// time since the start; a tick while the previous frame is still on its way is skipped.
async function sendFrame() {
  const video = $("#live-video");
  if (!live.id || !video.videoWidth) return;
  if (live.busy) {
    live.skipped++;
    return;
  }
  live.busy = true;
  const id = live.id;
  try {
    const timestamp = (performance.now() - live.t0) / 1000;
    const scale = Math.min(1, LIVE_MAX_SIDE / Math.max(video.videoWidth, video.videoHeight));
    const canvas = $("#live-canvas");
    canvas.width = Math.round(video.videoWidth * scale);
    canvas.height = Math.round(video.videoHeight * scale);
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.85));
    const form = new FormData();
    form.append("file", blob, `frame-${live.sent}.jpg`);
    form.append("timestamp", timestamp.toFixed(3));
    await call(`/v1/streams/${id}/frames`, { form });
    if (live.id === id) live.sent++;
    await refreshLive();
  } catch (err) {
    if (live.id === id) {
      showError(err);
      if (err.status === 404) liveStop(`the stream ended on the server: ${err.message}`);
    }
  } finally {
    live.busy = false;
  }
}

// Stop grabbing, release the camera or screen, and delete the stream on the server
// (its frames' KV goes back to the cache as evictable).
async function liveStop(why) {
  clearInterval(live.timer);
  live.timer = null;
  if (live.media) for (const track of live.media.getTracks()) track.stop();
  live.media = null;
  $("#live-video").srcObject = null;
  $("#live-view").hidden = true;
  const id = live.id;
  live.id = null;
  delete $("#live-panel").dataset.stream;
  $("#live-stop").disabled = true;
  $("#live-ask").disabled = true;
  $("#live-start").disabled = false;
  liveStatus(why || (id ? `stopped; ${id} deleted` : "stopped"));
  if (id && !why) {
    try {
      await call(`/v1/streams/${id}`, { method: "DELETE" });
    } catch (err) {
      showError(err);
    }
  }
  refreshStats();
}

// One question about the stream, streamed: time to first text measured here, and the
// server's own figures from the answer's usage when it gives them.
async function liveAsk(event) {
  event.preventDefault();
  const question = $("#live-question").value.trim();
  if (!live.id || !question) return;
  showError(null);
  const body = {
    questions: [question],
    max_tokens: Number($("#max-tokens").value),
    temperature: Number($("#temperature").value),
    stream: true,
  };
  const last = $("#live-ask-window").value.trim();
  if (last) body.window = { seconds: Number(last) };
  const card = el("article", "live-card");
  card.dataset.state = "running";
  card.append(el("h3", "question", question), el("p", "answer"), el("p", "meta", "waiting…"));
  $("#live-answers").prepend(card);
  const answer = card.querySelector(".answer");
  const meta = card.querySelector(".meta");
  const t0 = performance.now();
  const seconds = () => (performance.now() - t0) / 1000;
  let ttft = null;
  let usage = null;
  try {
    const resp = await call(`/v1/streams/${live.id}/ask`, { body });
    for await (const raw of lines(resp)) {
      const line = raw.startsWith("data:") ? raw.slice(5).trim() : raw.trim();
      if (!line || line === "[DONE]" || raw.startsWith("event:")) continue;
      const ev = JSON.parse(line);
      if (ev.error) throw new APIError(500, ev);
      // a closing event may repeat the whole answer the deltas already gave
      const text = ev.answers && answer.textContent ? "" : eventText(ev);
      if (text) {
        answer.textContent += text;
        ttft = ttft ?? seconds();
        meta.textContent = `streaming… first text after ${ttft.toFixed(2)} s`;
      }
      usage = eventUsage(ev) || usage;
    }
    if (!usage) throw new Error("the answer ended without its usage");
    ttft = ttft ?? seconds();
    const details = usage.prompt_tokens_details || {};
    const cached = details.cached_tokens ?? usage.cached_tokens ?? 0;
    card.dataset.cached = String(cached);
    card.dataset.ttft = ttft.toFixed(3);
    showCache(card, { ...usage, prompt_tokens_details: { image_tokens: 0, ...details, cached_tokens: cached } });
    const server = usage.ttft ?? usage.ttft_s;
    meta.textContent =
      `TTFT ${ttft.toFixed(2)} s here` +
      (server !== undefined ? `, ${Number(server).toFixed(2)} s on the server` : "") +
      `; cached ${cached} of ${usage.prompt_tokens} prompt tokens, ` +
      `${usage.completion_tokens} generated, done in ${seconds().toFixed(2)} s`;
    card.dataset.state = "done";
  } catch (err) {
    card.dataset.state = "error";
    meta.textContent = err.message; // as the API words it
  }
  refreshLive();
  refreshStats();
}

// The answer text an event of /ask's stream carries (a chat-style delta or a text field).
function eventText(ev) {
  const choice = ev.choices && ev.choices[0];
  if (choice) return (choice.delta && choice.delta.content) || choice.text || "";
  if (ev.answers) return ev.answers.map((a) => a.answer || "").join("");
  return ev.delta || ev.text || "";
}

// The usage an event carries: its own, or its first answer's.
function eventUsage(ev) {
  if (ev.answers && ev.answers[0] && ev.answers[0].usage) return ev.answers[0].usage;
  return ev.usage || null;
}

// ---- wiring ----------------------------------------------------------------------

function init() {
  const drop = $("#drop");
  $("#file-input").addEventListener("change", (e) => {
    uploadAll([...e.target.files]);
    e.target.value = "";
  });
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    uploadAll([...e.dataTransfer.files]);
  });
  $("#ask-form").addEventListener("submit", ask);
  $("#live-form").addEventListener("submit", liveStart);
  $("#live-stop").addEventListener("click", () => liveStop());
  $("#live-ask-form").addEventListener("submit", liveAsk);
  // leaving the page deletes its stream (keepalive: the request outlives the page)
  window.addEventListener("pagehide", () => {
    if (live.id) fetch(`/v1/streams/${live.id}`, { method: "DELETE", headers: headers(false), keepalive: true });
  });
  const key = $("#api-key");
  key.value = sessionStorage.getItem("mmserve-api-key") || "";
  if (key.value) $("#key-box").hidden = false;
  const useKey = () => {
    sessionStorage.setItem("mmserve-api-key", key.value.trim());
    loadModel();
    loadStored();
    refreshStats();
  };
  key.addEventListener("change", useKey);
  $("#key-box").addEventListener("submit", (e) => {
    e.preventDefault(); // Enter: use the key, do not reload the page
    useKey();
  });
  loadModel();
  loadStored();
  refreshStats();
  setInterval(() => document.hidden || refreshStats(), 2000);
}

init();
