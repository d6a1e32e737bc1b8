"use strict";
// The chat page: a conversation streamed from /v1/chat/completions, each reply's time to first
// token and tokens/s, and the server's state from /status every second. No dependencies.

const $ = (id) => document.getElementById(id);
const history = []; // the conversation so far: {role, content}
let controller = null; // aborts the reply being streamed

function requestHeaders() {
  const key = $("api-key").value.trim();
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

function scrollDown() {
  const box = $("conversation");
  box.scrollTop = box.scrollHeight;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("conversation").append(div);
  scrollDown();
  return div;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// The data of each server-sent event, as the bytes arrive.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (event.startsWith("data: ")) yield event.slice(6);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function chatBody() {
  const system = $("system").value.trim();
  return {
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
}

// Streams one reply into `text`, noting in `result` as it goes (a stopped reply keeps what it
// got): the first token's time, the usage, the finish reason, the chunks with text.
async function streamReply(text, signal, result) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: requestHeaders(), body: JSON.stringify(chatBody()), signal,
  });
  if (!response.ok) throw new Error(await errorText(response));
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) result.usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.content) {
        result.first ??= performance.now();
        result.chunks += 1;
        text.textContent += choice.delta.content;
        scrollDown();
      }
      if (choice.finish_reason) result.finish = choice.finish_reason;
    }
  }
}

// TTFT, and tokens/s over the generation after the first token. A stopped reply has no usage:
// its streamed chunks, about one token each, are counted instead.
function showStats(reply, started, ended, result) {
  const tokens = result.usage?.completion_tokens ?? result.chunks;
  const stats = document.createElement("span");
  stats.className = "stats";
  const parts = [];
  if (result.first !== null) {
    const ttft = result.first - started;
    const seconds = (ended - result.first) / 1000;
    const rate = tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : 0;
    stats.dataset.ttftMs = ttft.toFixed(0);
    stats.dataset.tokensPerSecond = rate.toFixed(1);
    parts.push(`TTFT ${ttft.toFixed(0)} ms`, `${rate.toFixed(1)} tok/s`);
  }
  parts.push(`${result.usage ? "" : "≈"}${tokens} tokens`, result.finish ?? "stopped");
  stats.textContent = parts.join(" · ");
  reply.append(stats);
}

async function send(message) {
  showError("");
  history.push({ role: "user", content: message });
  addMessage("user", message);
  const reply = addMessage("assistant", "");
  const text = reply.querySelector(".text");
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  const result = { first: null, usage: null, finish: null, chunks: 0 };
  try {
    await streamReply(text, controller.signal, result);
  } catch (error) {
    if (error.name !== "AbortError") showError(error.message);
  } finally {
    controller = null;
    setBusy(false);
  }
  if (!reply.isConnected) return; // the conversation was cleared meanwhile
  history.push({ role: "assistant", content: text.textContent });
  showStats(reply, started, performance.now(), result);
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: requestHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    const [model] = (await response.json()).data;
    $("model-name").textContent = model.id;
    $("model-name").title = model.root ?? model.id;
  } catch (error) {
    $("model-name").textContent = "(unknown model)";
    showError(error.message);
  }
}

// Each user's requests now, as the fair shares hand out slots: "alice: 2 running, 1 waiting".
function usersText(users) {
  const parts = Object.entries(users ?? {}).map(([user, count]) =>
    `${user}: ${count.running} running` + (count.waiting ? `, ${count.waiting} waiting` : ""));
  return parts.length ? parts.join("; ") : "–";
}

// The server's state; tokens/s from the change in its generated-token count between polls.
let last = null;
async function pollStatus() {
  try {
    const response = await fetch("/status", { headers: requestHeaders() });
    if (!response.ok) return;
    const status = await response.json();
    const now = performance.now();
    $("status-running").textContent = status.running;
    $("status-waiting").textContent = status.waiting;
    $("status-kv").textContent = `${(100 * status.kv_usage).toFixed(1)}%`;
    $("status-users").textContent = usersText(status.users);
    if (last) {
      const rate = (status.tokens_generated - last.tokens) / ((now - last.time) / 1000);
      $("status-tps").textContent = rate.toFixed(1);
    }
    last = { tokens: status.tokens_generated, time: now };
  } catch {
    // the server may be restarting: the next poll tries again
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const message = $("message").value.trim();
  if (!message || controller) return;
  $("message").value = "";
  send(message);
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", () => {
  controller?.abort();
  history.length = 0;
  $("conversation").replaceChildren();
  showError("");
});
$("api-key").addEventListener("change", showModel);

showModel();
pollStatus();
setInterval(pollStatus, 1000);
