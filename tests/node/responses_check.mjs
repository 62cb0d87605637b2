// Drives a running streamproxy's Responses API with the OpenAI Node SDK (`openai`, tests/node/package.json):
// the same request streamed (`responses.create({stream: true})`) and not, and the stream helper's final response.
// Usage: node responses_check.mjs BASE_URL MODEL. Prints one JSON object for tests/node/test_node_responses.py.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused", maxRetries: 0, timeout: 120000 });
const request = { model, input: "Write a story about a dragon who learns to bake bread.", max_output_tokens: 8, temperature: 0 };

const full = await client.responses.create(request);
const stream = await client.responses.create({ ...request, stream: true });
const types = [];
const sequence = [];
const deltas = [];
let last = null;
for await (const event of stream) {
  types.push(event.type);
  sequence.push(event.sequence_number);
  if (event.type === "response.output_text.delta") deltas.push(event.delta);
  last = event;
}

// guided_choice (passed through as a body field) makes the answer short and complete: finalResponse() needs it
const helper = client.responses.stream({
  model, input: "Say hello.", max_output_tokens: 30, temperature: 0, guided_choice: ["Hello there, friend!"],
});
const helperDeltas = [];
helper.on("response.output_text.delta", (e) => helperDeltas.push(e.delta));
const final = await helper.finalResponse();

console.log(JSON.stringify({
  full: { text: full.output_text, status: full.status, usage: full.usage, incomplete: full.incomplete_details },
  stream: { types, sequence, text: deltas.join(""), deltas: deltas.length, final_text: last.response.output.flatMap((i) => i.content ?? []).map((c) => c.text).join(""),
            status: last.response.status, usage: last.response.usage, incomplete: last.response.incomplete_details },
  helper: { text: helperDeltas.join(""), final_text: final.output_text, status: final.status },
}));
