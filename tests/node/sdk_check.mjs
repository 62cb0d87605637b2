// Drives a running streamproxy with the OpenAI Node SDK (the `openai` npm package, tests/node/package.json).
// Usage: node sdk_check.mjs BASE_URL MODEL. Prints one JSON object for tests/node/test_node_sdk.py.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused", maxRetries: 0, timeout: 120000 });
const messages = [{ role: "user", content: "Write a long story about a dragon who learns to bake bread." }];

const full = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0 });

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
});
const deltas = [];
let role = null;
let finishReason = null;
let usage = null;
let chunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    if (choice.delta.role) role = choice.delta.role;
    if (choice.delta.content) deltas.push(choice.delta.content);
    if (choice.finish_reason) finishReason = choice.finish_reason;
  }
}

const errors = {};
for (const [name, body] of [
  ["empty_messages", { model, messages: [], max_tokens: 4 }],
  ["unknown_model", { model: "no-such-model", messages, max_tokens: 4 }],
  ["stream_bad_request", { model, messages, max_tokens: -1, stream: true }],
]) {
  try {
    const r = await client.chat.completions.create(body);
    if (body.stream) for await (const _ of r) { /* drain */ }
    errors[name] = { status: null };
  } catch (e) {
    errors[name] = {
      status: e.status ?? null, class: e.constructor.name, type: e.type ?? null, param: e.param ?? null,
      message: e.error?.message ?? e.message,
    };
  }
}

console.log(JSON.stringify({
  full: { content: full.choices[0].message.content, finish_reason: full.choices[0].finish_reason, usage: full.usage },
  stream: { text: deltas.join(""), deltas: deltas.length, role, finish_reason: finishReason, usage, chunks },
  errors,
}));
