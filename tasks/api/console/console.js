// Kiln's console: a page of the API that speaks only its public HTTP API (docs/console.md).
// The API key lives in this tab's sessionStorage and goes out as `Authorization: Bearer`, never in
// a URL: event streams are read with fetch() and a small SSE parser, because EventSource cannot
// send headers.
"use strict";

(function () {
  const KEY_SLOT = "kiln.apiKey";
  const TERMINAL = new Set(["succeeded", "failed", "canceled", "expired"]);
  const REFRESH_MS = 3000;
  const MAX_PREVIEWS = 64; // thumbnails kept on the page; the oldest go first
  const MAX_WAIT_LOOKUPS = 5; // queued jobs whose expected start is looked up per refresh
  const PREVIEW_SIDE = 256; // a preview's longer side, unless the pipeline's limits take less
  const IMAGE_FORMATS = ["png", "jpeg", "webp"];
  const VIDEO_FORMATS = ["mp4", "webm", "gif"];
  // Kiln's request fields as form fields (docs/contract.md §2), in the form's order. A pipeline's
  // node announces which of them it honours (`fields` of GET /v1/pipelines/{name}, its
  // `supported_fields()`); the form shows those, within the pipeline's limits.
  const STANDARD_FIELDS = {
    prompt: { type: "string", minLength: 1 },
    negative_prompt: { type: "string" },
    width: { type: "integer", minimum: 64, multipleOf: 8 },
    height: { type: "integer", minimum: 64, multipleOf: 8 },
    steps: { type: "integer", minimum: 1 },
    guidance_scale: { type: "number", minimum: 0, maximum: 50 },
    seed: { type: "integer", minimum: 0 },
    num_frames: { type: "integer", minimum: 1 },
    fps: { type: "integer", minimum: 1, maximum: 120 },
    num_outputs: { type: "integer", minimum: 1, maximum: 16 },
    output_format: { enum: IMAGE_FORMATS },
  };
  // Offered whatever a pipeline declares: a job always has a prompt (the contract requires one),
  // and the node encodes every output in the format asked.
  const ALWAYS = new Set(["prompt", "output_format"]);
  // Shown while no live node says which fields a pipeline honours (none is up yet).
  const UNDECLARED = new Set(["prompt", "negative_prompt", "width", "height", "steps", "guidance_scale", "seed"]);
  const LONG_TEXT = new Set(["prompt", "negative_prompt"]);

  const $ = (id) => document.getElementById(id);
  // What the chosen pipeline's limits let a preview be (GET /v1/pipelines/{name} `limits`).
  let previewLimits = { side: PREVIEW_SIDE, every: 1 };
  const apiUrl = (path) => new URL("../" + path.replace(/^\//, ""), document.baseURI).toString();

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // --- the API -------------------------------------------------------------------------------

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_SLOT);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  // The message of an error body: `detail` as text, or each of a 422's items as `loc: msg`.
  function errorMessage(status, body, text) {
    const detail = body && body.detail;
    if (typeof detail === "string") return detail;
    if (Array.isArray(detail)) {
      return detail
        .map((item) => {
          const loc = (item.loc || []).filter((part) => part !== "body").join(".");
          return loc ? loc + ": " + item.msg : item.msg;
        })
        .join("; ");
    }
    return text || "HTTP " + status;
  }

  async function api(path, options = {}) {
    const headers = { ...authHeaders(), ...(options.headers || {}) };
    if (options.json !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(apiUrl(path), {
      method: options.method || "GET",
      headers,
      body: options.json === undefined ? undefined : JSON.stringify(options.json),
    });
    const text = await response.text();
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch (_) {
      body = null; // the HTTP server's own plain-text refusals (400, 408)
    }
    if (!response.ok) {
      const error = new ApiError(response.status, errorMessage(response.status, body, text));
      if (response.status === 401) askForKey(error.message);
      throw error;
    }
    return body;
  }

  // A job's server-sent events through fetch: calls onEvent(type, data) for each, resumes with
  // Last-Event-ID when the API ends a stream early (its lifetime), stops after the terminal event.
  async function followEvents(jobId, onEvent, isCurrent, signal, onLive) {
    let lastId = null;
    while (isCurrent()) {
      const headers = { ...authHeaders(), Accept: "text/event-stream" };
      if (lastId !== null) headers["Last-Event-ID"] = lastId;
      const response = await fetch(apiUrl("v1/jobs/" + encodeURIComponent(jobId) + "/events"), {
        headers,
        signal,
      });
      if (response.status === 429) {
        const wait = Number(response.headers.get("Retry-After") || "1");
        await sleep(wait * 1000);
        continue;
      }
      if (!response.ok) {
        const text = await response.text();
        let body = null;
        try { body = JSON.parse(text); } catch (_) { body = null; }
        const error = new ApiError(response.status, errorMessage(response.status, body, text));
        if (response.status === 401) askForKey(error.message);
        throw error;
      }
      onLive(true);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      let finished = false;
      for (;;) {
        const { value, done } = await reader.read();
        if (done || !isCurrent()) break;
        buffer += value.replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = parseFrame(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
          if (frame === null) continue; // a comment (keep-alive, "stream closed")
          if (frame.id !== null) lastId = frame.id;
          onEvent(frame.type, frame.data);
          if (TERMINAL.has(frame.type)) finished = true;
        }
      }
      if (isCurrent()) onLive(false);
      if (finished || !isCurrent()) {
        await reader.cancel().catch(() => {});
        return;
      }
      await sleep(300); // ended early (lifetime, fair share): resume after the last event seen
    }
  }

  function parseFrame(frame) {
    let id = null;
    let type = "message";
    const data = [];
    for (const line of frame.split("\n")) {
      if (line === "" || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") id = value;
      else if (field === "event") type = value;
      else if (field === "data") data.push(value);
    }
    if (data.length === 0) return null;
    let parsed;
    try {
      parsed = JSON.parse(data.join("\n"));
    } catch (_) {
      parsed = { payload: data.join("\n") };
    }
    return { id, type, data: parsed };
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // --- the key -------------------------------------------------------------------------------

  function askForKey(message) {
    sessionStorage.removeItem(KEY_SLOT);
    stopRefreshing();
    $("app").hidden = true;
    $("forget-key").hidden = true;
    $("who").textContent = "";
    $("auth").hidden = false;
    const error = $("auth-error");
    error.textContent = message || "";
    error.hidden = !message;
    $("api-key").focus();
  }

  async function useKey(event) {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_SLOT, key);
    $("api-key").value = "";
    await start();
  }

  // Opens the console if the API answers with the key held (or with none, where auth is off);
  // a 401 asks for a key, showing the API's own message when a key was given.
  async function start() {
    const hadKey = sessionStorage.getItem(KEY_SLOT) !== null;
    let pipelines;
    try {
      pipelines = await api("v1/pipelines");
    } catch (error) {
      if (error.status === 401) askForKey(hadKey ? error.message : "");
      else showAuthProblem(error.message);
      return;
    }
    $("auth").hidden = true;
    $("app").hidden = false;
    $("forget-key").hidden = !hadKey;
    $("who").textContent = hadKey ? "key held for this tab" : "auth is off on this API";
    fillPipelines(pipelines.pipelines);
    startRefreshing();
  }

  function showAuthProblem(message) {
    $("auth").hidden = false;
    const error = $("auth-error");
    error.textContent = message;
    error.hidden = false;
  }

  // --- the form ------------------------------------------------------------------------------

  function fillPipelines(names) {
    const select = $("pipeline");
    const chosen = select.value;
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
    return showPipeline();
  }

  async function showPipeline() {
    const name = $("pipeline").value;
    if (!name) return;
    let info = null;
    try {
      info = await api("v1/pipelines/" + encodeURIComponent(name));
    } catch (error) {
      $("pipeline-info").textContent = error.message;
    }
    if (name !== $("pipeline").value) return; // another pipeline was chosen meanwhile
    const schema = info && info.inputs;
    const properties = (schema && schema.properties) || {};
    const limits = (info && info.limits) || {};
    const required = new Set((schema && schema.required) || []);
    required.add("prompt");
    if (info) {
      showPreviewLimits(info.previews !== false, limits);
      $("pipeline-info").textContent =
        info.live_nodes + " live node" + (info.live_nodes === 1 ? "" : "s") +
        (Array.isArray(info.fields) ? "" : " (no node has announced its fields yet: the usual ones)");
    }
    // the standard fields it honours, unless its schema has one under its own name already
    const own = new Set(Object.values(properties).map((prop) => prop["x-kiln-field"]).filter(Boolean));
    const standard = standardFields(info && Array.isArray(info.fields) ? info.fields : null, limits)
      .filter(([field]) => !own.has(field));
    const names = Object.keys(properties).sort(
      (a, b) => Number(!LONG_TEXT.has(a)) - Number(!LONG_TEXT.has(b)),
    );
    $("fields").replaceChildren(
      ...standard.map(([field, prop]) => fieldRow(field, prop, required.has(field))),
      ...names.map((field) => fieldRow(field, properties[field], required.has(field))),
    );
    $("fields").dataset.pipeline = name; // whose fields these are (a choice may still be loading)
  }

  // [name, schema] of each request field the pipeline honours, its limits applied.
  function standardFields(declared, limits) {
    const honoured = declared === null ? UNDECLARED : new Set(declared);
    const video = honoured.has("num_frames") && (limits.max_frames || 2) > 1;
    const shown = (field) =>
      ALWAYS.has(field) || honoured.has(field) || (field === "fps" && video);
    return Object.keys(STANDARD_FIELDS).filter(shown).map((field) => {
      const prop = { ...STANDARD_FIELDS[field], "x-kiln-field": field };
      const multiple = limits.size_multiple || 8;
      if (field === "width" || field === "height") {
        prop.multipleOf = multiple;
        prop.minimum = Math.ceil(64 / multiple) * multiple;
        const most = limits[field === "width" ? "max_width" : "max_height"];
        if (most) prop.maximum = most;
      } else if (field === "steps" && limits.max_steps) {
        prop.maximum = limits.max_steps;
      } else if (field === "num_frames") {
        if (limits.max_frames) prop.maximum = limits.max_frames;
        if (limits.frame_step > 1) prop.multipleOf = limits.frame_step; // 1, 1 + step, ...
      } else if (field === "output_format" && video) {
        prop.enum = [...IMAGE_FORMATS, ...VIDEO_FORMATS];
      }
      return [field, prop];
    });
  }

  // Previews within the pipeline's declared limits: no larger side, no shorter cadence; none for
  // a pipeline that cannot emit them (its request would be refused).
  function showPreviewLimits(previews, limits) {
    previewLimits = {
      side: Math.min(PREVIEW_SIDE, limits.max_preview_side || PREVIEW_SIDE),
      every: limits.min_preview_every_steps || 1,
    };
    const every = $("preview-every");
    every.min = previewLimits.every;
    if ((parseInt(every.value, 10) || 1) < previewLimits.every) every.value = previewLimits.every;
    const box = $("preview-on");
    if (box.disabled !== !previews) box.checked = previews; // the user's choice, kept otherwise
    box.disabled = !previews;
    $("preview-none").hidden = previews;
  }

  function fieldRow(name, prop, required) {
    const row = document.createElement("div");
    row.className = "row";
    const label = document.createElement("label");
    label.htmlFor = "field-" + name;
    label.textContent = name;
    const input = fieldInput(name, prop);
    input.id = "field-" + name;
    input.name = name;
    input.dataset.kind = prop.type || "enum";
    if (prop["x-kiln-field"]) input.dataset.field = prop["x-kiln-field"];
    if (required) input.required = true;
    if (prop.description) input.title = prop.description;
    row.append(label, input);
    return row;
  }

  function fieldInput(name, prop) {
    if (Array.isArray(prop.enum) || prop.type === "boolean") {
      const select = document.createElement("select");
      const choices = Array.isArray(prop.enum) ? prop.enum : [true, false];
      const unset = "default" in prop ? "default (" + prop.default + ")" : "default";
      select.append(new Option(unset, ""), ...choices.map((c) => new Option(String(c), JSON.stringify(c))));
      return select;
    }
    if (prop.type === "integer" || prop.type === "number") {
      const input = document.createElement("input");
      input.type = "number";
      if (prop.minimum !== undefined) input.min = prop.minimum;
      if (prop.maximum !== undefined) input.max = prop.maximum;
      input.step = prop.multipleOf || (prop.type === "integer" ? 1 : "any");
      if (prop.default !== undefined) input.placeholder = String(prop.default);
      return input;
    }
    const input = document.createElement(LONG_TEXT.has(name) ? "textarea" : "input");
    if (input.tagName === "INPUT") input.type = "text";
    if (prop.maxLength) input.maxLength = prop.maxLength;
    if (prop["x-kiln-image"]) input.placeholder = "upload:<upload_id> or https://…";
    else if (prop.default !== undefined) input.placeholder = String(prop.default);
    return input;
  }

  // The request: request fields at the top level under Kiln's names, other inputs under `inputs`.
  function jobRequest() {
    const request = { pipeline: $("pipeline").value, inputs: {} };
    for (const input of $("fields").querySelectorAll("input, select, textarea")) {
      if (input.value === "") continue;
      let value = input.value;
      if (input.tagName === "SELECT") value = JSON.parse(value);
      else if (input.dataset.kind === "integer") value = parseInt(value, 10);
      else if (input.dataset.kind === "number") value = Number(value);
      if (input.dataset.field) request[input.dataset.field] = value;
      else request.inputs[input.name] = value;
    }
    if (Object.keys(request.inputs).length === 0) delete request.inputs;
    if ($("preview-on").checked && !$("preview-on").disabled) {
      request.preview = {
        every_steps: parseInt($("preview-every").value, 10) || 1,
        max_side: previewLimits.side,
        format: $("preview-format").value,
      };
    }
    return request;
  }

  async function submitJob(event) {
    event.preventDefault();
    const error = $("submit-error");
    error.hidden = true;
    $("submit-job").disabled = true;
    try {
      const job = await api("v1/jobs", { method: "POST", json: jobRequest() });
      watch(job);
      refresh();
    } catch (failure) {
      error.textContent = failure.message;
      error.hidden = false;
    } finally {
      $("submit-job").disabled = false;
    }
  }

  // --- one job, live -------------------------------------------------------------------------

  let watching = null; // the id of the job on show
  let stopWatching = null; // aborts its event stream: each open stream holds one of the key's

  function watch(job) {
    if (stopWatching !== null) stopWatching.abort();
    const controller = new AbortController();
    stopWatching = controller;
    watching = job.id;
    const id = job.id;
    const isCurrent = () => stopWatching === controller; // not replaced by a later watch
    $("watch").hidden = false;
    $("watch-id").textContent = id;
    $("previews").replaceChildren();
    $("outputs").replaceChildren();
    blobUrls.forEach((url) => URL.revokeObjectURL(url));
    blobUrls = [];
    $("watch-error").hidden = true;
    showJobState(job);
    const onEvent = (type, data) => onJobEvent(id, type, data);
    // data-stream on the panel: "live" while its event stream is open (and the dot says so)
    const onLive = (live) => {
      $("watch").dataset.stream = live ? "live" : "closed";
      $("watch-live").hidden = !live;
    };
    onLive(false);
    followEvents(id, onEvent, isCurrent, controller.signal, onLive).catch((error) => {
      if (!isCurrent()) return;
      onLive(false);
      $("watch-error").textContent = error.message;
      $("watch-error").hidden = false;
    });
    pollWhileQueued(id, isCurrent);
  }

  // While queued, the job's own view says where it is in line and when it should start.
  async function pollWhileQueued(id, isCurrent) {
    while (isCurrent()) {
      let job;
      try {
        job = await api("v1/jobs/" + encodeURIComponent(id));
      } catch (_) {
        return;
      }
      if (!isCurrent()) return;
      if (job.status !== "queued") return;
      showJobState(job);
      await sleep(2000);
    }
  }

  function showJobState(job) {
    setStatus(job.status);
    const parts = [];
    if (job.status === "queued") {
      if (job.queue_position !== null && job.queue_position !== undefined) {
        parts.push(job.queue_position + " ahead in the queue");
      }
      parts.push("expected start " + expectedStart(job));
      if (job.waiting_for) parts.push(job.waiting_for);
    }
    if (job.progress) showProgress(job.progress);
    if (parts.length) $("watch-detail").textContent = parts.join(" · ");
  }

  function setStatus(status) {
    const badge = $("watch-status");
    badge.textContent = status;
    badge.className = "badge " + status;
    // a queued or running job pauses (a running one at its next step); a paused one resumes
    $("watch-pause").hidden = status !== "queued" && status !== "running";
    $("watch-resume").hidden = status !== "paused";
  }

  // POST /v1/jobs/{id}/pause or /resume for the job on show; the answer's view is shown at once
  async function pauseOrResume(action) {
    const id = watching;
    $("watch-error").hidden = true;
    try {
      const result = await api("v1/jobs/" + encodeURIComponent(id) + "/" + action, { method: "POST" });
      if (watching !== id) return;
      showJobState(result.job);
      if (result.effect === "pause_requested") $("watch-detail").textContent = "pauses at its next step";
      if (result.effect === "resumed") pollWhileQueued(id, () => watching === id);
    } catch (error) {
      $("watch-error").textContent = error.message;
      $("watch-error").hidden = false;
    }
    refresh();
  }

  function showProgress(progress) {
    const bar = $("watch-progress");
    if (progress.total) {
      bar.max = progress.total;
      bar.value = progress.step || 0;
    }
    const steps = progress.total ? " " + (progress.step || 0) + "/" + progress.total : "";
    $("watch-detail").textContent = progress.stage + steps;
  }

  function onJobEvent(id, type, data) {
    const payload = (data && data.payload) || data || {};
    if (type === "preview") addPreview(payload);
    else if (type === "output") addOutput(payload);
    else if (type === "progress") showProgress(payload);
    else if (type === "running" || type === "queued" || type === "paused") setStatus(type);
    else if (type === "resumed") setStatus("queued"); // a paused job is queued again
    if (!TERMINAL.has(type)) return;
    setStatus(type);
    if (type === "succeeded") {
      const bar = $("watch-progress");
      bar.value = bar.max;
      $("watch-detail").textContent = "done";
    }
    if (payload.error) {
      $("watch-error").textContent = payload.error.type + ": " + payload.error.message;
      $("watch-error").hidden = false;
    }
    // the record lists the outputs now: each opens through the outputs route
    api("v1/jobs/" + encodeURIComponent(id)).then((job) => {
      if (watching !== id) return;
      job.outputs.forEach((output, index) => openOutput(id, { ...output, index }));
    }, () => {});
    refresh();
  }

  function addPreview(preview) {
    const source = preview.image_b64
      ? "data:" + (preview.content_type || "image/webp") + ";base64," + preview.image_b64
      : preview.url;
    if (!source) return;
    const strip = $("previews");
    const figure = document.createElement("figure");
    const img = document.createElement("img");
    img.className = "preview";
    img.alt = "preview at step " + preview.step + " of " + preview.total;
    img.src = source;
    if (preview.width) img.width = preview.width;
    if (preview.height) img.height = preview.height;
    const caption = document.createElement("figcaption");
    caption.textContent = "step " + preview.step + "/" + preview.total;
    figure.append(img, caption);
    strip.append(figure);
    while (strip.children.length > MAX_PREVIEWS) strip.firstElementChild.remove();
  }

  // Outputs open through GET /v1/jobs/{id}/outputs/{n}, which serves them from whichever store
  // holds them (a local folder included). An <img> or <video> cannot send the key's
  // `Authorization` header, and the key never goes in a URL: the page fetches each output with
  // the header and shows it from a blob: URL (the download link is the same blob). An `output`
  // event comes before the job's record lists its outputs: it shows a placeholder, filled once
  // the job has succeeded.
  let blobUrls = []; // the watched job's, revoked when another job is watched

  function outputFigure(output) {
    const outputs = $("outputs");
    const key = output.key || String(output.index);
    let figure = [...outputs.children].find((child) => child.dataset.key === key);
    if (!figure) {
      figure = document.createElement("figure");
      figure.dataset.key = key;
      const caption = document.createElement("figcaption");
      caption.textContent = "output " + output.index + " stored; it opens when the job ends";
      figure.append(caption);
      outputs.append(figure);
    }
    return figure;
  }

  function addOutput(output) {
    if (output.index === undefined || output.index === null) return;
    outputFigure(output);
  }

  async function openOutput(jobId, output) {
    const figure = outputFigure(output);
    if (figure.dataset.state) return; // loading or shown already
    figure.dataset.state = "loading";
    const path = "v1/jobs/" + encodeURIComponent(jobId) + "/outputs/" + output.index;
    let blob;
    try {
      const response = await fetch(apiUrl(path), { headers: authHeaders() });
      if (!response.ok) {
        const text = await response.text();
        let body = null;
        try { body = JSON.parse(text); } catch (_) { body = null; }
        throw new ApiError(response.status, errorMessage(response.status, body, text));
      }
      blob = await response.blob();
    } catch (error) {
      figure.dataset.state = "failed";
      figure.querySelector("figcaption").textContent = "output " + output.index + ": " + error.message;
      return;
    }
    if (watching !== jobId) return; // another job is on show now
    const url = URL.createObjectURL(blob);
    blobUrls.push(url);
    const type = output.content_type || blob.type || "";
    let media;
    if (type.startsWith("video/")) {
      media = document.createElement("video");
      media.controls = true;
      media.loop = true;
      media.muted = true;
      media.autoplay = true;
    } else {
      media = document.createElement("img");
      media.alt = "output " + output.index;
    }
    media.src = url;
    media.classList.add("output");
    media.dataset.index = output.index;
    const link = document.createElement("a");
    link.href = url;
    link.download = jobId + "-" + output.index + "." + extension(output, type);
    link.className = "download";
    link.textContent = "download";
    const caption = document.createElement("figcaption");
    const facts = [type, output.width && output.width + "×" + output.height,
      output.frames > 1 && output.frames + " frames", output.bytes && output.bytes + " bytes"];
    caption.append(facts.filter(Boolean).join(", ") + " · ", link);
    figure.replaceChildren(media, caption);
    figure.dataset.state = "shown";
  }

  function extension(output, type) {
    const key = output.key || "";
    const dot = key.lastIndexOf(".");
    if (dot > key.lastIndexOf("/")) return key.slice(dot + 1);
    return (type.split("/")[1] || "bin").replace("jpeg", "jpg");
  }

  // --- lists ---------------------------------------------------------------------------------

  let timer = null;

  function startRefreshing() {
    stopRefreshing();
    refresh();
    timer = setInterval(refresh, REFRESH_MS);
  }

  function stopRefreshing() {
    if (timer !== null) clearInterval(timer);
    timer = null;
  }

  function refresh() {
    if (document.hidden || $("app").hidden) return;
    refreshJobs().catch(() => {});
    refreshBatches().catch(() => {});
    refreshDeadLetters().catch(() => {});
    refreshCluster().catch(() => {});
  }

  function cell(content, className) {
    const td = document.createElement("td");
    if (content instanceof Node) td.append(content);
    else td.textContent = content === null || content === undefined ? "" : String(content);
    if (className) td.className = className;
    return td;
  }

  function ago(seconds) {
    const delta = Math.max(0, Date.now() / 1000 - seconds);
    if (delta < 60) return Math.round(delta) + " s ago";
    if (delta < 3600) return Math.round(delta / 60) + " min ago";
    return Math.round(delta / 3600) + " h ago";
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 60) return Math.round(seconds) + " s";
    return Math.round(seconds / 60) + " min";
  }

  function expectedStart(job) {
    if (job.estimated_start_s === null || job.estimated_start_s === undefined) return "unknown";
    return "in ~" + duration(job.estimated_start_s);
  }

  function progressText(job) {
    if (!job.progress) return job.status === "succeeded" ? "done" : "";
    const p = job.progress;
    return p.stage + (p.total ? " " + (p.step || 0) + "/" + p.total : "");
  }

  async function refreshJobs() {
    const page = await api("v1/jobs?limit=20");
    const queued = page.jobs.filter((job) => job.status === "queued").slice(0, MAX_WAIT_LOOKUPS);
    // a list leaves queue_position and estimated_start_s out: each queued job's own view has them
    const views = await Promise.all(
      queued.map((job) => api("v1/jobs/" + encodeURIComponent(job.id)).catch(() => job)),
    );
    const full = new Map(views.map((view) => [view.id, view]));
    $("jobs-body").replaceChildren(
      ...page.jobs.map((listed) => {
        const job = full.get(listed.id) || listed;
        const row = document.createElement("tr");
        row.dataset.id = job.id;
        const open = document.createElement("button");
        open.type = "button";
        open.className = "link";
        open.textContent = job.id.slice(0, 8);
        open.title = "watch " + job.id;
        open.addEventListener("click", () => watch(job));
        const prompt = (job.parameters && job.parameters.prompt) || "";
        row.append(
          cell(open),
          cell(job.parameters && job.parameters.pipeline),
          cell(job.status, "status " + job.status),
          cell(progressText(job)),
          cell(job.status === "queued" ? expectedStart(job) : ""),
          cell(ago(job.created_at)),
          cell(prompt.length > 60 ? prompt.slice(0, 59) + "…" : prompt),
        );
        return row;
      }),
    );
  }

  async function refreshBatches() {
    const page = await api("v1/batches?limit=10");
    $("batches-body").replaceChildren(
      ...page.batches.map((batch) => {
        const c = batch.counts;
        const done = c.succeeded + c.failed + c.canceled + c.expired + c.invalid;
        const row = document.createElement("tr");
        row.dataset.id = batch.id;
        row.append(
          cell(batch.id.slice(0, 8)),
          cell(batch.outcome ? batch.status + " (" + batch.outcome + ")" : batch.status,
            "status " + batch.status),
          cell(done + " / " + c.total),
          cell(c.failed),
          cell(c.queued + c.pending),
          cell(c.running),
          cell(duration(batch.eta_s)),
          cell(ago(batch.created_at)),
        );
        return row;
      }),
    );
  }

  // Jobs that failed for good (docs/contract.md §5a), the key's own or, for an admin key, all.
  async function refreshDeadLetters() {
    const page = await api("v1/dead-letters?limit=10");
    const rows = page.dead_letters.map((letter) => {
      const row = document.createElement("tr");
      row.dataset.id = letter.id;
      const error = letter.error || {};
      const text = (error.type || "") + (error.message ? ": " + error.message : "");
      const poison = letter.poison ? " [poison: " + letter.poison + "]" : "";
      row.append(
        cell(letter.id.slice(0, 8)),
        cell(letter.pipeline),
        cell(ago(letter.dead_at)),
        cell(letter.attempts),
        cell((text.length > 80 ? text.slice(0, 79) + "…" : text) + poison, "status failed"),
        cell(letter.redriven_to ? letter.redriven_to.slice(0, 8) : ""),
      );
      return row;
    });
    if (rows.length === 0) {
      const row = document.createElement("tr");
      const td = cell("no dead letters");
      td.colSpan = 6;
      row.append(td);
      rows.push(row);
    }
    $("dead-body").replaceChildren(...rows);
  }

  async function refreshCluster() {
    const listing = await api("v1/nodes");
    $("nodes-body").replaceChildren(
      ...listing.nodes.map((node) => {
        const state = [
          node.quarantined && "quarantined",
          node.draining && "draining",
          node.asleep && "asleep",
          node.warming && "warming",
        ].filter(Boolean);
        const row = document.createElement("tr");
        row.append(
          cell(node.node_id),
          cell((node.pipelines || []).join(", ")),
          cell((node.devices || []).join(", ")),
          cell(node.jobs_running),
          cell(state.length ? state.join(", ") : "ready"),
        );
        return row;
      }),
    );
    if (listing.nodes.length === 0) {
      const row = document.createElement("tr");
      const td = cell("no live node: jobs wait in their queues");
      td.colSpan = 5;
      row.append(td);
      $("nodes-body").replaceChildren(row);
    }
    await refreshQueues(listing.paused_queues || []);
  }

  // Queue depths are an operator's view (admin keys); other keys see the paused queues only.
  async function refreshQueues(paused) {
    const box = $("queues");
    try {
      const listing = await api("v1/admin/queues");
      const list = document.createElement("ul");
      for (const queue of listing.queues) {
        const item = document.createElement("li");
        item.textContent = queue.queue + ": " + queue.queued + " queued" + (queue.paused ? " (paused)" : "");
        list.append(item);
      }
      box.replaceChildren(list);
    } catch (error) {
      if (error.status !== 403) throw error;
      const note = document.createElement("p");
      note.className = "muted";
      note.textContent =
        "Queue depths need an admin key. Paused queues: " + (paused.length ? paused.join(", ") : "none") +
        ". A queued job's expected start is in the jobs list.";
      box.replaceChildren(note);
    }
  }

  // --- start ---------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("auth-form").addEventListener("submit", useKey);
    $("job-form").addEventListener("submit", submitJob);
    $("pipeline").addEventListener("change", showPipeline);
    $("forget-key").addEventListener("click", () => askForKey(""));
    $("watch-pause").addEventListener("click", () => pauseOrResume("pause"));
    $("watch-resume").addEventListener("click", () => pauseOrResume("resume"));
    document.addEventListener("visibilitychange", refresh);
    start();
  });
})();
