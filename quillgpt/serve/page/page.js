// serve.py's page: chat with the model, or continue a prompt, through the server's own OpenAI-compatible API.
//
// Safety: what the model writes and what a user pastes is untrusted. It reaches the page only as text
// (textContent, text nodes), never through innerHTML or anything else that parses HTML; the server's
// Content-Security-Policy forbids inline script and other origins besides. The API key, when the server wants one,
// stays in this tab's sessionStorage; conversations and settings stay in localStorage, in this browser only.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "quillgpt.page.";  // localStorage keys: conversations, current, settings, mode, prompt
const KEY_STORE = "quillgpt.page.key";  // sessionStorage: the API key
const SETTINGS = ["temperature", "top_k", "top_p", "max_tokens", "seed", "stop-strings"];
// The calculator tool's tokens as a reply's text spells them (quillgpt/tools.py): a call, then its output
const TOOL_PARTS = {
  "<|python_start|>": ["python", "<|python_end|>"],
  "<|output_start|>": ["python_output", "<|output_end|>"],
};

const state = {
  model: null,  // the model card from /v1/models: id, context_length, chat, tools
  mode: localStorage.getItem(STORE + "mode") || "chat",
  conversations: load("conversations", {}),
  current: localStorage.getItem(STORE + "current"),
  running: null,  // the AbortController of the reply being streamed
};

function load(name, fallback) {
  try {
    return JSON.parse(localStorage.getItem(STORE + name)) ?? fallback;
  } catch {
    return fallback;  // a corrupt entry must not keep the page from starting
  }
}

function save(name, value) {
  localStorage.setItem(STORE + name, JSON.stringify(value));
}

// ---- the server ------------------------------------------------------------------------------------------------

class ServerError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function headers() {
  const key = sessionStorage.getItem(KEY_STORE);
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function api(path, body, signal) {
  let response;
  try {
    const post = body === undefined ? {} : { method: "POST", body: JSON.stringify(body) };
    response = await fetch(path, { ...post, headers: headers(), signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ServerError("cannot reach the server: is serve.py still running?", 0);
  }
  if (!response.ok) throw new ServerError(await errorMessage(response), response.status);
  return response;
}

// The server's refusal in one line: OpenAI's error shape carries the reason (over the context, queue full, ...)
async function errorMessage(response) {
  let message = "";
  try {
    message = (await response.json()).error.message;
  } catch {
    message = response.statusText;
  }
  if (response.status === 401) return "the server refused the API key: " + message;
  return `the server said ${response.status}: ${message}`;
}

// POST a streamed request; onText gets each piece of text. Resolves to the reply's token count and time.
async function stream(path, body, signal, onText) {
  const started = performance.now();
  body = { ...body, stream: true, stream_options: { include_usage: true } };
  const response = await api(path, body, signal);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", chunks = 0, usage = null, finish = null, ended = false;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();  // a line not yet ended
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;  // blank lines end events; ": ping" keeps the connection
      const data = line.slice(5).trim();
      if (data === "[DONE]") {
        ended = true;
        continue;
      }
      const event = JSON.parse(data);
      if (event.error) throw new ServerError("the server failed: " + event.error.message, 500);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      const text = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
      if (text) {
        chunks += 1;
        onText(text);
      }
    }
  }
  if (!ended) throw new ServerError("the reply broke off: the server closed the stream", 0);
  const seconds = (performance.now() - started) / 1000;
  return { tokens: usage ? usage.completion_tokens : chunks, counted: !usage, seconds, cut: finish === "length" };
}

// The sampling settings as the API's fields; an empty field is left out (the server's default)
function sampling() {
  const body = { model: state.model.id };
  for (const field of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const text = $(field).value.trim();
    if (text === "") continue;
    const number = Number(text);
    if (!Number.isFinite(number)) throw new Error(`${field}: "${text}" is not a number`);
    body[field] = number;
  }
  const stop = $("stop-strings").value.split("\n").filter((s) => s !== "").map(unescapeStop);
  if (stop.length) body.stop = stop;
  return body;
}

function unescapeStop(s) {
  return s.replace(/\\(n|t|\\)/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]);
}

