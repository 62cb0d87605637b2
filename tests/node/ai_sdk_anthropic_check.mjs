// Drives a running streamproxy's Anthropic Messages API with the Vercel AI SDK's Anthropic provider
// (@ai-sdk/anthropic; tests/node/package.json pins the versions): generateText, streamText, and a tool call
// streamed and not. Usage: node ai_sdk_anthropic_check.mjs BASE_URL MODEL API_KEY. Prints one JSON object for
// tests/node/test_node_messages.py.
import { createAnthropic } from "@ai-sdk/anthropic";
import { generateText, streamText, tool } from "ai";
import { z } from "zod";

const [baseURL, model, apiKey] = process.argv.slice(2);
const anthropic = createAnthropic({ baseURL: `${baseURL}/v1`, apiKey });
const errors = [];
const settings = { model: anthropic(model), prompt: "Say hello.", maxOutputTokens: 300, maxRetries: 0 };

const gen = await generateText(settings);
const stream = streamText({ ...settings, onError: ({ error }) => errors.push(String(error)) });
const deltas = [];
for await (const text of stream.textStream) deltas.push(text);

const tools = { get_weather: tool({ description: "Weather of a city", inputSchema: z.object({ city: z.string() }) }) };
const ask = { ...settings, prompt: "Weather in Oslo?", tools };
const called = await generateText(ask);
const streamedCall = streamText({ ...ask, onError: ({ error }) => errors.push(String(error)) });
for await (const _ of streamedCall.fullStream) { /* drain */ }
const calls = (r) => r.map((c) => ({ name: c.toolName, input: c.input }));

console.log(JSON.stringify({
  generate: { text: gen.text, finishReason: gen.finishReason, usage: gen.usage, warnings: gen.warnings },
  stream: { text: deltas.join(""), finishReason: await stream.finishReason, usage: await stream.usage },
  tool: { calls: calls(called.toolCalls), finishReason: called.finishReason, text: called.text },
  streamTool: { calls: calls(await streamedCall.toolCalls), finishReason: await streamedCall.finishReason },
  errors,
}));
