#!/usr/bin/env node
// An OpenAI-compatible streaming server with exact, known timings, for benchmarking load clients
// (scripts/bench_replay.py). autotune.sim.fixed_timing is the same instrument in Python, for tests; this one is
// not Python so that the server, not the client, is never the bottleneck: one Node process streams tens of
// thousands of SSE events a second on under a core.
//
//     node scripts/fixed_timing_server.js --port 8291 --ttft-ms 5 --itl-ms 5
//
// Every stream writes its first token ttft after the request was read and one token every itl after it,
// exactly max_tokens tokens in vLLM's SSE shapes (completion and chat), then the usage chunk and [DONE].
// GET /truth returns (and forgets), per x-request-id (or a number), the first token's delay as written and the latest any token of the
// stream left against its schedule (the server's own lag: the benchmark checks it stays small).
"use strict";
const http = require("http");

function flag(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : fallback;
}
const host = flag("host", "127.0.0.1");
const port = Number(flag("port", "8291"));
const ttftMs = Number(flag("ttft-ms", "5"));
const itlMs = Number(flag("itl-ms", "5"));
let truth = {};
let unnamed = 0;
const now = () => Number(process.hrtime.bigint()) / 1e6; // ms

function json(res, obj, status = 200) {
  const body = JSON.stringify(obj);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(body) });
  res.end(body);
}

function stream(req, res, body, received) {
  const chat = req.url.endsWith("/chat/completions");
  const n = Number(body.max_tokens) || 16;
  const rid = req.headers["x-request-id"];
  const object = chat ? "chat.completion.chunk" : "text_completion";
  res.writeHead(200, { "content-type": "text/event-stream" });
  let k = 0;
  let first = null;
  let lateMs = 0;
  const tick = () => {
    const due = received + ttftMs + k * itlMs;
    const t = now();
    if (t < due) return setImmediate(tick); // libuv's timers run on a clock cached per loop turn: never early
    lateMs = Math.max(lateMs, t - due);
    if (k === 0) first = t - received;
    const finish = k === n - 1 ? '"length"' : "null";
    const choice = chat
      ? `{"index":0,"delta":${k === 0 ? '{"role":"assistant","content":""}' : '{"content":" tok"}'},"finish_reason":${finish}}`
      : `{"index":0,"text":" tok","finish_reason":${finish}}`;
    res.write(`data: {"id":"x","object":"${object}","model":"fixed-timing","choices":[${choice}]}\n\n`);
    k += 1;
    if (k < n) {
      setTimeout(tick, Math.max(Math.ceil(received + ttftMs + k * itlMs - now()), 0));
      return;
    }
    const usage = `{"prompt_tokens":1,"completion_tokens":${n},"total_tokens":${n + 1}}`;
    res.end(`data: {"id":"x","object":"${object}","model":"fixed-timing","choices":[],"usage":${usage}}\n\ndata: [DONE]\n\n`);
    truth[rid === undefined ? `unnamed-${unnamed++}` : rid] = { ttft: first / 1000, late: lateMs / 1000 };
  };
  setTimeout(tick, Math.max(Math.ceil(received + ttftMs - now()), 0));
}

const server = http.createServer((req, res) => {
  const received = now();
  if (req.method === "GET") {
    if (req.url === "/truth") {
      const seen = truth;
      truth = {};
      return json(res, seen);
    }
    if (req.url === "/v1/models") return json(res, { object: "list", data: [{ id: "fixed-timing", object: "model" }] });
    return json(res, {});
  }
  const parts = [];
  req.on("data", (c) => parts.push(c));
  req.on("end", () => {
    if (req.url !== "/v1/completions" && req.url !== "/v1/chat/completions") return json(res, { error: "not found" }, 404);
    stream(req, res, JSON.parse(Buffer.concat(parts).toString()), received);
  });
});
server.keepAliveTimeout = 60000;
server.listen(port, host, 4096);
process.on("SIGTERM", () => process.exit(0));