// "12 tokens · 40.1 tokens/s", and why it ended when that was not the model's choice (~: counted in the page,
// where the stream did not get as far as the server's count)
function statsText(result, ending = result.cut ? "max tokens reached" : "") {
  const rate = result.seconds > 0 ? (result.tokens / result.seconds).toFixed(1) : "–";
  const tokens = (result.counted ? "~" : "") + result.tokens;
  return `${tokens} tokens · ${rate} tokens/s` + (ending ? " · " + ending : "");
}

// ---- connecting: the key, the model --------------------------------------------------------------------------

async function connect() {
  try {
    const server = await (await fetch("/page/server.json")).json();
    if (server.api_key_required && !sessionStorage.getItem(KEY_STORE)) {
      askForKey("This server needs an API key.");
      return;
    }
    const models = await (await api("/v1/models")).json();
    useModel(models.data[0]);
  } catch (e) {
    if (e.status === 401) askForKey("The server refused that key.");
    else $("model-info").textContent = "not connected";
    showError(e instanceof ServerError ? e.message : "cannot reach the server: " + e.message);
  }
}

// Whether a request may go now: a model to send it to (with its key), and no reply streaming
function canSend() {
  return state.model !== null && state.running === null;
}

function askForKey(note) {
  state.model = null;
  sessionStorage.removeItem(KEY_STORE);  // a refused key is forgotten
  $("key-note").textContent = note;
  $("key-box").hidden = false;
  $("settings").classList.add("open");
  $("model-info").textContent = "no API key";
  updateControls();
  $("api-key").focus();
}

function useKey() {
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("api-key").value = "";
  clearError();
  connect();
}

function useModel(model) {
  state.model = model;
  $("key-box").hidden = true;
  $("model-info").textContent = `${model.id} · ${model.context_length} tokens of context`;
  if ($("max_tokens").value === "") $("max_tokens").value = Math.min(256, Math.floor(model.context_length / 2));
  if (!model.chat) $("mode-chat").title = "this model has no chat template: completion only";
  setMode(model.chat ? state.mode : "completion");
}

// ---- the page's state on screen --------------------------------------------------------------------------------

function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

function setMode(mode) {
  state.mode = mode;
  if (state.model && state.model.chat) localStorage.setItem(STORE + "mode", mode);
  $("chat-view").hidden = mode !== "chat";
  $("completion-view").hidden = mode !== "completion";
  $("sidebar").hidden = mode !== "chat";
  $("mode-chat").setAttribute("aria-pressed", String(mode === "chat"));
  $("mode-completion").setAttribute("aria-pressed", String(mode === "completion"));
  updateControls();
}

// Buttons follow the state: nothing is sent without a model (or a key), one reply streams at a time
function updateControls() {
  const ready = state.model !== null, busy = state.running !== null;
  $("send").disabled = $("generate").disabled = !ready || busy;
  $("mode-chat").disabled = !(ready && state.model.chat) || busy;
  $("mode-completion").disabled = busy;
  $("append").disabled = busy;
  $("stop").hidden = $("stop-completion").hidden = !busy;
  $("send").hidden = busy;
  $("generate").hidden = busy;
  for (const button of document.querySelectorAll(".message .meta button, #new-chat, #conversations button")) {
    button.disabled = busy;
  }
}

function stopReply() {
  if (state.running) state.running.abort();  // the server sees the connection close and frees the request's slot
}

// ---- conversations (localStorage) ----------------------------------------------------------------------------

function conversation() {
  if (!state.conversations[state.current]) newConversation();
  return state.conversations[state.current];
}

function newConversation() {
  const empty = Object.values(state.conversations).find((c) => c.messages.length === 0);
  if (empty) return switchTo(empty.id);  // one blank conversation is enough
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 6);
  state.conversations[id] = { id, title: "New chat", system: "", messages: [], updated: Date.now(), contextStart: 0 };
  switchTo(id);
}

function switchTo(id) {
  state.current = id;
  localStorage.setItem(STORE + "current", id);
  $("system").value = conversation().system;
  saveConversations();
  renderMessages();
}

function deleteConversation(id) {
  delete state.conversations[id];
  if (id !== state.current) return saveConversations();
  const rest = Object.values(state.conversations).sort((a, b) => b.updated - a.updated);
  if (rest.length) switchTo(rest[0].id);
  else newConversation();
}

