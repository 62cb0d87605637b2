// Drives a running streamproxy's Anthropic Messages API with the Anthropic Node SDK (`@anthropic-ai/sdk`,
// tests/node/package.json) with its defaults: messages.create, the messages.stream() helper (its text events
// and finalMessage()), tools with a tool_use -> tool_result round trip, countTokens, and a typed error.
// Usage: node messages_check.mjs BASE_URL MODEL API_KEY. Prints one JSON object for test_node_messages.py.
import Anthropic from "@anthropic-ai/sdk";

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const tool = {
  name: "get_weather", description: "Weather of a city",
  input_schema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
};
const ask = { model, max_tokens: 500, system: "Be brief.", messages: [{ role: "user", content: "Weather in Oslo?" }] };

const full = await client.messages.create(ask);
const helper = client.messages.stream(ask);
const deltas = [];
helper.on("text", (t) => deltas.push(t));
const final = await helper.finalMessage();
const count = await client.messages.countTokens({ model, system: ask.system, messages: ask.messages });

const withTools = { ...ask, tools: [tool] };
const call = await client.messages.create(withTools);
const streamed = await client.messages.stream(withTools).finalMessage();
const use = call.content.find((b) => b.type === "tool_use");
const answer = await client.messages.create({
  ...withTools,
  messages: [...ask.messages, { role: "assistant", content: call.content },
             { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "Sunny" }] }],
});

let error = null;
try {
  await client.messages.create({ ...ask, messages: [{ role: "user", content: [
    { type: "image", source: { type: "base64", media_type: "image/png", data: "AA==" } }] }] });
} catch (e) {
  error = { class: e.constructor.name, status: e.status, type: e.error?.error?.type, message: e.error?.error?.message };
}

// ids are fresh per request; finalMessage() adds the helper's own parsed_output
const strip = (m) => ({ ...m, id: undefined, parsed_output: undefined, content: m.content.map((b) => ({ ...b, id: undefined })) });
console.log(JSON.stringify({
  full, final, same: JSON.stringify(strip(full)) === JSON.stringify(strip(final)), text: deltas.join(""),
  count: count.input_tokens, call, toolSame: JSON.stringify(strip(call)) === JSON.stringify(strip(streamed)),
  answer, error,
}));
