// The built-in chat page of streamproxy (served at /).
//
// A client of the public API only: GET /v1/models and POST /v1/chat/completions with
// stream: true and stream_options.include_usage. The SSE body is read with fetch +
// ReadableStream and a streaming TextDecoder (a UTF-8 character split across two network
// reads is held until complete), and parsed line by line as the HTML Living Standard's
// "text/event-stream" interpretation says: "data:" lines form an event's data, a blank line
// dispatches it, lines starting with ":" are comments (our ": keepalive") and are ignored.
// "[DONE]" ends the reply; a "data: {"error": ...}" event is shown as an error.
//
// Model output is only ever inserted as text (Text nodes / textContent), never as HTML.
// The API key (when the server has --api-key) lives in sessionStorage and is sent as
// "Authorization: Bearer <key>".
"use strict";

(() => {
  const KEY_STORAGE = "streamproxy.apiKey";
  const MODELS_RETRY_MS = 2000;
  const $ = (id) => document.getElementById(id);

  /** An HTTP error response, or an error event inside the stream (status 0). */
  class ApiError extends Error {
    constructor(status, message, { code = null, retryAfter = null } = {}) {
      super(message);
      this.name = "ApiError";
      this.status = status;
      this.code = code;
      this.retryAfter = retryAfter;
    }
  }

  /** The stream ended (or the network failed) before "data: [DONE]". */
  class DroppedError extends Error {
    constructor(message) {
      super(message);
      this.name = "DroppedError";
    }
  }

  /**
   * Incremental text/event-stream parser: push(text) any number of times, in pieces of any
   * size; onData(data) runs once per complete event that has data. Lines end with CRLF, LF
   * or CR; a CR at the very end of a piece is held (it may be the first half of CRLF).
   */
  class SseParser {
    constructor(onData) {
      this.onData = onData;
      this.partial = "";
      this.data = [];
    }

    push(text) {
      const lines = (this.partial + text).split(/\r\n|\r(?!$)|\n/);
      this.partial = lines.pop();
      for (const line of lines) this.line(line);
    }

    line(line) {
      if (line === "") {
        if (this.data.length) {
          const data = this.data.join("\n");
          this.data = [];
          this.onData(data);
        }
        return;
      }
      if (line.startsWith(":")) return; // a comment, e.g. ": keepalive"
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") this.data.push(value);
    }
  }

  // ------------------------------------------------------------------------- API calls

  function apiKey() {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  }

  function headers(withJson) {
    const h = {};
    if (withJson) h["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function errorFrom(response) {
    let message = `HTTP ${response.status} ${response.statusText}`.trim();
    let code = null;
    try {
      const body = await response.json();
      if (body && body.error) {
        message = body.error.message || message;
        code = body.error.code || null;
      }
    } catch (_) {
      // not JSON: keep the status line
    }
    return new ApiError(response.status, message, { code, retryAfter: response.headers.get("Retry-After") });
  }

  /**
   * POST /v1/chat/completions with stream: true; calls onDelta(text) per content delta and
   * onReasoning(text) per thinking delta (reasoning_content, or its newer name reasoning), and
   * resolves with {finishReason, usage} at "[DONE]". Rejects with ApiError (HTTP error or an
   * in-band error event), DroppedError (connection lost), or an AbortError (signal).
   */
  async function streamChat(body, signal, onDelta, onReasoning) {
    let response;
    try {
      response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
      });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new DroppedError(`Could not reach the server (${err.message}).`);
    }
    if (!response.ok) throw await errorFrom(response);
    const result = { finishReason: null, usage: null, done: false };
    const parser = new SseParser((data) => {
      if (result.done) return;
      if (data === "[DONE]") {
        result.done = true;
        return;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) {
        throw new ApiError(0, chunk.error.message || "The server reported an error.", { code: chunk.error.code });
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const thinking = delta.reasoning_content || delta.reasoning;
        if (thinking && onReasoning) onReasoning(thinking);
        if (delta.content) onDelta(delta.content);
        if (choice.finish_reason) result.finishReason = choice.finish_reason;
      }
      if (chunk.usage) result.usage = chunk.usage;
    });
    const reader = response.body.getReader();
    const decoder = new TextDecoder("utf-8");
    try {
      while (!result.done) {
        let read;
        try {
          read = await reader.read();
        } catch (err) {
          if (err.name === "AbortError") throw err;
          throw new DroppedError(`The connection dropped during the reply (${err.message}).`);
        }
        if (read.done) {
          parser.push(decoder.decode() + "\n");
          if (!result.done) throw new DroppedError("The connection closed before the reply was complete.");
          break;
        }
        parser.push(decoder.decode(read.value, { stream: true }));
      }
    } finally {
      reader.cancel().catch(() => {});
    }
    return result;
  }

  // ------------------------------------------------------------------------- the page

  // history: the turns sent with the next request; epoch: bumped by "Clear chat", so a reply that
  // ends after a clear does not bring its turn back
  const state = { history: [], controller: null, epoch: 0, statuses: false };

  function addMessage(role, text) {
    const el = document.createElement("article");
    el.className = "message " + role;
    const meta = document.createElement("div");
    meta.className = "meta";
    const who = document.createElement("span");
    who.className = "role";
    who.textContent = role;
    const info = document.createElement("span");
    info.className = "info";
    meta.append(who, info);
    const body = document.createElement("p");
    body.className = "text";
    const textNode = document.createTextNode(text);
    body.append(textNode);
    el.append(meta, body);
    // the thinking of a reasoning model: collapsed above the answer, created with its first delta
    let thinkingNode = null;
    const thinking = () => {
      if (thinkingNode === null) {
        const details = document.createElement("details");
        details.className = "thinking";
        const summary = document.createElement("summary");
        summary.textContent = "Thinking";
        const p = document.createElement("p");
        p.className = "thinking-text";
        thinkingNode = document.createTextNode("");
        p.append(thinkingNode);
        details.append(summary, p);
        el.insertBefore(details, body);
      }
      return thinkingNode;
    };
    if (role !== "error") {
      const copy = document.createElement("button");
      copy.type = "button";
      copy.className = "copy";
      copy.textContent = "Copy";
      copy.addEventListener("click", () => copyText(textNode.data, copy));
      meta.append(copy);
    }
    const log = $("log");
    log.append(el);
    log.scrollTop = log.scrollHeight;
    return {
      el,
      get text() { return textNode.data; },
      append(delta) {
        textNode.appendData(delta);
        log.scrollTop = log.scrollHeight;
      },
      appendReasoning(delta) {
        thinking().appendData(delta);
        log.scrollTop = log.scrollHeight;
      },
      setInfo(s) { info.textContent = s; },
      setState(s) { el.dataset.state = s; },
    };
  }

  async function copyText(text, button) {
    let ok = false;
    try {
      await navigator.clipboard.writeText(text);
      ok = true;
    } catch (_) {
      // no async clipboard (plain http on another host): a hidden textarea and execCommand
      const area = document.createElement("textarea");
      area.value = text;
      area.setAttribute("readonly", "");
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.append(area);
      area.select();
      try { ok = document.execCommand("copy"); } catch (_e) { ok = false; }
      area.remove();
    }
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }

  function showNotice(text) {
    const n = $("notice");
    n.textContent = text;
    n.hidden = !text;
  }

  function showError(text) {
    addMessage("error", text).setState("error");
  }

  function askForKey(message) {
    $("key-message").textContent = message;
    $("key-form").hidden = false;
    $("api-key").focus();
  }

  function setBusy(controller) {
    state.controller = controller;
    $("send").disabled = controller !== null;
    $("stop").disabled = controller === null;
  }

  function setStats(text) {
    $("stats").textContent = text;
  }

  function describe(err) {
    if (err instanceof ApiError) {
      if (err.status === 0) return `The server ended the reply with an error: ${err.message}`;
      if (err.status === 401) return `Not authorised (401): ${err.message}`;
      if (err.status === 429) {
        const wait = err.retryAfter ? ` Retry after ${err.retryAfter} s.` : "";
        return `The server is busy (429): ${err.message}${wait}`;
      }
      return `Error ${err.status}: ${err.message}`;
    }
    if (err instanceof DroppedError) return err.message;
    return `Unexpected error: ${err.message || err}`;
  }

  function numberField(id, fallback) {
    const v = Number($(id).value);
    return $(id).value.trim() === "" || !Number.isFinite(v) ? fallback : v;
  }

  async function send(text) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history, { role: "user", content: text });
    const body = {
      model: $("model").value,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature", 0.7),
      max_tokens: Math.trunc(numberField("max-tokens", 512)),
    };
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.setState("streaming");
    const controller = new AbortController();
    const epoch = state.epoch;
    const remember = (reply) => {
      if (state.epoch === epoch) state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
    };
    setBusy(controller);
    showNotice("");
    const t0 = performance.now();
    let tFirst = null;
    setStats("TTFT … · – tok/s");
    try {
      const first = () => {
        if (tFirst === null) {
          tFirst = performance.now();
          setStats(`TTFT ${Math.round(tFirst - t0)} ms · … tok/s`);
        }
      };
      const result = await streamChat(body, controller.signal, (delta) => {
        first();
        reply.append(delta);
      }, (delta) => {
        first();
        reply.appendReasoning(delta);
      });
      const tEnd = performance.now();
      reply.setState("done");
      const usage = result.usage;
      const ttft = tFirst === null ? "–" : `${Math.round(tFirst - t0)} ms`;
      if (usage) {
        // decode speed: tokens after the first over the time after the first (as vllm bench's TPOT)
        const n = usage.completion_tokens;
        const secs = tFirst === null ? 0 : (tEnd - tFirst) / 1000;
        const rate = n > 1 && secs > 0 ? ((n - 1) / secs).toFixed(1) : "–";
        setStats(`TTFT ${ttft} · ${rate} tok/s`);
        reply.setInfo(`${n} tokens · ${usage.prompt_tokens} prompt · ${result.finishReason || "?"}`);
      } else {
        setStats(`TTFT ${ttft} · – tok/s`);
        reply.setInfo(result.finishReason || "");
      }
      remember(reply.text);
    } catch (err) {
      if (err.name === "AbortError") {
        reply.setState("stopped");
        reply.setInfo("stopped");
        if (reply.text) remember(reply.text);
      } else {
        reply.setState("failed");
        if (!reply.text) reply.el.remove();
        showError(describe(err));
        if (err instanceof ApiError && err.status === 401) askForKey(describe(err));
        if (!$("prompt").value) $("prompt").value = text;
      }
    } finally {
      if (state.controller === controller) setBusy(null);
      if (state.statuses) loadModels(); // a several-model server: the states moved (a load, an unload)
    }
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: headers(false) });
    } catch (err) {
      showNotice(`Cannot reach the server (${err.message}); retrying…`);
      setTimeout(loadModels, MODELS_RETRY_MS);
      return;
    }
    if (!response.ok) {
      const err = await errorFrom(response);
      if (err.status === 401) {
        askForKey(describe(err));
        return;
      }
      if (err.status === 503) {
        showNotice(`${err.message} Retrying…`);
        setTimeout(loadModels, MODELS_RETRY_MS);
        return;
      }
      showNotice(describe(err));
      return;
    }
    const list = await response.json();
    state.statuses = (list.data || []).some((card) => card.status);
    const select = $("model");
    const previous = select.value;
    select.replaceChildren();
    for (const card of list.data || []) {
      if (card.kind === "embedding") continue; // served by /v1/embeddings only
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.max_model_len ? `${card.id} (${card.max_model_len} ctx)` : card.id;
      // a several-model server: the first message to an unloaded model loads it (keep-alives meanwhile)
      const status = card.status;
      if (status && (status.failed || status.value !== "loaded")) {
        option.textContent += status.failed ? " (failed to load)" : ` (${status.value})`;
      }
      select.append(option);
    }
    if (previous) select.value = previous;
    showNotice("");
    $("key-form").hidden = true;
    document.body.dataset.ready = "true";
  }

  function init() {
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || state.controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
    });
    $("clear").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.epoch += 1;
      state.history = [];
      $("log").replaceChildren();
      showNotice("");
      setStats("TTFT – · – tok/s");
    });
    $("settings-toggle").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("api-key").value.trim();
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
      $("api-key").value = "";
      $("key-form").hidden = true;
      loadModels();
    });
    loadModels();
  }

  // for tests and the curious: the parser and error types, nothing that holds the key
  window.streamproxyChat = { SseParser, ApiError, DroppedError };
  init();
})();