function saveConversations() {
  save("conversations", state.conversations);
  renderConversationList();
}

function touch(conv) {
  conv.updated = Date.now();
  const first = conv.messages.find((m) => m.role === "user");
  conv.title = first ? first.content.slice(0, 60) : "New chat";
  saveConversations();
}

function renderConversationList() {
  const items = Object.values(state.conversations).sort((a, b) => b.updated - a.updated).map((conv) => {
    const li = element("li", conv.id === state.current ? "current" : "");
    const open = button(conv.title, () => switchTo(conv.id), "open");
    open.title = conv.title;
    const remove = button("×", () => deleteConversation(conv.id), "delete");
    remove.setAttribute("aria-label", "Delete conversation");
    li.append(open, remove);
    return li;
  });
  $("conversations").replaceChildren(...items);
  updateControls();
}

// ---- rendering messages, as text --------------------------------------------------------------------------

function element(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function button(text, onClick, className) {
  const b = element("button", className, text);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

// A reply's text as parts, as the API takes an assistant message that used the calculator: text, python (a call)
// and python_output; a part still being written has `open` set
function replyParts(text) {
  const parts = [];
  let rest = text;
  while (rest) {
    const starts = Object.keys(TOOL_PARTS).map((s) => [rest.indexOf(s), s]).filter(([at]) => at >= 0);
    if (!starts.length) {
      parts.push({ type: "text", text: rest });
      break;
    }
    const [at, start] = starts.sort((a, b) => a[0] - b[0])[0], [type, end] = TOOL_PARTS[start];
    if (at > 0) parts.push({ type: "text", text: rest.slice(0, at) });
    rest = rest.slice(at + start.length);
    const close = rest.indexOf(end);
    parts.push({ type, text: close < 0 ? rest : rest.slice(0, close), open: close < 0 });
    rest = close < 0 ? "" : rest.slice(close + end.length);
  }
  return parts;
}

// What the API is sent for a message: a reply that used the tool as its parts (so the server puts the tool's tokens
// back, not their spelling as text), anything else as its text. A model without the tool has no such tokens: its
// text is only text
function apiContent(message) {
  if (message.role !== "assistant" || !state.model.tools.includes("calculator")) return message.content;
  const parts = replyParts(message.content);
  if (parts.every((p) => p.type === "text")) return message.content;
  return parts.map(({ type, text }) => ({ type, text }));
}

// A calculator call and its output, folded: "calculator" until clicked, then "calculator: 32+36 → 68" on one line
function toolElement(call, output) {
  const result = output === undefined || output.open ? "…" : output.text;
  const detail = element("span", "call", `: ${call.text} → ${result}`);
  detail.hidden = true;
  const name = button("calculator", () => {
    detail.hidden = !detail.hidden;
    name.setAttribute("aria-expanded", String(!detail.hidden));
  }, "tool-name");
  name.setAttribute("aria-expanded", "false");
  const tool = element("span", "tool");
  tool.append(name, detail);
  return tool;
}

function renderContent(container, message) {
  if (message.role !== "assistant") {
    container.textContent = message.content;
    return;
  }
  const parts = replyParts(message.content), nodes = [];
  for (let i = 0; i < parts.length; i++) {
    const part = parts[i];
    if (part.type === "text") nodes.push(document.createTextNode(part.text));
    else if (part.type === "python") {
      const output = parts[i + 1] && parts[i + 1].type === "python_output" ? parts[++i] : undefined;
      nodes.push(toolElement(part, output));
    } else nodes.push(toolElement({ text: "?" }, part));  // an output without its call: shown, not lost
  }
  container.replaceChildren(...nodes);
}

// The reply as a person would paste it: its text, a calculator call as [calculator: 32+36 → 68]
function plainText(message) {
  const shown = { text: (t) => t, python: (t) => `[calculator: ${t} → `, python_output: (t) => t + "]" };
  return replyParts(message.content).map((p) => shown[p.type](p.text)).join("");
}

function messageElement(message, index, messages) {
  const li = element("li", "message " + message.role);
  const content = element("div", "content");
  renderContent(content, message);
  li.append(element("div", "who", message.role === "user" ? "You" : "Model"), content);
  const meta = element("div", "meta");
  const last = index === messages.length - 1;
  if (message.role === "assistant" && !message.streaming) {
    meta.append(button("Copy", (e) => copy(plainText(message), e.target), "copy"));
    if (last) meta.append(button("Regenerate", regenerate, "regenerate"));
    if (message.stats) meta.append(element("span", "stats", message.stats));
  }
  if (message.role === "user" && (last || index === messages.length - 2)) {
    meta.append(button("Edit", () => editMessage(li, index), "edit-button"));
    if (last) meta.append(button("Retry", regenerate, "retry"));  // after a refusal: ask again as it is
  }
  li.append(meta);
  return li;
}

function renderMessages() {
  const conv = conversation(), messages = conv.messages;
  const items = messages.map((m, i) => messageElement(m, i, messages));
  const start = Math.min(conv.contextStart || 0, messages.length);
  if (start > 0) {  // the turns the last request left out: still here, greyed, with a line saying why
    for (const item of items.slice(0, start)) item.classList.add("outside");
    const note = element("li", "context-note", `The model no longer sees the ${start} message${start > 1 ? "s" : ""} ` +
      `above: the conversation outgrew its ${state.model ? state.model.context_length : ""}-token context` +
      `${conv.system.trim() ? " (the system message stays)" : ""}.`);
    items.splice(start, 0, note);
  }
  $("messages").replaceChildren(...items);
  $("messages").scrollTop = $("messages").scrollHeight;
  updateControls();
}

async function copy(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (a page served over plain http to another machine is not a secure context)
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  target.textContent = "Copied";
  setTimeout(() => (target.textContent = "Copy"), 1500);
}

// ---- chat ----------------------------------------------------------------------------------------------------

function send() {
  const text = $("message").value;
  if (!text.trim() || !canSend()) return;
  $("message").value = "";
  conversation().messages.push({ role: "user", content: text });
  reply();
}

function regenerate() {
  if (!canSend()) return;
  const messages = conversation().messages;
  if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  reply();
}

// Edit the last user message in place; sending it drops what followed and asks again
function editMessage(li, index) {
  const messages = conversation().messages;
  const box = element("div", "edit");
  const area = element("textarea");
  area.value = messages[index].content;
  area.rows = 3;
  const resend = button("Send", () => {
    if (!area.value.trim() || !canSend()) return;
    messages.splice(index);
    messages.push({ role: "user", content: area.value });
    reply();
  }, "primary");
  box.append(area, resend, button("Cancel", renderMessages));
  li.querySelector(".content").replaceChildren(box);
  li.querySelector(".meta").replaceChildren();
  area.focus();
}

// The conversation as it fits the model's context, as chat.py fits it: while the reply would have less room than the
// smaller of max tokens and a quarter of the context, the oldest turn (a user message and the replies after it) is
// left out, the system message kept; the reply's max_tokens is then at most the room left. Resolves to the request's
// fields and the index of the first message sent (conv.contextStart: the page shows what the model no longer sees),
// or throws where the last message alone leaves no room.
async function fitted(conv, system) {
  const context = state.model.context_length;
  const setting = $("max_tokens").value.trim() === "" ? null : Number($("max_tokens").value);
  const needed = Math.max(1, Math.min(setting ?? context, Math.floor(context / 4)));
  const starts = conv.messages.map((m, i) => (m.role === "user" ? i : -1)).filter((i) => i >= 0);
  for (let turn = 0; ; turn++) {
    const first = starts[turn] ?? 0;
    const history = conv.messages.slice(first).map((m) => ({ role: m.role, content: apiContent(m) }));
    const messages = system.trim() ? [{ role: "system", content: system }, ...history] : history;
    const room = context - (await tokenCount(messages));
    if (room >= needed || turn >= starts.length - 1) {
      if (room < 1) {
        throw new ServerError(`this message makes a prompt of ${context - room} tokens, and the model's context is ` +
          `${context}: say it in fewer words (or a shorter system message)`, 400);
      }
      return { request: { messages, max_tokens: Math.min(setting ?? room, room) }, first };
    }
  }
}

// How many tokens the server renders these messages into (POST /tokenize, vLLM's)
async function tokenCount(messages) {
  const response = await api("/tokenize", { model: state.model.id, messages });
  return (await response.json()).count;
}

async function reply() {
  const conv = conversation();
  const system = $("system").value;
  renderMessages();  // the message sent, at once: fitting it asks the server first
  let fit;
  try {
    fit = await fitted(conv, system);
  } catch (e) {
    showError(e instanceof ServerError ? e.message : "cannot reach the server: " + e.message);
    renderMessages();
    return;
  }
  conv.contextStart = fit.first;
  const message = { role: "assistant", content: "", streaming: true };
  conv.messages.push(message);
  touch(conv);
  renderMessages();
  const content = $("messages").lastElementChild.querySelector(".content");
  await run("/v1/chat/completions", fit.request, (text) => {
    message.content += text;
    renderContent(content, message);
    $("messages").scrollTop = $("messages").scrollHeight;
  }, (stats) => {
    if (stats === null && message.content === "") conv.messages.pop();  // refused: nothing to keep
    else message.stats = stats;
  });
  delete message.streaming;
  touch(conv);
  renderMessages();
}

// Stream one request, with Stop and errors handled alike for chat and completion; done(stats or null on a refusal)
async function run(path, request, onText, done) {
  clearError();
  let body;
  try {
    body = { ...sampling(), ...request };
  } catch (e) {
    showError(e.message);
    done(null);
    return;
  }
  const controller = new AbortController();
  state.running = controller;
  updateControls();
  const started = performance.now();
  let chunks = 0;
  try {
    const result = await stream(path, body, controller.signal, (text) => {
      chunks += 1;
      onText(text);
    });
    done(statsText(result));
  } catch (e) {
    const sofar = { tokens: chunks, counted: true, seconds: (performance.now() - started) / 1000 };
    if (e.name === "AbortError") done(statsText(sofar, "stopped"));
    else {
      showError(e instanceof ServerError ? e.message : "the reply broke off: " + e.message);
      done(chunks ? statsText(sofar, "broke off") : null);
      if (e.status === 401) askForKey("The server refused that key.");
    }
  } finally {
    state.running = null;
    updateControls();
  }
}

// ---- completion ------------------------------------------------------------------------------------------------

async function generate() {
  if (!canSend()) return;
  const prompt = $("prompt").value;
  $("completion-prompt").textContent = prompt;
  const output = $("completion-text");
  output.textContent = "";
  $("completion-stats").textContent = "";
  await run("/v1/completions", { prompt }, (text) => {
    output.append(text);  // a text node
    $("completion-output").scrollTop = $("completion-output").scrollHeight;
  }, (stats) => ($("completion-stats").textContent = stats || ""));
}

function appendToPrompt() {
  $("prompt").value += $("completion-text").textContent;
  localStorage.setItem(STORE + "prompt", $("prompt").value);
  $("completion-prompt").textContent = $("completion-text").textContent = "";
}

// ---- start -----------------------------------------------------------------------------------------------------

function restoreSettings() {
  const saved = load("settings", {});
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("input", () => {
      saved[id] = $(id).value;
      save("settings", saved);
    });
  }
}

function wire() {
  $("send").addEventListener("click", send);
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stopReply);
  $("stop-completion").addEventListener("click", stopReply);
  $("generate").addEventListener("click", generate);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
  });
  $("append").addEventListener("click", appendToPrompt);
  $("prompt").addEventListener("input", () => localStorage.setItem(STORE + "prompt", $("prompt").value));
  $("new-chat").addEventListener("click", newConversation);
  $("system").addEventListener("input", () => {
    conversation().system = $("system").value;
    save("conversations", state.conversations);
  });
  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-completion").addEventListener("click", () => setMode("completion"));
  $("use-key").addEventListener("click", useKey);
  $("api-key").addEventListener("keydown", (e) => e.key === "Enter" && useKey());
  $("error-close").addEventListener("click", clearError);
  for (const [toggle, panel] of [["toggle-sidebar", "sidebar"], ["toggle-settings", "settings"]]) {
    $(toggle).addEventListener("click", () => $(panel).classList.toggle("open"));
  }
}

wire();
restoreSettings();
for (const conv of Object.values(state.conversations)) {
  for (const m of conv.messages) delete m.streaming;  // a reply cut off by a reload ended there
}
$("prompt").value = localStorage.getItem(STORE + "prompt") || "";
switchTo(conversation().id);
if (conversation().system) $("system-box").open = true;
setMode(state.mode);
connect();
